"""Deliberately broken op tables, to prove that tests and the startup self-check catch a bad kernel.

The failure this project exists to prevent: a causal-conv kernel that zeroed the key channels of every
Gated DeltaNet layer produced well-formed, wrong answers. :func:`zeroed_band_ops` rebuilds that fault on
top of the reference ops. Nothing here is used unless asked for: by a test, or by the environment
variable ``CLEF_FAULT_ZERO_CONV_BAND`` (read only by :func:`ops_from_environment`).
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from clefserve.model.config import BackboneConfig
from clefserve.model.ops.interface import Ops, reference_ops

FAULT_ENV = "CLEF_FAULT_ZERO_CONV_BAND"
BANDS = ("q", "k", "v")


def conv_bands(config: BackboneConfig) -> dict[str, slice]:
    """Channels of the q, k and v bands of the Gated DeltaNet conv: ``[0, Kd)``, ``[Kd, 2Kd)``, the rest."""
    key = config.linear_key_dim
    value = config.linear_value_dim
    return {"q": slice(0, key), "k": slice(key, 2 * key), "v": slice(2 * key, 2 * key + value)}


def zeroed_band_ops(config: BackboneConfig, band: str = "k", base: Ops | None = None) -> Ops:
    """``base`` (the reference ops by default) with a ``causal_conv1d`` that zeroes one band of its output.

    The carried conv state is left intact, as the original faulty kernel did: only the output is wrong.
    """
    if band not in BANDS:
        raise ValueError(f"band must be one of {', '.join(BANDS)}, got {band!r}")
    base = base or reference_ops()
    channels = conv_bands(config)[band]
    conv = base.causal_conv1d

    def causal_conv1d(
        x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, new_state = conv(x, weight, state)
        out = out.clone()
        out[:, channels] = 0
        return out, new_state

    return replace(base, name=f"{base.name}+zeroed-{band}-band", causal_conv1d=causal_conv1d)


def ops_from_environment(config: BackboneConfig, base: Ops | None = None) -> Ops:
    """The ops to serve with: ``base`` (the reference ops by default), unless the environment variable
    ``CLEF_FAULT_ZERO_CONV_BAND`` is ``q``, ``k`` or ``v``: then that band of the conv output is zeroed
    (a fault injected on purpose, for fault-injection tests only).

    The one place that reads the variable. An empty value means no fault; any other value is an error, so
    a typo cannot silently disable a fault-injection test.
    """
    band = os.environ.get(FAULT_ENV, "").strip().lower()
    if not band:
        return base or reference_ops()
    if band not in BANDS:
        raise ValueError(f"{FAULT_ENV}={band!r}: expected one of {', '.join(BANDS)} (or unset)")
    return zeroed_band_ops(config, band, base)
