"""benchmarks.systemone's long-record prefill share: each round's prefill against the peak measured right
after it, never a prefill of one phase of the host against a peak of another."""

from __future__ import annotations

import pytest
import torch

from benchmarks import systemone
from benchmarks.flops import prefill_flops
from clefserve.model.weights import load_backbone


def test_each_rounds_share_is_of_the_peak_measured_beside_it(make_release, monkeypatch):
    folder = make_release()
    events: list[str] = []
    peaks = iter([100e9, 400e9, 200e9])

    def fake_peak(dtype: torch.dtype, sizes: tuple[int, ...], trials: int) -> float:
        events.append("peak")
        assert dtype == torch.float32 and trials == 1
        return next(peaks)

    times = iter([0.5, 0.25, 1.0])

    def fake_timed(fn) -> float:
        fn()
        events.append("prefill")
        return next(times)

    monkeypatch.setattr(systemone, "matmul_peak", fake_peak)
    monkeypatch.setattr(systemone, "_timed", fake_timed)
    result = systemone.long_prefill_utilisation(folder, torch.float32, 40, rounds=3)

    assert events == ["prefill", "peak"] * 3
    flops = prefill_flops(load_backbone(folder).config, 40)
    assert result.arithmetic == torch.float32
    assert result.achieved == pytest.approx([flops / 0.5, flops / 0.25, flops / 1.0])
    assert result.shares == pytest.approx([flops / 0.5 / 100e9, flops / 0.25 / 400e9, flops / 1.0 / 200e9])
