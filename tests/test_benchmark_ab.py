"""benchmarks.ab_backbone imports another checkout's package under its own name: the two trees compute with
their own code (a change in the base shows in the comparison and does not leak into this tree's modules)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

import clefserve.model.layers
from benchmarks import ab_backbone

ROOT = Path(__file__).resolve().parents[1]


def _args(tokens: int = 40):
    return argparse.Namespace(shape="clef256", dtype="f32", tokens=tokens, prefill_chunk_size=32, rounds=1,
                              seed=0, tokenizer="test")


def test_the_same_tree_as_base_computes_the_same_rows(capsys):
    torch.manual_seed(0)
    assert ab_backbone.compare(ROOT, _args()) == 0.0
    printed = capsys.readouterr().out
    assert "base / this tree, median of 1 pairs" in printed
    assert not any(name.startswith(ab_backbone.ALIAS) for name in sys.modules)  # the alias is gone again


def test_a_changed_base_runs_its_own_code(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(ROOT / "clefserve", base / "clefserve",
                    ignore=shutil.ignore_patterns("__pycache__", "demo"))
    layers = base / "clefserve" / "model" / "layers.py"
    source = layers.read_text()
    marker = "        return self.mlp(self.post_attention_layernorm(x)).add_(x)\n"
    assert marker in source
    doubled = marker.replace(".add_(x)", ".mul_(2).add_(x)")
    layers.write_text(source.replace(marker, doubled))
    assert ab_backbone.compare(base, _args()) > 0.1
    assert "mul_(2)" not in Path(clefserve.model.layers.__file__).read_text()
