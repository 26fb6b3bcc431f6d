"""Channel-band test of the Gated DeltaNet causal conv.

The failure this product exists to prevent: a conv kernel that zeroed the key band returned well-formed,
wrong answers. Perturbing one band (q, k or v) of the conv input must change every channel of exactly
that band of the output and nothing else; a conv that zeroes a band must be caught.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from clefserve.model.config import BackboneConfig
from clefserve.model.ops import conv, reference_ops
from clefserve.model.weights import load_backbone
from tests.backbone_specs import BACKBONE_SPECS
from tests.oracles import reference_backbone, reference_text_model

ConvFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


def bands(config: BackboneConfig) -> dict[str, slice]:
    k = config.linear_key_dim
    return {"q": slice(0, k), "k": slice(k, 2 * k), "v": slice(2 * k, 2 * k + config.linear_value_dim)}


def band_violations(conv_fn: ConvFn, config: BackboneConfig, steps: int = 50, seed: int = 0) -> list[str]:
    """What a perturbation of each input band changed that it should not have, or failed to change."""
    gen = torch.Generator().manual_seed(seed)
    channels, kernel = config.conv_dim, config.linear_conv_kernel_dim
    weight = torch.randn(channels, kernel, generator=gen)
    state = torch.randn(kernel - 1, channels, generator=gen)
    x = torch.randn(steps, channels, generator=gen)
    base, base_state = conv_fn(x, weight, state)
    problems = []
    for name, band in bands(config).items():
        bumped = x.clone()
        bumped[:, band] += torch.randn(steps, band.stop - band.start, generator=gen)
        out, out_state = conv_fn(bumped, weight, state)
        changed = (out != base).any(dim=0)
        inside = torch.zeros(channels, dtype=torch.bool)
        inside[band] = True
        if not changed[inside].all():
            problems.append(
                f"perturbing band {name} left {int((~changed[inside]).sum())} of its channels unchanged"
            )
        if changed[~inside].any():
            problems.append(
                f"perturbing band {name} changed {int(changed[~inside].sum())} channels outside it"
            )
        state_changed = (out_state != base_state).any(dim=0)
        if not state_changed[inside].all() or state_changed[~inside].any():
            problems.append(f"perturbing band {name} changed the carried state outside that band")
    return problems


def zero_band_conv(band: slice) -> ConvFn:
    """A deliberately broken conv, like the kernel that zeroed the key channels."""

    def broken(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None):
        out, new_state = conv.causal_conv1d(x, weight, state)
        out = out.clone()
        out[:, band] = 0
        return out, new_state

    return broken


def test_reference_conv_keeps_every_band(make_release):
    for name, spec in BACKBONE_SPECS.items():
        config = BackboneConfig.from_folder(make_release(spec, seed=len(name)))
        assert band_violations(conv.causal_conv1d, config) == []


def test_band_check_catches_a_conv_that_zeroes_a_band(make_release):
    config = BackboneConfig.from_folder(
        make_release(BACKBONE_SPECS["ratio2-6layers"], seed=len("ratio2-6layers"))
    )
    for name, band in bands(config).items():
        problems = band_violations(zero_band_conv(band), config)
        assert any(f"band {name} left" in p for p in problems), problems


@torch.inference_mode()
def test_zeroed_key_band_makes_the_backbone_disagree_with_transformers(make_release):
    name = "ratio2-6layers"
    folder = make_release(BACKBONE_SPECS[name], seed=len(name))
    ours, ref = load_backbone(folder), reference_backbone(folder)
    ids = torch.randint(0, ours.config.vocab_size, (200,), generator=torch.Generator().manual_seed(5))
    expected = reference_text_model(ref)(input_ids=ids[None], use_cache=False).last_hidden_state[0]
    assert (ours.run_sequence(ids)[0] - expected).abs().max() <= 1e-4
    ours.set_ops(
        replace(reference_ops(), name="broken", causal_conv1d=zero_band_conv(bands(ours.config)["k"]))
    )
    assert (ours.run_sequence(ids)[0] - expected).abs().max() > 1e-1
