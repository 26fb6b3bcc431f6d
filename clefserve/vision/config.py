"""The vision tower's settings, from ``config.json``'s ``vision_config`` (Qwen3.5 ConditionalGeneration)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clefserve.errors import ReleaseError

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "gelu_new", "silu")


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    # token ids the record uses around and inside an image
    image_token_id: int = 248056
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        """Side of the square grid of learned position embeddings."""
        return int(self.num_position_embeddings**0.5)

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_release_config(cls, raw: dict[str, Any], text_hidden_size: int) -> VisionConfig | None:
        """The vision settings of a ``config.json``, or None for a text-only (CausalLM) folder."""
        vision = raw.get("vision_config")
        if not vision:
            return None
        if not isinstance(vision, dict):
            raise ReleaseError("config.json: vision_config must be an object")
        rope = vision.get("rope_parameters") or {}

        def get(key: str, default: Any) -> Any:
            value = vision.get(key, default)
            if value is None:
                raise ReleaseError(f"config.json: vision_config lacks {key!r}")
            return value

        def scalar(key: str, default: int) -> int:
            value = get(key, default)
            if isinstance(value, list | tuple):  # transformers allows [n, n]
                if len(set(value)) != 1:
                    raise ReleaseError(f"config.json: vision_config.{key} {value} must be square")
                value = value[0]
            return int(value)

        try:
            config = cls(
                depth=int(get("depth", 27)),
                hidden_size=int(get("hidden_size", 1152)),
                intermediate_size=int(get("intermediate_size", 4304)),
                num_heads=int(get("num_heads", 16)),
                out_hidden_size=int(get("out_hidden_size", 3584)),
                in_channels=int(get("in_channels", 3)),
                patch_size=scalar("patch_size", 16),
                temporal_patch_size=scalar("temporal_patch_size", 2),
                spatial_merge_size=int(get("spatial_merge_size", 2)),
                num_position_embeddings=int(get("num_position_embeddings", 2304)),
                hidden_act=str(get("hidden_act", "gelu_pytorch_tanh")),
                rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
                image_token_id=int(raw.get("image_token_id", 248056)),
                vision_start_token_id=int(raw.get("vision_start_token_id", 248053)),
                vision_end_token_id=int(raw.get("vision_end_token_id", 248054)),
            )
        except (TypeError, ValueError) as exc:
            raise ReleaseError(f"config.json: vision_config: {exc}") from exc
        config.validate(text_hidden_size)
        return config

    def validate(self, text_hidden_size: int) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ReleaseError(f"config.json: vision hidden_act {self.hidden_act!r} is not supported "
                               f"({', '.join(ACTIVATIONS)})")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ReleaseError("config.json: vision head_dim (hidden_size / num_heads) must be a multiple "
                               "of 4")
        if self.grid_side**2 != self.num_position_embeddings:
            raise ReleaseError("config.json: vision num_position_embeddings must be a square number")
        if self.out_hidden_size != text_hidden_size:
            raise ReleaseError(f"config.json: vision out_hidden_size {self.out_hidden_size} differs from the "
                               f"text hidden_size {text_hidden_size}")
        if self.in_channels != 3:
            raise ReleaseError("config.json: vision in_channels must be 3 (RGB)")
        if min(self.depth, self.patch_size, self.temporal_patch_size, self.spatial_merge_size) < 1:
            raise ReleaseError("config.json: vision depth, patch sizes and merge size must be positive")
