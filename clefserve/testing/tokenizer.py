"""A small byte-level BPE tokenizer with Qwen's special tokens, trained on text we generate."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<think>",
    "</think>",
)
WORDS = [
    "state",
    "schema",
    "field",
    "option",
    "order",
    "refund",
    "charge",
    "ticket",
    "account",
    "billing",
    "technical",
    "sales",
    "urgent",
    "today",
    "week",
    "customer",
    "email",
    "message",
    "team",
    "invoice",
    "error",
    "outage",
    "login",
    "password",
    "payment",
    "card",
    "shipping",
    "delivery",
    "late",
    "broken",
    "cancel",
    "subscription",
    "upgrade",
    "plan",
    "price",
    "discount",
    "the",
    "a",
    "is",
    "was",
    "to",
    "of",
    "and",
    "in",
    "for",
    "on",
    "with",
    "not",
    "no",
    "yes",
    "true",
    "false",
    "proposition",
    "answer",
    "decide",
    "every",
    "jointly",
    "allowed",
    "exactly",
    "one",
    "description",
    "option_id",
    "instruction",
]


def training_corpus(seed: int, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    corpus = [
        "Read the complete state and schema. Decide every field jointly. Each answer must be exactly one of "
        "that field's allowed options.",
        "\n\nSCHEMA FIELDS:\n\nFIELD 1\nID: q\nTYPE: choice\nINSTRUCTION: x\nALLOWED OPTIONS:\nOPTION 1: ",
        "END FIELD\n\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:",
    ]
    for _ in range(lines):
        words = rng.choices(WORDS, k=rng.randint(3, 14))
        if rng.random() < 0.5:
            corpus.append(" ".join(words).capitalize() + rng.choice(".?!"))
        else:
            corpus.append(json.dumps({w: rng.randint(0, 9999) for w in words[:4]}, separators=(",", ":")))
    return corpus


def train_tokenizer(vocab_size: int = 640, seed: int = 0, corpus: list[str] | None = None) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus or training_corpus(seed), trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "Qwen2Tokenizer",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 262144,
            },
            indent=2,
        )
    )
