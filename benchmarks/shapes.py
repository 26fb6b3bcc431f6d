"""The benchmark model shapes, built as random Clef releases (``clefserve.testing.release``).

- ``clef256``: Clef's proportions at hidden 256 (8 layers, 3 Gated DeltaNet : 1 attention); at this width the
  work around the GEMMs (attention over chunks, the delta rule, elementwise ops, per-request overhead)
  decides the speed, as on the demo model.
- ``qwen9b-2048``: Qwen3.5-9B's proportions scaled down evenly to hidden 2048 (GDN 8 key / 16 value heads of
  128, attention 8 query / 2 KV heads of 256, FFN 3x hidden, 3 GDN : 1 attention) with 4 layers; GEMMs
  dominate, as on the real model.
- ``clef256-qwen-decays``: ``clef256`` with the Gated DeltaNet decay rates that Qwen3.5 starts training from
  (``QWEN_DECAY_RATES``, A up to 16 rather than 0.5): a chunk's decays then fall below the normal floats, as a
  trained model's do, which the mild random releases never show.

Each shape is built with Qwen3.5's real tokenizer by default (``--tokenizer qwen3.5``; a record's text then
has as many tokens as on a real Clef release, about 3.6x fewer than with the small byte-level test
tokenizer, and its 248,128-row embedding and output matrices are in the release) or with the test tokenizer
(``--tokenizer test``, what the passes up to the thirteenth measured).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from clefserve.testing.release import (
    MILD_DECAY_RATES,
    QWEN_DECAY_RATES,
    TOKENIZERS,
    build_release,
    clef_shaped_spec,
)

# name: (hidden size, layers, decay rates)
SHAPES = {
    "clef256": (256, 8, MILD_DECAY_RATES),
    "qwen9b-2048": (2048, 4, MILD_DECAY_RATES),
    "clef256-qwen-decays": (256, 8, QWEN_DECAY_RATES),
}


def add_tokenizer_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="qwen3.5",
                        help="the release's tokenizer: qwen3.5 (Qwen3.5's real one, the default) or test "
                             "(the small byte-level one; see benchmarks/shapes.py)")


def build_shape(name: str, folder: Path, seed: int = 0, tokenizer: str = "qwen3.5") -> Path:
    hidden, layers, decay_rates = SHAPES[name]
    spec = clef_shaped_spec(hidden, layers, decay_rates=decay_rates, tokenizer=tokenizer)
    return build_release(folder, spec, seed=seed)
