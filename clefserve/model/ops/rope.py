"""Partial rotary position embedding (torch reference).

For text-only input the three M-RoPE position planes are equal, so Qwen3.5's interleaved M-RoPE is plain
1-D RoPE on the first ``rotary_dim`` dims of each head (rotate-half convention); the rest pass through.
With pictures the planes differ and ``mrope_tables`` picks, per frequency, the plane it follows.
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


def mrope_plane(rotary_dim: int, sections: tuple[int, int, int]) -> torch.Tensor:
    """Which position row (0 time, 1 height, 2 width) each of the ``rotary_dim / 2`` frequencies follows
    (Qwen3.5's interleaved layout)."""
    index = torch.arange(rotary_dim // 2)
    plane = torch.zeros_like(index)
    plane[(index % 3 == 1) & (index < 3 * sections[1])] = 1
    plane[(index % 3 == 2) & (index < 3 * sections[2])] = 2
    return plane


def mrope_tables(
    positions: torch.Tensor, rotary_dim: int, theta: float, sections: tuple[int, int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[N, rotary_dim]`` for three position rows ``[3, N]``. Each angle is the same
    product as ``rope_tables``' for that row's position, so equal rows give equal tables."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim)
    )
    plane = mrope_plane(rotary_dim, sections).to(positions.device)
    chosen = positions.gather(0, plane[:, None].expand(-1, positions.shape[1])).T  # [N, rotary_dim / 2]
    freqs = chosen.float() * inv_freq[None, :]
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
