"""Images: the vision tower's pictures per second, and the latency of requests with 1 and 4 pictures,
against the reference (transformers' ``Qwen3_5VisionModel`` for the tower, Cloudflare's ``systemone()``
with transformers' Qwen3VL processor end to end), same release, dtype and CPU threads; the reference runs in
this process with the heap thresholds our server sets (``--heap``, ``benchmarks/heap.py``).

    python -m benchmarks.images [--dtype f32] [--size 448 448] [--requests 6] [--threads N]

The release is Clef-shaped (hidden 256, 8 layers) with a small Qwen3.5-shaped vision tower (4 blocks of
width 128, patch 16, merge 2; pictures up to 1024 x 1024 pixels). Each end-to-end request has a fresh
state and fresh pictures (no cache hits), one request at a time, over HTTP for clef-serve; then requests
with one picture at concurrency 4 (throughput); a last line repeats pictures to show the encoder cache and
the prefix cache. Needs the test extras (transformers, clef-finetune).
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import torch
from PIL import Image

from benchmarks.heap import add_heap_argument, prepare_heap
from clefserve.config import DTYPES
from clefserve.model.ops import gemm
from clefserve.testing.release import build_release, clef_shaped_spec
from clefserve.testing.server_process import ServerProcess
from clefserve.vision.decode import decode_image
from clefserve.vision.preprocess import PreprocessorConfig, preprocess
from clefserve.vision.weights import load_vision_tower

QUESTIONS = {
    "damaged": {"type": "noul", "instructions": "Does the photo show a damaged item?"},
    "kind": {"type": "choice", "instructions": "What is shown?",
             "criteria": {"parcel": "A parcel", "receipt": "A receipt", "shoe": None, "other": None}},
    "urgency": {"type": "score", "instructions": "How urgent is the claim?",
                "criteria": ["Can wait", "This week", "Today", "Right now"]},
}


def photo(width: int, height: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    noise = rng.normal(0, 30, (height, width, 3))
    rgb = np.stack([255 * x / width, 255 * y / height, 128 + 0 * x], -1) + noise
    buffer = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def request(count: int, size: tuple[int, int], seed: int) -> dict:
    return {"model": "bench", "questions": QUESTIONS,
            "state": {"claim": seed, "message": f"Claim {seed}: the item arrived broken, photos attached."},
            "images": [photo(*size, seed * 10 + i) for i in range(count)]}


def tower_rate(
    folder: Path, dtype: torch.dtype, size: tuple[int, int], repeats: int
) -> tuple[float, float, int]:
    """Pictures per second through our tower and transformers' (same weights, same patches). Ours is loaded
    as the server loads it: in the dtype this CPU computes ``dtype``'s projections in (fp32 for bf16 on a CPU
    without bf16 instructions, :func:`clefserve.model.ops.gemm.compute_dtype`)."""
    from transformers import Qwen3_5ForConditionalGeneration

    ours = load_vision_tower(folder, gemm.compute_dtype(torch.device("cpu"), dtype))
    assert ours is not None
    theirs = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=dtype).model.visual.eval()
    preprocessor = PreprocessorConfig.from_folder(folder)
    assert preprocessor is not None
    patches = preprocess(decode_image(photo(*size, 0), 0).image, preprocessor)
    pixels = torch.from_numpy(patches.pixels)
    grid = torch.tensor([patches.grid])

    def rate(fn) -> float:
        with torch.inference_mode():
            fn()
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
        return repeats / (time.perf_counter() - start)

    return (rate(lambda: ours.encode(pixels, patches.grid)),
            rate(lambda: theirs(pixels.to(dtype), grid_thw=grid)), patches.num_patches)


def reference_latencies(folder: Path, dtype: torch.dtype, requests: list[dict]) -> list[float]:
    from tests.oracles import jsm, reference_clef

    model, processor = reference_clef(folder, dtype)
    jsm().systemone(model, processor, {**requests[0], "images": requests[0]["images"][:1]})  # warm-up
    out = []
    for body in requests:
        start = time.perf_counter()
        jsm().systemone(model, processor, body)
        out.append(time.perf_counter() - start)
    return out


def server_latencies(client: httpx.Client, requests: list[dict]) -> tuple[list[float], int]:
    out, tokens = [], 0
    for body in requests:
        start = time.perf_counter()
        response = client.post("/v1/systemone", json=body)
        response.raise_for_status()
        out.append(time.perf_counter() - start)
        tokens = response.json()["usage"]["input_tokens"]
    return out, tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    parser.add_argument("--size", type=int, nargs=2, default=[448, 448], metavar=("W", "H"))
    parser.add_argument("--requests", type=int, default=6, help="requests per measurement")
    parser.add_argument("--repeats", type=int, default=10, help="tower calls per measurement")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    add_heap_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    heap = prepare_heap(args.heap)
    dtype, size = DTYPES[args.dtype], tuple(args.size)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_release(Path(tmp) / "release", clef_shaped_spec(vision=True), seed=0)
        ours, theirs, patches = tower_rate(folder, dtype, size, args.repeats)
        print(f"# {args.dtype}, {args.threads} threads, pictures {size[0]}x{size[1]} ({patches} patches, "
              f"{patches // 4} tokens); reference: {heap}")
        print(f"vision tower: clef-serve {ours:6.2f} pictures/s, transformers {theirs:6.2f} pictures/s "
              f"({ours / theirs:.2f}x)")
        log = Path(tmp) / "server.log"
        with ServerProcess(folder, log, "--dtype", args.dtype, "--x-raw-probabilities",
                           threads=args.threads) as server, \
                httpx.Client(base_url=server.url, timeout=600) as client:
            client.post("/v1/systemone", json=request(1, size, 10_000)).raise_for_status()  # warm-up
            for count in (1, 4):
                bodies = [request(count, size, 100 * count + i) for i in range(args.requests)]
                served, tokens = server_latencies(client, bodies)
                reference = reference_latencies(folder, dtype, bodies)
                ours_p50, ref_p50 = statistics.median(served), statistics.median(reference)
                print(f"{count} picture(s), ~{tokens} tokens: clef-serve p50 {ours_p50:6.3f}s, "
                      f"reference systemone() p50 {ref_p50:6.3f}s ({ref_p50 / ours_p50:.2f}x faster)")
            bodies = [request(1, size, 500 + i) for i in range(2 * args.requests)]
            start = time.perf_counter()
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda body: server_latencies(client, [body]), bodies))
            rate = len(bodies) / (time.perf_counter() - start)
            ref_rate = args.requests / sum(reference_latencies(folder, dtype, bodies[: args.requests]))
            print(f"1 picture, {len(bodies)} requests at concurrency 4: clef-serve {rate:5.2f} req/s, "
                  f"reference systemone() one at a time {ref_rate:5.2f} req/s ({rate / ref_rate:.2f}x)")
            repeated = request(4, size, 100 * 4)  # pictures seen before: encoder cache (and prefix cache)
            repeated["questions"] = {"other": {"type": "noul", "instructions": "Is a receipt shown?"}}
            cached, _ = server_latencies(client, [repeated])
            print(f"4 pictures seen before, other questions: clef-serve {cached[0]:6.3f}s")


if __name__ == "__main__":
    main()
