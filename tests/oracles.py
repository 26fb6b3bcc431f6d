"""Test-only oracles: transformers' Qwen3.5 backbone and Cloudflare's reference ``joint_schema_model``.

Used to check our code, never by it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch


def quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def reference_backbone(folder: Path, dtype: torch.dtype = torch.float32):
    """transformers' model for the folder (ConditionalGeneration or CausalLM, as its config says)."""
    quiet_transformers()
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    cls = Qwen3_5ForConditionalGeneration if arch == "Qwen3_5ForConditionalGeneration" else Qwen3_5ForCausalLM
    return cls.from_pretrained(folder, dtype=dtype).eval()


def reference_text_model(model):
    """The decoder stack whose ``last_hidden_state`` is the final-norm hidden rows."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner


def jsm():
    from clef_finetune._vendor import joint_schema_model

    return joint_schema_model


def reference_tokenizer(folder: Path):
    quiet_transformers()
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )


def reference_processor(folder: Path):
    """transformers' ``Qwen3VLProcessor`` for a release with a ``preprocessor_config.json``, built without
    torchvision (environment.md, "Images"): its constructor's type checks need the video processor
    classes, so ``ProcessorMixin.__init__`` is bypassed while it is built; its image processor is the
    PIL-backed ``Qwen2VLImageProcessorPil`` from the release's settings."""
    quiet_transformers()
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    settings = json.loads((folder / "preprocessor_config.json").read_text())
    for key in ("image_processor_type", "processor_class"):
        settings.pop(key, None)
    image_processor = Qwen2VLImageProcessorPil(**settings)
    video_stand_in = SimpleNamespace(merge_size=image_processor.merge_size,
                                     temporal_patch_size=image_processor.temporal_patch_size)

    def assign_only(self, image_processor=None, tokenizer=None, video_processor=None, chat_template=None,
                    **_):
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.video_processor, self.chat_template = video_processor, chat_template

    original = ProcessorMixin.__init__
    ProcessorMixin.__init__ = assign_only
    try:
        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=reference_tokenizer(folder),
                                video_processor=video_stand_in)
    finally:
        ProcessorMixin.__init__ = original


def reference_clef(folder: Path, dtype: torch.dtype = torch.float32):
    """Cloudflare's ``ClefModel`` over transformers' backbone + the reference head, and a processor stand-in.

    ``systemone(model, processor, request)`` only touches ``processor.tokenizer`` for text-only requests;
    a release with a ``preprocessor_config.json`` gets the real image processor (``reference_processor``).
    """
    from safetensors.torch import load_file

    ref = jsm()
    backbone = reference_backbone(folder, dtype)
    head = ref.JointSchemaHead(**json.loads((folder / "joint_head_config.json").read_text()))
    head.load_state_dict(load_file(str(folder / "joint_head.safetensors")), strict=True)
    model = ref.ClefModel(backbone, head.to(dtype)).eval()
    if (folder / "preprocessor_config.json").is_file():
        return model, reference_processor(folder)
    return model, SimpleNamespace(tokenizer=reference_tokenizer(folder))
