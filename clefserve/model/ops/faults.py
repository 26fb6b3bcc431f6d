"""Deliberately broken op tables, to prove that tests, the startup self-check and the live audit catch a
bad kernel.

The failure this project exists to prevent: a causal-conv kernel that zeroed the key channels of every
Gated DeltaNet layer produced well-formed, wrong answers. :func:`zeroed_band_ops` rebuilds that fault on
top of the reference ops, for every token or only for tokens at or past a position (a fault that short
records, such as the startup canaries, never reach). Nothing here is used unless asked for: by a test, or
by the environment variable ``CLEF_FAULT_ZERO_CONV_BAND`` (read only by :func:`ops_from_environment`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import torch

from clefserve.model.config import BackboneConfig
from clefserve.model.ops.interface import Ops, reference_ops

FAULT_ENV = "CLEF_FAULT_ZERO_CONV_BAND"
BANDS = ("q", "k", "v")
_SPEC = re.compile(r"(?P<band>[a-z]+)(?:@(?P<position>\d+))?")


@dataclass(frozen=True)
class ConvBandFault:
    """Zero ``band`` of the conv output for the tokens at positions ``>= from_position``."""

    band: str
    from_position: int = 0


def parse_fault(value: str) -> ConvBandFault | None:
    """``BAND`` or ``BAND@POSITION`` (``k``, ``v@2048``); empty means no fault. Anything else is an error,
    so that a typo cannot silently disable a fault-injection test."""
    value = value.strip().lower()
    if not value:
        return None
    match = _SPEC.fullmatch(value)
    if match is None or match["band"] not in BANDS:
        raise ValueError(
            f"{FAULT_ENV}={value!r}: expected one of {', '.join(BANDS)}, optionally followed by @POSITION "
            "(e.g. k@2048: only tokens at positions >= 2048), or unset"
        )
    return ConvBandFault(match["band"], int(match["position"] or 0))


def conv_bands(config: BackboneConfig) -> dict[str, slice]:
    """Channels of the q, k and v bands of the Gated DeltaNet conv: ``[0, Kd)``, ``[Kd, 2Kd)``, the rest."""
    key = config.linear_key_dim
    value = config.linear_value_dim
    return {"q": slice(0, key), "k": slice(key, 2 * key), "v": slice(2 * key, 2 * key + value)}


def zeroed_band_ops(
    config: BackboneConfig, band: str = "k", base: Ops | None = None, from_position: int = 0
) -> Ops:
    """``base`` (the reference ops by default) whose conv output has one band zeroed, for every token
    (``from_position`` 0) or for the tokens at positions ``>= from_position`` only.

    The carried conv state is left intact, as the original faulty kernel did: only the output is wrong.
    """
    if band not in BANDS:
        raise ValueError(f"band must be one of {', '.join(BANDS)}, got {band!r}")
    if from_position < 0:
        raise ValueError(f"from_position must be >= 0, got {from_position}")
    base = base or reference_ops()
    if from_position > 0:
        return late_zeroed_band_ops(band, from_position, base)
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


def late_zeroed_band_ops(band: str, from_position: int, base: Ops) -> Ops:
    """The zeroed conv band of :func:`zeroed_band_ops`, but only for tokens at positions ``>= from_position``.

    The conv op is not told where its rows sit in the sequence; its only consumer, the delta rule, is (it
    gets ``past``, the tokens before the call). The q, k and v bands of the conv output are exactly the
    delta rule's ``q``, ``k`` and ``v`` inputs, so zeroing them there for the late rows is the same fault.
    """
    index = BANDS.index(band)
    rule = base.gated_delta_rule

    def gated_delta_rule(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        initial: torch.Tensor, seq_lens: tuple[int, ...], past_lens: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        late = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
        start = 0
        for n, past in zip(seq_lens, past_lens, strict=True):
            first = max(0, from_position - past)  # first row of this sequence at or past the position
            if first < n:
                late[start + first : start + n] = True
            start += n
        if bool(late.any()):
            qkv = [q, k, v]
            qkv[index] = qkv[index].masked_fill(late[:, None, None], 0)
            q, k, v = qkv
        return rule(q, k, v, g, beta, initial, seq_lens, past_lens)

    name = f"{base.name}+zeroed-{band}-band@{from_position}"
    return replace(base, name=name, gated_delta_rule=gated_delta_rule)


def ops_from_environment(config: BackboneConfig, base: Ops | None = None) -> Ops:
    """The ops to serve with: ``base`` (the reference ops by default), unless the environment variable
    ``CLEF_FAULT_ZERO_CONV_BAND`` asks for a fault (see :func:`parse_fault`): ``k`` zeroes the key band of
    the conv output everywhere, ``k@2048`` only for tokens at positions >= 2048 (a fault injected on
    purpose, for fault-injection tests only).

    The one place that reads the variable. An empty value means no fault; any other value that
    :func:`parse_fault` does not accept is an error.
    """
    fault = parse_fault(os.environ.get(FAULT_ENV, ""))
    if fault is None:
        return base or reference_ops()
    return zeroed_band_ops(config, fault.band, base, fault.from_position)
