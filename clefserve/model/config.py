"""Backbone configuration parsed from a release folder's ``config.json``.

Accepts ``Qwen3_5ForConditionalGeneration`` folders (text settings nested under ``text_config``) and
``Qwen3_5ForCausalLM`` / ``qwen3_5_text`` folders (text settings at the top level).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clefserve.errors import ReleaseError

SUPPORTED_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class BackboneConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # full (gated) attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    # where the text weights live in the checkpoint ("model.language_model." or "model.")
    weight_prefix: str
    architecture: str
    # M-RoPE: how many of the rotary_dim / 2 frequencies follow the time, height and width position rows
    # (interleaved: frequency i follows height when i % 3 == 1 and i < 3 * sections[1], width when
    # i % 3 == 2 and i < 3 * sections[2], time otherwise). Only pictures make the three rows differ.
    mrope_section: tuple[int, int, int] = (11, 11, 10)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise causal conv: the q, k and v bands side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR)

    @classmethod
    def from_folder(cls, folder: str | Path) -> BackboneConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ReleaseError(f"{folder}: no config.json")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ReleaseError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BackboneConfig:
        architectures = raw.get("architectures") or []
        model_type = raw.get("model_type")
        architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if architecture is None:
            if architectures or model_type not in SUPPORTED_MODEL_TYPES:
                raise ReleaseError(
                    f"unsupported architecture {architectures or model_type!r}; "
                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (model_type {SUPPORTED_MODEL_TYPES})"
                )
            architecture = (
                "Qwen3_5ForConditionalGeneration" if model_type == "qwen3_5" else "Qwen3_5ForCausalLM"
            )
        nested = "text_config" in raw
        text = dict(raw["text_config"]) if nested else dict(raw)
        if text.get("model_type", "qwen3_5_text") != "qwen3_5_text":
            raise ReleaseError(
                f"unsupported text model_type {text.get('model_type')!r}; expected 'qwen3_5_text'"
            )

        def get(key: str, default: Any = None) -> Any:
            value = text.get(key, default)
            if value is None:
                raise ReleaseError(f"config.json: text config lacks {key!r}")
            return value

        layers = int(get("num_hidden_layers", 32))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
        layer_types = tuple(layer_types)[:layers]
        if len(layer_types) != layers or any(t not in (LINEAR, FULL) for t in layer_types):
            raise ReleaseError(f"config.json: layer_types must list {layers} of {LINEAR!r}/{FULL!r}")
        rope = dict(text.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ReleaseError(f"unsupported rope_type {rope_type!r}; only 'default' is implemented")
        rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        sections = rope.get("mrope_section", [11, 11, 10])
        if not (isinstance(sections, list | tuple) and len(sections) == 3
                and all(isinstance(n, int) and n >= 0 for n in sections)):
            raise ReleaseError(f"config.json: rope_parameters.mrope_section must be 3 counts, got "
                               f"{sections!r}")
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        tie = bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        if text.get("hidden_act", "silu") != "silu":
            raise ReleaseError(f"unsupported hidden_act {text.get('hidden_act')!r}; expected 'silu'")
        if text.get("attention_bias", False):
            raise ReleaseError("attention_bias=true is not supported by Qwen3.5 backbones")
        hidden = int(get("hidden_size", 4096))
        heads = int(get("num_attention_heads", 16))
        config = cls(
            vocab_size=int(get("vocab_size", 248320)),
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size", 12288)),
            num_hidden_layers=layers,
            layer_types=layer_types,
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads", 4)),
            head_dim=int(text.get("head_dim") or hidden // heads),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            linear_num_key_heads=int(get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=tie,
            weight_prefix="model.language_model." if nested else "model.",
            architecture=architecture,
            mrope_section=(int(sections[0]), int(sections[1]), int(sections[2])),
        )
        config.validate()
        return config

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ReleaseError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ReleaseError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ReleaseError(
                f"rotary dims {self.rotary_dim} must be even and within head_dim {self.head_dim}"
            )
        if self.linear_conv_kernel_dim < 1:
            raise ReleaseError("linear_conv_kernel_dim must be at least 1")
