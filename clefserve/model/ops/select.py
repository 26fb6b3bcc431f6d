"""Picks one implementation per op for the device and dtype at startup (``--kernels``), with the reason.

- ``reference``: the plain torch ops (:func:`~clefserve.model.ops.interface.reference_ops`), the oracle;
  the switch for the day a fast kernel turns out wrong on some machine.
- ``auto`` (default): the fastest implementation this device supports, falling back op by op to the torch
  ops when a capability is missing (package not importable, compute capability, dtype) or a kernel fails
  its probe; each fallback is logged with its reason.
- ``fast``: the fused kernels, required. On CUDA: flash-linear-attention's Triton kernels (chunked gated
  delta rule and causal conv) and SDPA's fused attention; on a CPU: fla's kernels under Triton's
  interpreter (``TRITON_INTERPRET=1``), the way tests run the CUDA path without a GPU. What cannot be had is
  a :class:`~clefserve.errors.StartupError`, never a quiet fallback.

On CUDA each fused kernel is first run once on small inputs of the model's head shapes and compared with
the torch reference (a probe: it also compiles the Triton kernels before the memory planner measures the
activation peak). The startup self-check then compares the whole serving path with the reference path.
fla and triton are imported only for a CUDA device or under the interpreter: on a CPU without it they
would make transformers' CPU Qwen3.5 fail. Projections are not in the table: :mod:`~clefserve.model.ops.gemm`
picks their arithmetic per machine.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from clefserve.errors import StartupError
from clefserve.model.device import DTYPE_NAMES, DeviceFacts, device_facts
from clefserve.model.ops import attention, attention_fused, conv, delta_rule, gemm, triton_interpreter
from clefserve.model.ops.delta_rule_batched import chunk_gated_delta_rule_batched, gated_delta_rule_cpu
from clefserve.model.ops.interface import Ops, reference_ops

log = logging.getLogger(__name__)

KERNEL_MODES = ("auto", "fast", "reference")
# Triton releases before 3.4 returned wrong values from fp16 tl.dot on Volta (triton-lang/triton#4037)
MIN_TRITON_VOLTA = (3, 4)
# probe tolerance: max |fast - reference| <= tolerance * max(1, max |reference|)
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@dataclass(frozen=True)
class OpShapes:
    """The model's head shapes, for the CUDA probes (Triton compiles per head size)."""

    key_heads: int = 2
    value_heads: int = 4
    key_dim: int = 32
    value_dim: int = 32
    conv_kernel: int = 4
    attention_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64

    @classmethod
    def from_config(cls, config: object) -> OpShapes:
        c = config
        return cls(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,  # type: ignore[attr-defined]
                   c.linear_value_head_dim, c.linear_conv_kernel_dim, c.num_attention_heads,  # type: ignore[attr-defined]
                   c.num_key_value_heads, c.head_dim)  # type: ignore[attr-defined]

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def select_ops(
    device: torch.device,
    dtype: torch.dtype,
    mode: str = "auto",
    shapes: OpShapes | None = None,
    facts: DeviceFacts | None = None,
) -> Ops:
    """The op table for ``device``/``dtype``. ``facts`` stands in for the device (tests); ``shapes`` are the
    model's, for the probes (defaults when None)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"--kernels must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    if mode == "reference":
        return replace(reference_ops(), reasons=(("all", "--kernels reference"),))
    facts = facts or device_facts(device)
    if facts.is_cuda:
        return _cuda_ops(device, dtype, mode, shapes or OpShapes(), facts)
    if mode == "fast":
        return _interpreter_ops(dtype, facts)
    # The delta rule is step-batched only for many small pieces with small heads (where the op count is the
    # cost); elsewhere the per-sequence form's matmuls are already large (benchmarks/README.md).
    ops = replace(reference_ops(), name="torch-fast", causal_attention=attention.causal_attention_split_cpu,
                  gated_delta_rule=gated_delta_rule_cpu)
    why = ("cpu: torch ops, attention split into history + causal block (fla's Triton kernels need a GPU, or "
           "--kernels fast under TRITON_INTERPRET=1)")
    return replace(ops, reasons=(("all", why),))


def describe(ops: Ops, device: torch.device, dtype: torch.dtype) -> str:
    kernels = ", ".join(f"{op}={impl}" for op, impl in ops.kernels().items())
    reasons = "; ".join(f"{op}: {why}" for op, why in ops.reasons)
    text = f"kernels ({ops.name}): {kernels}; projections: {gemm.describe(device, dtype)}"
    return f"{text}; why: {reasons}" if reasons else text


# ---- flash-linear-attention ----------------------------------------------------------------------------


def _version(package: str) -> tuple[int, ...]:
    try:
        text = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ()
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def fla_unavailable(facts: DeviceFacts, dtype: torch.dtype) -> str | None:
    """Why flash-linear-attention's kernels cannot run here, or None when they can. Imports nothing."""
    if not facts.is_cuda and not triton_interpreter.requested():
        return (f"a CPU runs fla's Triton kernels only under Triton's interpreter: set "
                f"{triton_interpreter.ENV}=1 before starting (and install the gpu extra)")
    for module, package in (("fla", "flash-linear-attention / fla-core"), ("triton", "triton")):
        if importlib.util.find_spec(module) is None:
            return f"{package} is not installed (pip install 'clefserve[gpu]')"
    if not facts.is_cuda:
        if dtype == torch.bfloat16:
            return "Triton's interpreter computes bf16 wrongly (triton-lang/triton#11584): use f32 or f16"
        return None
    if facts.capability is None or facts.capability < (7, 0):
        return f"{facts.describe()}: Triton needs CUDA compute capability 7.0 or newer"
    triton_version = _version("triton")
    if facts.capability < (8, 0) and triton_version < MIN_TRITON_VOLTA:
        found = ".".join(map(str, triton_version)) or "?"
        return (f"{facts.describe()}: Triton {found} computes fp16 dot products wrongly before Ampere "
                "(triton-lang/triton#4037); needs triton >= 3.4")
    return None


def _import_fla_ops(facts: DeviceFacts):  # type: ignore[no-untyped-def]
    if not facts.is_cuda:
        triton_interpreter.prepare()
    from clefserve.model.ops import fla_ops

    return fla_ops


def _interpreter_ops(dtype: torch.dtype, facts: DeviceFacts) -> Ops:
    why = fla_unavailable(facts, dtype)
    if why is not None:
        raise StartupError(f"--kernels fast on a CPU: {why}. Use --kernels auto for the fastest CPU ops.")
    try:
        fla = _import_fla_ops(facts)
    except Exception as exc:
        raise StartupError(f"--kernels fast: importing flash-linear-attention failed: {exc}") from exc
    interp = "fla under Triton's interpreter (TRITON_INTERPRET=1)"
    return replace(reference_ops(), name="fla-interpreter", gated_delta_rule=fla.gated_delta_rule,
                   causal_conv1d=fla.causal_conv1d, causal_attention=attention.causal_attention_split_cpu,
                   reasons=(("gated_delta_rule", interp), ("causal_conv1d", interp),
                            ("causal_attention", "cpu: split flash attention")))


# ---- CUDA ------------------------------------------------------------------------------------------------


def _cuda_ops(
    device: torch.device, dtype: torch.dtype, mode: str, shapes: OpShapes, facts: DeviceFacts
) -> Ops:
    where = f"{facts.describe()}, {DTYPE_NAMES.get(dtype, dtype)}"
    reasons: dict[str, str] = {}
    chosen: dict[str, Callable] = {}

    def fallback(op: str, why: str, impl: Callable) -> None:
        if mode == "fast":
            raise StartupError(f"--kernels fast: no fused kernel for {op} on {where}: {why}")
        log.warning("kernels: %s falls back to the torch op: %s", op, why)
        chosen[op], reasons[op] = impl, f"torch fallback: {why}"

    # Gated DeltaNet: fla's chunked kernel, and its conv under --kernels fast
    why = fla_unavailable(facts, dtype)
    fla = None
    if why is None:
        try:
            fla = _import_fla_ops(facts)
        except Exception as exc:
            why = f"importing flash-linear-attention failed: {type(exc).__name__}: {exc}"
    if fla is not None:
        problem = _probe(_probe_delta_rule, fla.gated_delta_rule, device, dtype, shapes)
        if problem is None:
            chosen["gated_delta_rule"] = fla.gated_delta_rule
            reasons["gated_delta_rule"] = f"fla chunked kernel, varlen ({where}, fla {_fla_version()})"
        else:
            fallback("gated_delta_rule", problem, chunk_gated_delta_rule_batched)
    else:
        fallback("gated_delta_rule", why or "fla unavailable", chunk_gated_delta_rule_batched)

    if mode == "fast" and fla is not None:
        problem = _probe(_probe_conv, fla.causal_conv1d, device, dtype, shapes)
        if problem is not None:
            fallback("causal_conv1d", problem, conv.causal_conv1d)
        else:
            chosen["causal_conv1d"] = fla.causal_conv1d
            reasons["causal_conv1d"] = f"fla Triton conv ({where})"
    else:
        reasons["causal_conv1d"] = ("torch conv: called per sequence it launches about as many kernels as "
                                    "fla's (--kernels fast takes fla's)")

    # attention: one flash call where flash runs, else the split form over memory-efficient attention
    candidates = []
    flash_ok = facts.capability is not None and facts.capability >= (8, 0)
    half = dtype in (torch.float16, torch.bfloat16)
    if flash_ok and half and shapes.head_dim <= 256 and shapes.head_dim % 8 == 0:
        candidates.append((attention_fused.causal_attention_flash, "flash attention, bottom-right causal"))
    candidates.append((attention_fused.causal_attention_split, "memory-efficient attention, history + causal "
                                                               "block merged by log-sum-exp"))
    problems = []
    for impl, label in candidates:
        problem = _probe(_probe_attention, impl, device, dtype, shapes)
        if problem is None:
            chosen["causal_attention"], reasons["causal_attention"] = impl, f"{label} ({where})"
            break
        problems.append(f"{label}: {problem}")
    else:
        fallback("causal_attention", "; ".join(problems), attention.causal_attention)

    ops = replace(reference_ops(), name="cuda-fast" if fla is not None else "cuda-torch", **chosen)
    return replace(ops, reasons=tuple(reasons.items()))


def _fla_version() -> str:
    return ".".join(map(str, _version("fla-core") or _version("flash-linear-attention"))) or "?"


def _probe(
    make: Callable, impl: Callable, device: torch.device, dtype: torch.dtype, shapes: OpShapes
) -> str | None:
    """Run ``impl`` once on small inputs against the torch reference: None when it agrees, else why not."""
    try:
        with torch.inference_mode():
            got, want = make(impl, device, dtype, shapes)
            worst = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want, strict=True))
            scale = max(1.0, *(w.float().abs().max().item() for w in want))
    except Exception as exc:  # a kernel that cannot run here: fall back (auto) or refuse (fast)
        return f"probe failed: {type(exc).__name__}: {exc}"
    tolerance = PROBE_TOLERANCE.get(dtype, 5e-2) * scale
    if not worst <= tolerance:
        return f"probe disagrees with the torch reference by {worst:.3g} (tolerance {tolerance:.3g})"
    return None


def _random(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _probe_delta_rule(impl: Callable, device: torch.device, dtype: torch.dtype, s: OpShapes):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    lens, pasts = (70, 5, 1), (0, 3, 10)
    rows = sum(lens)
    q, k = _random(gen, rows, s.key_heads, s.key_dim), _random(gen, rows, s.key_heads, s.key_dim)
    v = _random(gen, rows, s.value_heads, s.value_dim)
    g = -torch.rand(rows, s.value_heads, generator=gen) * 2
    beta = torch.rand(rows, s.value_heads, generator=gen)
    initial = _random(gen, len(lens), s.value_heads, s.key_dim, s.value_dim) * 0.1
    initial[0] = 0
    args = [x.to(device) for x in (q.to(dtype), k.to(dtype), v.to(dtype), g, beta, initial)]
    return impl(*args, lens, pasts), delta_rule.gated_delta_rule_varlen(*args, lens, pasts)


def _probe_conv(impl: Callable, device: torch.device, dtype: torch.dtype, s: OpShapes):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(1)
    x = _random(gen, 70, s.conv_dim).to(device, dtype)
    weight = _random(gen, s.conv_dim, s.conv_kernel).to(device, dtype)
    state = _random(gen, s.conv_kernel - 1, s.conv_dim).to(device, dtype)
    return (*impl(x, weight, state), *impl(x[:2], weight, None)), (
        *conv.causal_conv1d(x, weight, state), *conv.causal_conv1d(x[:2], weight, None))


def _probe_attention(impl: Callable, device: torch.device, dtype: torch.dtype, s: OpShapes):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(2)
    got, want = [], []
    for steps, past in ((33, 0), (20, 50), (1, 7)):
        q = _random(gen, steps, s.attention_heads, s.head_dim).to(device, dtype)
        k = _random(gen, past + steps, s.kv_heads, s.head_dim).to(device, dtype)
        v = _random(gen, past + steps, s.kv_heads, s.head_dim).to(device, dtype)
        got.append(impl(q, k, v, past))
        want.append(attention.causal_attention(q, k, v, past))
    return got, want
