"""The GPU path's decisions, checked on a CPU with made-up devices: kernel selection and its fallbacks,
the dtype rules of a V100, and memory planning (fake device budgets)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from clefserve.config import EngineConfig
from clefserve.engine.memory import GIB, MemoryBudget, hidden_row_bytes, measure_memory, plan_pools
from clefserve.errors import StartupError
from clefserve.model.config import BackboneConfig
from clefserve.model.device import DeviceFacts, check_dtype, device_facts
from clefserve.model.ops import select
from clefserve.model.ops.attention import causal_attention
from clefserve.model.ops.attention_fused import causal_attention_split
from clefserve.model.ops.select import OpShapes, fla_unavailable, select_ops
from clefserve.model.weights import expected_weight_bytes, load_backbone, weights_fit_error
from clefserve.testing.release import ReleaseSpec

CPU = torch.device("cpu")
V100 = DeviceFacts("cuda", "Tesla V100-SXM2-32GB", (7, 0), 32 << 30)
A100 = DeviceFacts("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), 80 << 30)
H200 = DeviceFacts("cuda", "NVIDIA H200", (9, 0), 141 << 30)

# Qwen3.5-9B's text config (hidden 4096, 32 layers 3:1, GDN 16/32 heads of 128, attention 16/4 of 256)
NINE_B = BackboneConfig.from_dict({
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320,
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25},
})


# ---- dtype rules -----------------------------------------------------------------------------------------


def test_a_gpu_without_bf16_refuses_bf16_with_a_clear_message():
    with pytest.raises(StartupError, match=r"--dtype bf16: Tesla V100.*sm70.*no bf16.*--dtype f16"):
        check_dtype(V100, torch.bfloat16)
    check_dtype(V100, torch.float16)
    check_dtype(V100, torch.float32)
    check_dtype(A100, torch.bfloat16)
    check_dtype(device_facts(CPU), torch.bfloat16)


def test_f16_keeps_gates_norms_and_the_recurrent_state_in_fp32(make_release):
    model = load_backbone(make_release(ReleaseSpec(head=None), seed=1), dtype=torch.float16)
    seen = {}
    ops = model.ops

    def spy(q, k, v, g, beta, initial, seq_lens, past_lens):
        seen.update(q=q.dtype, g=g.dtype, beta=beta.dtype, initial=initial.dtype)
        out, state = ops.gated_delta_rule(q, k, v, g, beta, initial, seq_lens, past_lens)
        seen["state"] = state.dtype
        return out, state

    from dataclasses import replace

    model.set_ops(replace(ops, gated_delta_rule=spy))
    hidden, state = model.run_sequence(torch.arange(40) % model.config.vocab_size)
    assert seen == dict(q=torch.float16, g=torch.float32, beta=torch.float32, initial=torch.float32,
                        state=torch.float32)
    assert hidden.dtype == torch.float16 and torch.isfinite(hidden).all()
    assert all(r.dtype == torch.float32 for r in state.recurrent.values())
    for name, param in model.named_parameters():
        if name.endswith(("norm.weight", "A_log", "dt_bias")):
            assert param.dtype == torch.float32, name


# ---- kernel selection ------------------------------------------------------------------------------------


def test_cpu_auto_never_imports_fla_or_triton():
    ops = select_ops(CPU, torch.float32, "auto")
    assert ops.kernels()["gated_delta_rule"] == "delta_rule_batched.gated_delta_rule_cpu"
    assert "fla" not in sys.modules and "triton" not in sys.modules


def test_fast_on_a_cpu_without_the_interpreter_is_a_clear_startup_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(StartupError, match=r"--kernels fast on a CPU: .*TRITON_INTERPRET=1.*--kernels auto"):
        select_ops(CPU, torch.float32, "fast")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(select.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(StartupError, match="not installed"):
        select_ops(CPU, torch.float32, "fast")
    assert "fla" not in sys.modules


def test_fla_capability_rules(monkeypatch):
    monkeypatch.setattr(select.importlib.util, "find_spec", lambda name: object())  # pretend installed
    monkeypatch.setattr(select, "_version", lambda package: (3, 3, 1))
    assert "triton >= 3.4" in fla_unavailable(V100, torch.float16)
    assert fla_unavailable(A100, torch.bfloat16) is None
    monkeypatch.setattr(select, "_version", lambda package: (3, 9, 0))
    assert fla_unavailable(V100, torch.float16) is None
    old = DeviceFacts("cuda", "Tesla P100", (6, 0))
    assert "7.0" in fla_unavailable(old, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "bf16" in fla_unavailable(device_facts(CPU), torch.bfloat16)
    assert fla_unavailable(device_facts(CPU), torch.float16) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gpu_without_fla_falls_back_op_by_op_and_says_why(dtype, caplog):
    """A made-up H200 whose tensors are CPU tensors: fla is not installed here, so the delta rule falls back
    to the torch ops; flash attention fails its probe (no such CPU kernel), so attention takes the split
    form, whose probe passes. Every choice carries its reason."""
    caplog.set_level(logging.WARNING, logger="clefserve.model.ops.select")
    shapes = OpShapes(head_dim=32)
    ops = select_ops(CPU, dtype, "auto", shapes, facts=H200)
    kernels, reasons = ops.kernels(), dict(ops.reasons)
    assert kernels["gated_delta_rule"] == "delta_rule_batched.chunk_gated_delta_rule_batched"
    assert "torch fallback" in reasons["gated_delta_rule"] and "not installed" in reasons["gated_delta_rule"]
    assert kernels["causal_conv1d"] == "conv.causal_conv1d"
    assert kernels["causal_attention"] == "attention_fused.causal_attention_split"
    assert "NVIDIA H200" in reasons["causal_attention"]
    assert any("falls back" in r.getMessage() for r in caplog.records)
    assert "why:" in select.describe(ops, CPU, dtype)
    with pytest.raises(StartupError, match="--kernels fast: no fused kernel for gated_delta_rule"):
        select_ops(CPU, dtype, "fast", shapes, facts=H200)
    assert "fla" not in sys.modules


def test_a_kernel_that_fails_its_probe_is_not_chosen():
    def wrong(q, k, v, past):
        return causal_attention(q, k, v, past) * 1.5

    def raising(q, k, v, past):
        raise RuntimeError("no kernel image is available for execution on the device")

    def probe(impl):
        return select._probe(select._probe_attention, impl, CPU, torch.float32, OpShapes())

    assert "disagrees" in probe(wrong)
    assert "no kernel image" in probe(raising)
    assert probe(causal_attention_split) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (8, 2), (4, 1)])
def test_the_cuda_split_attention_equals_masked_attention(dtype, heads, kv_heads):
    """The fold of grouped query heads into rows and the log-sum-exp merge, run here on the CPU kernel."""
    gen = torch.Generator().manual_seed(heads * kv_heads)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    for steps, past in ((1, 0), (5, 0), (1, 1), (1, 300), (64, 17), (120, 700), (33, 33)):
        q = torch.randn(steps, heads, 32, generator=gen).to(dtype)
        k = torch.randn(past + steps, kv_heads, 32, generator=gen).to(dtype)
        v = torch.randn(past + steps, kv_heads, 32, generator=gen).to(dtype)
        got, want = causal_attention_split(q, k, v, past), causal_attention(q, k, v, past)
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.float() - want.float()).abs().max().item() <= tolerance, (steps, past)


# ---- memory planning -------------------------------------------------------------------------------------


def _config(**overrides) -> EngineConfig:
    values = dict(max_num_seqs=8, max_length=16384, prefill_chunk_size=1024, kv_fraction=0.3, block_size=16)
    values.update(overrides)
    return EngineConfig(**values)


def test_cpu_weights_that_are_still_the_files_memory_count_as_used(make_release):
    folder = make_release(ReleaseSpec(head=None), seed=2)  # an fp32 release
    model = load_backbone(folder)
    assert model.file_mapped_bytes == model.weight_bytes == expected_weight_bytes(model.config, torch.float32)
    converted = load_backbone(folder, dtype=torch.bfloat16, widen=False)  # converted copies: anonymous memory
    assert converted.weight_bytes == expected_weight_bytes(model.config, torch.bfloat16)
    assert converted.file_mapped_bytes < converted.weight_bytes // 10
    config = _config(max_num_seqs=2, max_length=1000)
    budget = measure_memory(model, config)
    assert budget.file_mapped_bytes == model.weight_bytes
    assert budget.hidden_bytes == 2 * 1000 * model.config.hidden_size * 4
    assert budget.usable_bytes == budget.free_bytes - model.weight_bytes - budget.hidden_bytes


def test_the_issue_example_a_9b_bf16_release_on_a_24_gib_machine():
    """18.8 GB of file-mapped bf16 weights on a 24 GiB machine: MemAvailable still counts them as free, so
    the old plan took 0.3 x 21.3 GB = 6.4 GB of KV on top of them."""
    weights = expected_weight_bytes(NINE_B, torch.bfloat16)
    assert 16.5 * GIB < weights < 17 * GIB  # 17.9 GB of backbone weights (18.8 GB with vision and MTP)
    available = int(21.3e9)
    config = _config()
    old = plan_pools(NINE_B, config, torch.bfloat16, CPU, available)
    assert old.kv_bytes > 6.3e9
    hidden = hidden_row_bytes(NINE_B, config, torch.bfloat16)
    budget = MemoryBudget(available, "cpu", weights, weights, 0, hidden)
    new = plan_pools(NINE_B, config, torch.bfloat16, CPU, budget)
    assert new.kv_bytes <= 0.3 * budget.usable_bytes < 0.3 * (available - weights)
    assert new.kv_bytes + new.gdn_bytes + new.prefix_cache_bytes <= budget.usable_bytes
    with pytest.raises(StartupError, match="does not fit"):  # 16 GiB of RAM: nothing left for the pools
        plan_pools(NINE_B, config, torch.bfloat16, CPU, MemoryBudget(16 * GIB, "cpu", weights, weights))


def test_a_gpu_plan_takes_the_fraction_of_what_the_weights_and_the_warm_up_leave(caplog):
    caplog.set_level(logging.INFO, logger="clefserve.engine")
    config = _config(prefix_cache_mb=2048)
    weights = expected_weight_bytes(NINE_B, torch.bfloat16)
    hidden = hidden_row_bytes(NINE_B, config, torch.bfloat16)
    budget = MemoryBudget(free_bytes=120 * GIB, where="cuda:0 NVIDIA H200", weight_bytes=weights,
                          activation_bytes=3 * GIB, hidden_bytes=hidden, total_bytes=141 * GIB)
    plan = plan_pools(NINE_B, config, torch.bfloat16, torch.device("cuda", 0), budget)
    usable = budget.usable_bytes
    assert usable == 120 * GIB - 3 * GIB - 8 * 16384 * 4096 * 2
    assert 0.3 * usable - plan.kv_block_bytes < plan.kv_bytes <= 0.3 * usable
    assert plan.gdn_slot_bytes == 24 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)  # 24 GDN layers, ~50 MiB a slot
    assert plan.prefix_cache_bytes == 2048 << 20
    assert plan.kv_bytes + plan.gdn_bytes + plan.prefix_cache_bytes <= usable
    line = next(r.getMessage() for r in caplog.records if "KV pool" in r.getMessage())
    assert "NVIDIA H200 (141.0 GiB)" in line and "activation peak 3.00 GiB" in line
    assert "after the reserves" in line


def test_a_release_that_does_not_fit_the_device_fails_at_startup_stating_sizes():
    weights = expected_weight_bytes(NINE_B, torch.float16)
    v100_16gb = "cuda:0 (Tesla V100-PCIE-16GB, 15.8 GiB)"
    message = weights_fit_error(weights, 15 * GIB, v100_16gb, torch.float16)
    assert message is not None and "16.68 GiB" in message and "15.00 GiB" in message and "float16" in message
    assert weights_fit_error(weights, 30 * GIB, v100_16gb, torch.float16) is None
    config = _config()
    # the weights fit a 32 GiB V100, but the warm-up and the hidden rows leave nothing for the pools
    budget = MemoryBudget(13 * GIB, "cuda:0 Tesla V100-SXM2-32GB", weights, 0, 12 * GIB, 1 * GIB, 32 * GIB)
    with pytest.raises(StartupError) as err:
        plan_pools(NINE_B, config, torch.float16, torch.device("cuda", 0), budget)
    assert "activation peak 12.00 GiB" in str(err.value) and "32.0 GiB" in str(err.value)
    # room left, but a fixed KV size plus the GDN slots exceed it
    roomy = MemoryBudget(16 * GIB, "cuda:0 Tesla V100-SXM2-32GB", weights, 0, 2 * GIB, 1 * GIB, 32 * GIB)
    with pytest.raises(StartupError, match=r"KV pool 12\.80 GiB .* GDN state pool .*8 slots"):
        plan_pools(NINE_B, _config(kv_cache_mb=13107), torch.float16, torch.device("cuda", 0), roomy)
    plan = plan_pools(NINE_B, config, torch.float16, torch.device("cuda", 0), roomy)
    assert plan.kv_bytes + plan.gdn_bytes + plan.prefix_cache_bytes <= roomy.usable_bytes


def test_the_command_refuses_fast_kernels_on_a_cpu_at_once(monkeypatch, capsys):
    from clefserve.cli import main

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["verify", "--kernels", "fast"])
    assert exit_.value.code == 2
    assert "--kernels fast on a CPU" in capsys.readouterr().err
