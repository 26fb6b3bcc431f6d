"""The Qwen3.5 vision tower in plain PyTorch. Parameter names follow the checkpoint's ``model.visual.*``.

patches -> patch embedding (a linear map of each C x T x P x P patch) + learned position embeddings
(a square grid resampled bilinearly to the picture's grid) -> ``depth`` pre-norm transformer blocks whose
attention is 2-D rotary (row and column) and sees only the patches of the same picture -> patch merger
(each ``merge x merge`` block of patches concatenated, then an MLP to the text model's hidden size).
One output row per ``<|image_pad|>`` token, in the order of the tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from clefserve.model.layers import Embedding
from clefserve.vision.config import VisionConfig

LAYER_NORM_EPS = 1e-6
Grid = tuple[int, int, int]


def activation(name: str):
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    raise ValueError(f"unsupported activation {name!r}")


class PatchProjection(nn.Module):
    """The Conv3d weight ``[hidden, C, T, P, P]``; its stride equals its kernel, so it is a linear map."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        c, t, p = config.in_channels, config.temporal_patch_size, config.patch_size
        self.weight = nn.Parameter(torch.zeros(config.hidden_size, c, t, p, p))
        self.bias = nn.Parameter(torch.zeros(config.hidden_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.weight.reshape(self.weight.shape[0], -1)
        return F.linear(pixels.to(weight.dtype), weight, self.bias)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.proj = PatchProjection(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head, in fp32."""
    dtype = x.dtype
    x = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(dtype)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, x: torch.Tensor, frames: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = self.qkv(x).view(rows, 3, self.heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        start = 0
        for length in frames:  # bidirectional attention within one picture (one frame) only
            end = start + length
            # [1, heads, n, head_dim]: the 4-D layout takes the CPU's flash kernel (3x the 3-D math path)
            q_, k_, v_ = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
            out[start:end] = F.scaled_dot_product_attention(q_, k_, v_)[0].transpose(0, 1)
            start = end
        return self.proj(out.reshape(rows, -1))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(
        self, x: torch.Tensor, frames: list[int], cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), frames, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm per patch, then each merge block's patches side by side through a GELU MLP."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        merged = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(merged, merged)
        self.linear_fc2 = nn.Linear(merged, config.out_hidden_size)
        self.merged = merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).reshape(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def merge_block_order(grid_h: int, grid_w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch, in the order the patches arrive (merge blocks contiguous)."""
    rows = torch.arange(grid_h).view(grid_h // merge, merge, 1, 1).expand(-1, -1, grid_w // merge, merge)
    cols = torch.arange(grid_w).view(1, 1, grid_w // merge, merge).expand(grid_h // merge, merge, -1, -1)
    return rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.pos_embed.weight.device

    def _position_embeddings(self, grid: Grid) -> torch.Tensor:
        """The learned grid resampled to ``grid`` (bilinear, corners aligned), in patch order, fp32."""
        t, h, w = grid
        side = self.config.grid_side
        device = self.device

        def axis(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            src = torch.arange(n, dtype=torch.float32, device=device) * (side - 1) / max(n - 1, 1)
            low = src.floor()
            taps = (low.long()[:, None] + torch.arange(2, device=device)).clamp(0, side - 1)
            weights = (1 - (src[:, None] - low[:, None] - torch.arange(2, device=device)).abs()).clamp(min=0)
            return taps, weights

        rows, cols = merge_block_order(h, w, self.config.spatial_merge_size)
        h_taps, h_weights = axis(h)
        w_taps, w_weights = axis(w)
        rows, cols = rows.to(device), cols.to(device)
        index = (h_taps[rows][:, :, None] * side + w_taps[cols][:, None, :]).reshape(-1, 4)
        weight = (h_weights[rows][:, :, None] * w_weights[cols][:, None, :]).reshape(-1, 4)
        table = self.pos_embed.weight
        embeddings = (table[index].float() * weight[:, :, None]).sum(1)
        return embeddings.repeat(t, 1)

    def _rotary(self, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
        t, h, w = grid
        rows, cols = merge_block_order(h, w, self.config.spatial_merge_size)
        # each axis rotates half of the head: head_dim / 4 frequencies for the row, as many for the column
        axis_dim = self.config.head_dim // 2
        steps = torch.arange(0, axis_dim, 2, dtype=torch.float32, device=self.device)
        inv_freq = 1.0 / self.config.rope_theta ** (steps / axis_dim)
        rows, cols = rows.to(self.device)[:, None], cols.to(self.device)[:, None]
        freqs = torch.cat((rows * inv_freq, cols * inv_freq), dim=-1)
        angles = torch.cat((freqs, freqs), dim=-1).repeat(t, 1)
        return angles.cos(), angles.sin()

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """``pixels [patches, C*T*P*P]`` of the pictures of ``grids`` side by side ->
        ``[tokens, out_hidden]``."""
        x = self.patch_embed(pixels.to(self.device))
        x = x + torch.cat([self._position_embeddings(g) for g in grids]).to(x.dtype)
        tables = [self._rotary(g) for g in grids]
        cos, sin = torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])
        frames = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, frames, cos, sin)
        return self.merger(x)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor, grid: Grid) -> torch.Tensor:
        """One picture on its own (its rows never depend on what else is being encoded)."""
        return self.forward(pixels, [grid])
