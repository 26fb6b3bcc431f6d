"""Prefill tokens/s of our backbone against transformers' Qwen3.5 forward, same folder, same process.

    python -m benchmarks.backbone [--hidden 512] [--layers 8] [--lengths 512 2048] [--repeats 3]

Prints one row per (dtype, length) with both throughputs and their ratio (ours / transformers). Both run with
the heap thresholds our server sets (``--heap``, ``benchmarks/heap.py``).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.heap import add_heap_argument, prepare_heap
from clefserve.model.weights import load_backbone
from clefserve.testing.release import build_release, clef_shaped_spec


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--dtypes", nargs="+", default=["f32", "bf16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    add_heap_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    heap = prepare_heap(args.heap)

    import transformers

    transformers.logging.set_verbosity_error()
    from transformers import Qwen3_5ForConditionalGeneration

    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_release(Path(tmp), clef_shaped_spec(args.hidden, args.layers, head=False), seed=0)
        print(f"# release: hidden {args.hidden}, {args.layers} layers, threads {args.threads}, {heap}")
        print(f"{'dtype':>5} {'tokens':>6} {'ours tok/s':>11} {'transformers tok/s':>19} {'ratio':>6}")
        for name in args.dtypes:
            dtype = dtypes[name]
            ours = load_backbone(folder, dtype=dtype)
            ref = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
            text_model = ref.model.language_model
            for length in args.lengths:
                gen = torch.Generator().manual_seed(0)
                ids = torch.randint(0, ours.config.vocab_size, (length,), generator=gen)
                with torch.inference_mode():
                    t_ours = best_seconds(lambda m=ours, ids=ids: m.run_sequence(ids), args.repeats)
                    t_ref = best_seconds(
                        lambda m=text_model, ids=ids: m(input_ids=ids[None], use_cache=False), args.repeats
                    )
                ours_rate, ref_rate = length / t_ours, length / t_ref
                print(f"{name:>5} {length:>6} {ours_rate:>11.0f} {ref_rate:>19.0f} {t_ref / t_ours:>6.2f}")


if __name__ == "__main__":
    main()
