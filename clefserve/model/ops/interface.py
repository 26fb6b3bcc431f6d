"""The op table the backbone calls through, so faster kernels can replace the torch references."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from clefserve.model.ops import attention, conv, delta_rule, norms, rope


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable = norms.rms_norm_zero_centred
    gated_rms_norm: Callable = norms.gated_rms_norm
    rope_tables: Callable = rope.rope_tables
    apply_rope: Callable = rope.apply_rope
    causal_conv1d: Callable = conv.causal_conv1d
    gated_delta_rule: Callable = delta_rule.gated_delta_rule_varlen
    causal_attention: Callable = attention.causal_attention
    # why an op got its implementation (capability checks, fallbacks): (op, reason) pairs
    reasons: tuple[tuple[str, str], ...] = ()

    def kernels(self) -> dict[str, str]:
        """Which implementation each op uses (for the startup log and the model card)."""
        out = {}
        for field in fields(self):
            if field.name not in ("name", "reasons"):
                fn = getattr(self, field.name)
                module = getattr(fn, "__module__", "") or ""
                out[field.name] = f"{module.removeprefix('clefserve.model.ops.')}.{fn.__qualname__}"
        return out


def reference_ops() -> Ops:
    """Plain torch implementations; run on any device and define what "correct" means for the others."""
    return Ops(name="torch-reference")
