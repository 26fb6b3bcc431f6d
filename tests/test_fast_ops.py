"""The fast torch ops equal the reference ops they replace (clefserve.model.ops.select)."""

from __future__ import annotations

import random

import pytest
import torch

from clefserve.model.ops.attention import causal_attention, causal_attention_split_cpu
from clefserve.model.ops.delta_rule import (
    SOLVE_MAX_SYSTEMS,
    gated_delta_rule_varlen,
    solve_unit_lower,
    unit_lower_inverse,
)
from clefserve.model.ops.delta_rule_batched import chunk_gated_delta_rule_batched, gated_delta_rule_cpu
from clefserve.model.ops.select import select_ops


def _delta_batch(rng: random.Random, heads: int, v_heads: int, dim: int, dtype: torch.dtype):
    count = rng.randint(1, 6)
    lens = tuple(rng.choice([1, 2, 4, 5, 63, 64, 65, rng.randint(1, 300)]) for _ in range(count))
    pasts = tuple(rng.choice([0, rng.randint(1, 500)]) for _ in range(count))
    gen = torch.Generator().manual_seed(rng.randint(0, 10**6))
    rows = sum(lens)
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    k = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    v = torch.randn(rows, v_heads, dim + 8, generator=gen).to(dtype)
    g = -torch.rand(rows, v_heads, generator=gen) * 2
    beta = torch.rand(rows, v_heads, generator=gen)
    initial = torch.randn(count, v_heads, dim, dim + 8, generator=gen)
    for i, past in enumerate(pasts):
        if past == 0:
            initial[i] = 0
    return q, k, v, g, beta, initial, lens, pasts


@pytest.mark.parametrize("systems", [1, SOLVE_MAX_SYSTEMS, SOLVE_MAX_SYSTEMS + 1, 3 * SOLVE_MAX_SYSTEMS])
def test_unit_lower_solve_matches_a_dense_float64_solve(systems):
    """Both ways of solving (I + L) x = b, LAPACK's triangular solve (every CPU call; few systems
    elsewhere) and the blockwise inverse (many systems off the CPU), agree with a dense solve; the solve
    gives the same bits when it may write into its right-hand sides."""
    gen = torch.Generator().manual_seed(systems)
    strict = (torch.randn(systems, 64, 64, generator=gen) * 0.2).tril(-1)
    rhs = torch.randn(systems, 64, 40, generator=gen)
    want = torch.linalg.solve(strict.double() + torch.eye(64, dtype=torch.float64), rhs.double())
    for got in (solve_unit_lower(strict, rhs), unit_lower_inverse(strict) @ rhs):
        assert got.dtype == torch.float32
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= 1e-5
    got = solve_unit_lower(strict, rhs)
    scratch = rhs.clone()
    with torch.inference_mode():
        assert torch.equal(solve_unit_lower(strict, scratch, overwrite=True), got)
    assert torch.equal(scratch, got)  # the solve wrote its result into the scratch right-hand sides


@pytest.mark.parametrize(("heads", "v_heads"), [(2, 2), (2, 4), (1, 3)])
def test_batched_delta_rule_equals_the_reference_per_sequence(heads, v_heads):
    rng = random.Random(heads * 10 + v_heads)
    for _ in range(12):
        q, k, v, g, beta, initial, lens, pasts = _delta_batch(rng, heads, v_heads, 16, torch.float32)
        want_out, want_state = gated_delta_rule_varlen(q, k, v, g, beta, initial, lens, pasts)
        out, state = chunk_gated_delta_rule_batched(q, k, v, g, beta, initial, lens, pasts)
        assert out.shape == want_out.shape and state.shape == want_state.shape
        # pieces of <= 4 tokens take the recurrent form in the reference, the chunked form here
        assert (out - want_out).abs().max().item() <= 1e-5, (lens, pasts)
        assert (state - want_state).abs().max().item() <= 1e-5, (lens, pasts)


def test_batched_delta_rule_gives_each_sequence_what_it_gets_alone():
    """Batch invariance at the op: a sequence's output and state do not depend on its neighbours."""
    rng = random.Random(5)
    q, k, v, g, beta, initial, lens, pasts = _delta_batch(rng, 2, 4, 16, torch.float32)
    out, state = chunk_gated_delta_rule_batched(q, k, v, g, beta, initial, lens, pasts)
    start = 0
    for i, (n, past) in enumerate(zip(lens, pasts, strict=True)):
        rows = slice(start, start + n)
        alone, alone_state = chunk_gated_delta_rule_batched(
            q[rows], k[rows], v[rows], g[rows], beta[rows], initial[i : i + 1], (n,), (past,))
        assert torch.equal(out[rows], alone)
        assert torch.equal(state[i], alone_state[0])
        start += n


def test_batched_delta_rule_in_bf16_keeps_an_fp32_state():
    rng = random.Random(2)
    q, k, v, g, beta, initial, lens, pasts = _delta_batch(rng, 2, 4, 16, torch.bfloat16)
    want_out, want_state = gated_delta_rule_varlen(q, k, v, g, beta, initial, lens, pasts)
    out, state = chunk_gated_delta_rule_batched(q, k, v, g, beta, initial, lens, pasts)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert (out.float() - want_out.float()).abs().max().item() <= 2e-2
    assert (state - want_state).abs().max().item() <= 1e-4


def _step(lens: tuple[int, ...], pasts: tuple[int, ...], dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows, count = sum(lens), len(lens)
    q, k = torch.randn(rows, 2, dim, generator=gen), torch.randn(rows, 2, dim, generator=gen)
    v = torch.randn(rows, 4, dim, generator=gen)
    g, beta = -torch.rand(rows, 4, generator=gen) * 2, torch.rand(rows, 4, generator=gen)
    initial = torch.randn(count, 4, dim, dim, generator=gen) * 0.1
    return q, k, v, g, beta, initial, lens, pasts


@pytest.mark.parametrize(("lens", "pasts", "dim", "batched"), [
    ((40, 120, 64, 9), (36, 0, 100, 500), 32, True),  # several short pieces, small heads: one batched call
    ((300, 200, 250), (0, 64, 0), 16, True),  # longer pieces, 16-wide heads: still little work each
    ((300, 200), (0, 64), 32, False),  # long pieces for 32-wide heads
    ((40, 120, 64), (0, 0, 7), 64, False),  # large heads
    ((40, 3, 64), (0, 0, 7), 16, False),  # a piece for the recurrent form
    ((100,), (17,), 16, False),  # one sequence
])
def test_cpu_delta_rule_choice_keeps_every_sequence_s_numbers(monkeypatch, lens, pasts, dim, batched):
    """Whichever form the step gets, each sequence's output and state are those of the per-sequence
    reference (the chunked forms do the same arithmetic): the choice cannot break batch invariance."""
    import clefserve.model.ops.delta_rule_batched as module

    calls = []
    monkeypatch.setattr(module, "chunk_gated_delta_rule_batched",
                        lambda *a: calls.append(a) or chunk_gated_delta_rule_batched(*a))
    args = _step(lens, pasts, dim, seed=sum(lens))
    out, state = gated_delta_rule_cpu(*args)
    want_out, want_state = gated_delta_rule_varlen(*args)
    assert bool(calls) == batched
    assert (out - want_out).abs().max().item() <= 1e-6
    assert (state - want_state).abs().max().item() <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (8, 2), (4, 1)])
def test_split_attention_equals_masked_attention(dtype, heads, kv_heads):
    gen = torch.Generator().manual_seed(heads + kv_heads)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    for steps, past in ((1, 0), (7, 0), (1, 1), (1, 300), (64, 17), (200, 1000), (33, 33)):
        q = torch.randn(steps, heads, 32, generator=gen).to(dtype)
        k = torch.randn(past + steps, kv_heads, 32, generator=gen).to(dtype)
        v = torch.randn(past + steps, kv_heads, 32, generator=gen).to(dtype)
        want = causal_attention(q, k, v, past)
        got = causal_attention_split_cpu(q, k, v, past)
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.float() - want.float()).abs().max().item() <= tolerance, (steps, past)


def test_kernel_selection():
    cpu = torch.device("cpu")
    reference = select_ops(cpu, torch.float32, "reference")
    assert reference.name == "torch-reference"
    assert reference.kernels()["gated_delta_rule"] == "delta_rule.gated_delta_rule_varlen"
    fast = select_ops(cpu, torch.float32, "auto")
    assert fast.kernels()["gated_delta_rule"] == "delta_rule_batched.gated_delta_rule_cpu"
    assert fast.kernels()["causal_attention"] == "attention.causal_attention_split_cpu"
    with pytest.raises(ValueError, match="--kernels"):
        select_ops(cpu, torch.float32, "fastest")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_projection_rows_do_not_depend_on_the_call_and_round_like_the_dtype(dtype):
    from clefserve.model.ops import gemm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 96, generator=gen).to(dtype)
    weight = (torch.randn(80, 96, generator=gen) / 10).to(dtype)
    whole = gemm.linear(x, weight)
    assert whole.dtype == dtype
    for rows in (1, 2, 15, 16, 17, 40):
        assert torch.equal(gemm.linear(x[:rows], weight), whole[:rows])
    exact = x.double() @ weight.double().t()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((whole.double() - exact).abs() / (exact.abs() + 1)).max().item() <= tolerance


@pytest.mark.parametrize(("flags", "onednn", "native"), [
    ("fpu avx2 avx512f avx512bw avx512_vnni", True, False),  # Ice Lake: oneDNN emulates bf16
    ("fpu avx2 avx512f avx512_bf16", True, True),  # Cooper Lake, Zen 4
    ("fpu avx512f amx_bf16 amx_tile", True, True),  # Sapphire Rapids
    ("fpu avx2 fma", False, False),  # AVX2: no oneDNN bf16 at all
    (None, True, True),  # flags unreadable (not x86 Linux): oneDNN's word
])
def test_low_precision_projections_run_natively_only_on_cpus_with_instructions_for_them(
        monkeypatch, tmp_path, flags, onednn, native):
    from clefserve.model.ops import gemm

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n" if flags else "processor\t: 0\n")
    monkeypatch.setattr(gemm.platform, "machine", lambda: "x86_64")
    read = gemm.x86_cpu_flags(cpuinfo)
    assert read == (frozenset(flags.split()) if flags else None)
    monkeypatch.setattr(gemm, "x86_cpu_flags", lambda: read)
    monkeypatch.setattr(gemm, "onednn_supports", lambda dtype: onednn)
    gemm.native_low_precision.cache_clear()
    try:
        assert gemm.native_low_precision(torch.bfloat16) is native
        assert gemm.compute_dtype(torch.device("cpu"), torch.bfloat16) == (
            torch.bfloat16 if native else torch.float32)
        assert gemm.compute_dtype(torch.device("cpu"), torch.float32) == torch.float32
    finally:
        gemm.native_low_precision.cache_clear()
