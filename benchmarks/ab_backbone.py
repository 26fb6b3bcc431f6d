"""This tree's backbone against another revision's, interleaved in one process.

    python -m benchmarks.ab_backbone --base-rev REV [--dtype bf16] [--tokens 3000] [--rounds 8]

This host's speed moves by up to 2x between minutes, so two runs of a benchmark minutes apart cannot tell a
5% change from the noise. Here both trees' ``Backbone.run_sequence`` run on the same release, the same
token ids and the same threads, alternating run by run, so both see the same phases of the host. Each run
prefills one record in pieces of ``--prefill-chunk-size`` tokens with the serving ops (``select_ops``,
``auto``); the first run of each side is a warm-up. Printed: each side's min and median, the median of the
per-pair ratios (base / this tree: above 1 means this tree is faster), and the largest difference between
the two trees' hidden rows.

The base revision is checked out with ``git worktree add --detach`` into a temporary folder (removed at the
end), and its ``clefserve`` package is imported under another name (``clefserve_base``): its modules are
read from that folder with their ``clefserve`` imports renamed, so the two packages share nothing but
torch. ``--base DIR`` takes an existing checkout instead.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from benchmarks.heap import add_heap_argument, prepare_heap
from benchmarks.shapes import SHAPES, add_tokenizer_argument, build_shape

ALIAS = "clefserve_base"
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class RenamedPackage(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``root``'s ``clefserve`` package as ``alias``: every module's source is read from ``root``
    with the word ``clefserve`` before a dot or a space (its imports) renamed to ``alias``."""

    def __init__(self, alias: str, root: Path) -> None:
        self.alias, self.root = alias, root

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> Any:
        if fullname != self.alias and not fullname.startswith(self.alias + "."):
            return None
        place = self.root.joinpath("clefserve", *fullname.split(".")[1:])
        if (place / "__init__.py").is_file():
            spec = importlib.util.spec_from_loader(fullname, self, origin=str(place / "__init__.py"),
                                                   is_package=True)
            spec.submodule_search_locations = [str(place)]  # type: ignore[union-attr]
            return spec
        if place.with_suffix(".py").is_file():
            return importlib.util.spec_from_loader(fullname, self, origin=str(place.with_suffix(".py")))
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        origin = module.__spec__.origin  # type: ignore[union-attr]
        source = re.sub(r"\bclefserve(?=[.\s])", self.alias, Path(origin).read_text())
        module.__file__ = origin
        exec(compile(source, origin, "exec"), module.__dict__)


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """A detached worktree of ``rev`` in a temporary folder, removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(folder), rev], check=True)
        try:
            yield folder
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(folder)], check=False)


def serving_backbone(package: str, folder: Path, dtype: torch.dtype) -> Any:
    """``package``'s backbone of ``folder`` with that package's serving ops for the CPU."""
    weights = importlib.import_module(f"{package}.model.weights")
    select = importlib.import_module(f"{package}.model.ops.select")
    ops = select.select_ops(torch.device("cpu"), dtype, "auto")
    return weights.load_backbone(folder, dtype=dtype, ops=ops)


def prefill(model: Any, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    state, rows = None, []
    for start in range(0, ids.shape[0], chunk):
        hidden, state = model.run_sequence(ids[start : start + chunk], state)
        rows.append(hidden)
    return torch.cat(rows)


@contextlib.contextmanager
def renamed_package(alias: str, root: Path) -> Iterator[None]:
    """``root``'s ``clefserve`` importable as ``alias`` while the context lasts."""
    finder = RenamedPackage(alias, root)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == alias or n.startswith(alias + ".")]:
            del sys.modules[name]


def compare(base_root: Path, args: argparse.Namespace) -> float:
    """Runs the comparison and prints it; returns the largest difference between the hidden rows."""
    dtype = DTYPES[args.dtype]
    with renamed_package(ALIAS, base_root), tempfile.TemporaryDirectory() as tmp:
        folder = build_shape(args.shape, Path(tmp), tokenizer=args.tokenizer)
        models = {"base": serving_backbone(ALIAS, folder, dtype),
                  "this tree": serving_backbone("clefserve", folder, dtype)}
        vocab = models["this tree"].embed_tokens.weight.shape[0]
        ids = torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(args.seed))
        seconds: dict[str, list[float]] = {name: [] for name in models}
        hidden: dict[str, torch.Tensor] = {}
        for round_ in range(args.rounds + 1):
            for name, model in models.items():
                start = time.perf_counter()
                hidden[name] = prefill(model, ids, args.prefill_chunk_size)
                if round_:  # round 0 warms both up
                    seconds[name].append(time.perf_counter() - start)
    ratios = sorted(b / t for b, t in zip(seconds["base"], seconds["this tree"], strict=True))
    diff = (hidden["base"].float() - hidden["this tree"].float()).abs().max().item()
    for name, times in seconds.items():
        times = sorted(times)
        print(f"{name:>10}: min {times[0] * 1e3:8.1f} ms   median {times[len(times) // 2] * 1e3:8.1f} ms")
    print(f"base / this tree, median of {len(ratios)} pairs: {ratios[len(ratios) // 2]:.3f}x "
          f"(pairs {ratios[0]:.3f}-{ratios[-1]:.3f}); max |hidden difference| {diff:.3g}")
    return diff


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-rev", help="the git revision to compare against (checked out for the run)")
    where.add_argument("--base", type=Path, help="an existing checkout to compare against")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="clef256")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--prefill-chunk-size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    add_tokenizer_argument(parser)
    add_heap_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    heap = prepare_heap(args.heap)
    print(f"# shape {args.shape}, {args.dtype}, {args.tokens} tokens in pieces of {args.prefill_chunk_size}, "
          f"{args.threads} threads, {args.rounds} rounds, {heap}")
    if args.base is not None:
        compare(args.base.resolve(), args)
    else:
        with checkout(args.base_rev) as folder:
            compare(folder, args)


if __name__ == "__main__":
    main()
