"""Partial rotary position embedding (torch reference).

For text-only input the three M-RoPE position planes are equal, so Qwen3.5's interleaved M-RoPE is plain
1-D RoPE on the first ``rotary_dim`` dims of each head (rotate-half convention); the rest pass through.
"""

from __future__ import annotations

import torch


def rope_tables(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[N, rotary_dim]`` for integer positions ``[N]``."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [N, heads, head_dim]`` by tables ``[N, rotary_dim]``."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)
