"""benchmarks/gpu.py's CPU-only parts: its --dry-run builds a tiny release the way the GPU run builds the
9B-shaped one (random weights made on the device, shared with transformers' model), serves it, runs the
reference, and must find the two agreeing. The GPU figures themselves are not measured by the tests."""

from __future__ import annotations

import pytest

from benchmarks import gpu


@pytest.mark.slow
def test_the_gpu_benchmark_dry_run_prints_its_table_and_agrees_with_the_reference(capsys):
    rows = gpu.main(["--dry-run"])
    out = capsys.readouterr().out
    systems = [row["system"] for row in rows[:-1]]
    assert systems == ["clef-serve, concurrency 1", "clef-serve, concurrency 2",
                       "transformers + reference head, one at a time"]
    assert all(row["tokens_per_s"] > 0 and row["mfu"] > 0 for row in rows[:-1])
    assert rows[-1]["max_dp"] <= 1e-4  # fp32: the same weights, the same records
    assert "gated_delta_rule=" in rows[-1]["kernels"] and "why:" in rows[-1]["kernels"]
    assert "prefill tok/s" in out and "max |Δp|" in out
