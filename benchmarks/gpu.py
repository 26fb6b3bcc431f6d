"""The GPU benchmark: our server against transformers' Qwen3.5 with Cloudflare's reference head, one GPU.

    python -m benchmarks.gpu [--dtype bf16] [--tokens 2000] [--kernels auto]     # about 5 minutes on an H100
    python -m benchmarks.gpu --dry-run                                          # a tiny shape on the CPU

Builds a Qwen3.5-9B-shaped random Clef release directly on the device (hidden 4096, 32 layers 3 GDN : 1
attention, GDN 16 key / 32 value heads of 128, attention 16 / 4 heads of 256, FFN 12288, vocab 248,320,
Clef head of width 1024; random weights scaled like the test releases, no 18 GB of safetensors written), then
prints one table:

- our server (the FastAPI app over the engine, in-process, requests in flight at once) at concurrency 1, 8
  and 16, and the reference (transformers' ``Qwen3_5ForCausalLM`` sharing the same weight tensors, with
  ``clef_finetune``'s ``ClefModel`` and ``systemone()``) one request at a time: prefill tokens/s and model
  FLOP utilisation (matmul FLOPs of the records / time / the GPU's dense peak, nominal when the GPU is known,
  else measured);
- max |Δp| between our raw probabilities and the reference's on the same records;
- the kernel chosen for each op, with the reason.

Records are ``--tokens`` long (the byte-level test tokenizer) with three questions each. Needs the test
extras (transformers, clef-finetune) and, for the fast kernels, the gpu extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.flops import prefill_flops
from benchmarks.systemone import make_request
from clefserve.config import DTYPES, EngineConfig
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.engine_backend import EngineBackend
from clefserve.model.backbone import Backbone
from clefserve.model.config import BackboneConfig
from clefserve.model.ops.select import describe
from clefserve.testing.release import ReleaseSpec, random_weight, release_config
from clefserve.testing.tokenizer import save_tokenizer, train_tokenizer

NINE_B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
              num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
              linear_key_head_dim=128, linear_value_head_dim=128)
NINE_B_VOCAB = 248_320
NINE_B_HEAD = {"width": 1024, "routing_layers": 2, "layers": 4, "heads": 8, "feedforward": 4096}
TINY = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=1, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=32, linear_value_head_dim=32)
TINY_HEAD = {"width": 64, "routing_layers": 1, "layers": 1, "heads": 4, "feedforward": 128}

# Dense tensor-core peaks (FLOP/s) by GPU name and dtype, from the vendors' data sheets (no sparsity).
NOMINAL_PEAK = {
    "H200": {torch.bfloat16: 989e12, torch.float16: 989e12},
    "H100": {torch.bfloat16: 989e12, torch.float16: 989e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12},
    "L40S": {torch.bfloat16: 362e12, torch.float16: 362e12},
    "V100": {torch.float16: 125e12},
}


def build_release(folder: Path, dims: dict, head: dict, vocab: int | None) -> dict:
    """Everything of a Clef release except the backbone weights: config.json, tokenizer, joint head."""
    from safetensors.torch import save_file

    from clefserve.formats.clef.head import random_head_tensors

    spec = ReleaseSpec(**dims, conditional_generation=False, head=None)
    tokenizer = train_tokenizer(spec.tokenizer_vocab, 0)
    save_tokenizer(tokenizer, folder)
    raw = release_config(spec, tokenizer)
    if vocab is not None:
        raw["vocab_size"] = vocab  # the real vocabulary's matrices; the test tokenizer uses its first ids
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    head = dict(head, hidden_size=dims["hidden_size"])
    save_file({k: v.contiguous() for k, v in random_head_tensors(head, 1).items()},
              str(folder / "joint_head.safetensors"))
    (folder / "joint_head_config.json").write_text(json.dumps(head))
    return raw


def random_backbone(config: BackboneConfig, dtype: torch.dtype, device: torch.device) -> Backbone:
    """Random weights made on the device, each rounded to ``dtype`` (fp32-kept ones too), so the reference
    model, which holds everything in ``dtype``, computes with the very same values."""
    from clefserve.model.weights import FP32_SUFFIXES

    gen = torch.Generator(device=device).manual_seed(0)
    with torch.device("meta"):
        model = Backbone(config)
    state = {}
    for name, param in model.named_parameters():
        value = random_weight(name, tuple(param.shape), gen).to(dtype)
        state[name] = value.float() if name.endswith(FP32_SUFFIXES) else value
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval()


def reference_model(folder: Path, ours: Backbone, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """transformers' model sharing our big weight tensors (the small fp32 ones are copied in ``dtype``), and
    Cloudflare's ClefModel around it."""
    import transformers
    from clef_finetune._vendor import joint_schema_model as jsm
    from safetensors.torch import load_file

    transformers.logging.set_verbosity_error()
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        hf = transformers.Qwen3_5ForCausalLM(hf_config)
    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v.to(dtype)
             for k, v in ours.state_dict().items()}
    hf.load_state_dict(state, strict=False, assign=True)
    with torch.device(ours.device):  # its inverse frequencies were made on the meta device
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_config)
    left = [name for name, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    assert not left, f"not set from our weights: {left[:5]}"
    hf = hf.to(ours.device).eval()
    head = jsm.JointSchemaHead(**json.loads((folder / "joint_head_config.json").read_text()))
    head.load_state_dict(load_file(str(folder / "joint_head.safetensors")), strict=True)
    model = jsm.ClefModel(hf, head.to(ours.device, dtype)).eval()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                                     eos_token="<|im_end|>", pad_token="<|endoftext|>")
    return jsm, model, SimpleNamespace(tokenizer=tokenizer)


def progress(started: float, what: str) -> None:
    """A line as each phase ends, so that a run stopped at a time limit still shows how far it got."""
    print(f"[{time.perf_counter() - started:5.0f} s] {what}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in NOMINAL_PEAK.items():
            if key in name and dtype in peaks:
                return peaks[dtype], f"nominal dense peak of the {key}"
    size = 4096 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b
    sync(device)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        sync(device)
        best = max(best, 2.0 * size**3 / (time.perf_counter() - start))
    return best, "measured matmul peak"


async def serve_at(backend: EngineBackend, bodies: list[dict], concurrency: int) -> tuple[float, list[dict]]:
    """Wall time to answer ``bodies`` through the app with ``concurrency`` requests in flight."""
    import httpx

    from clefserve.server import create_app

    app = create_app(backend, backend.config)
    transport = httpx.ASGITransport(app=app)
    queue = list(enumerate(bodies))
    answers: list[dict] = [{} for _ in bodies]
    async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as client:

        async def worker() -> None:
            while queue:
                i, body = queue.pop(0)
                response = await client.post("/v1/systemone", json=body)
                response.raise_for_status()
                answers[i] = response.json()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start, answers


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--kernels", choices=["auto", "fast", "reference"], default="auto")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per record (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--reference-requests", type=int, default=6)
    parser.add_argument("--prefill-chunk-size", type=int, default=8192)
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny shape on the CPU in f32 (what the tests run): checks the script, "
                        "measures nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.dtype, args.tokens = "cpu", "f32", 300
        args.concurrency, args.reference_requests = [1, 2], 2
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    dims, head, vocab = (TINY, TINY_HEAD, None) if args.dry_run else (NINE_B, NINE_B_HEAD, NINE_B_VOCAB)
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_release(folder, dims, head, vocab)
        config = BackboneConfig.from_folder(folder)
        backbone = random_backbone(config, dtype, device)
        params = sum(p.numel() for p in backbone.parameters())
        print(f"built a {params / 1e6:,.0f}M-parameter random backbone on {device} in {args.dtype} "
              f"({time.perf_counter() - started:.0f} s)")
        decider = ClefDecider.with_backbone(folder, backbone, args.tokens + 512, args.kernels)
        kernels = describe(backbone.ops, device, dtype)
        rng = random.Random(0)
        bodies = [make_request(decider.encoder, args.tokens, rng) for _ in range(2 * max(args.concurrency))]
        record_tokens = [len(decider.encode(b).input_ids) for b in bodies]
        flops = [prefill_flops(config, n) for n in record_tokens]
        peak, peak_source = peak_flops(device, dtype)

        engine_config = EngineConfig(max_num_seqs=max(args.concurrency), max_length=args.tokens + 512,
                                     prefill_chunk_size=args.prefill_chunk_size, kv_fraction=0.5,
                                     prefix_cache=False, max_queue=4096, raw_probabilities=True)
        backend = EngineBackend(decider, engine_config, "bench")
        try:
            asyncio.run(serve_at(backend, bodies[:2], 2))  # warm-up: Triton compiles, allocator grows
            compiles = " (Triton's compiles and autotuning included)" if device.type == "cuda" else ""
            progress(started, f"warm-up done{compiles}")
            ours_answers: list[dict] = []
            for concurrency in args.concurrency:
                count = 2 * concurrency
                sync(device)
                seconds, answers = asyncio.run(serve_at(backend, bodies[:count], concurrency))
                ours_answers = ours_answers or answers
                tokens = sum(record_tokens[:count])
                rows.append({"system": f"clef-serve, concurrency {concurrency}", "requests": count,
                             "tokens_per_s": tokens / seconds, "mfu": sum(flops[:count]) / seconds / peak})
                progress(started, f"{rows[-1]['system']}: {count} records in {seconds:.2f} s")
        finally:
            assert backend.engine is not None
            backend.engine.shutdown()

        jsm, ref_model, processor = reference_model(folder, backbone, dtype)
        progress(started, "the reference model shares the weights; running it")
        captured: dict[int, dict[str, float]] = {}
        original = jsm.systemone_answer

        def capture(question, probabilities):  # type: ignore[no-untyped-def]
            captured[id(question)] = dict(probabilities)
            return original(question, probabilities)

        jsm.systemone_answer = capture
        try:
            count = min(args.reference_requests, len(ours_answers))
            with torch.inference_mode():
                jsm.systemone(ref_model, processor, bodies[0], max_length=args.tokens + 512)  # warm-up
                sync(device)
                start = time.perf_counter()
                worst = 0.0
                for i, body in enumerate(bodies[:count]):
                    captured.clear()
                    jsm.systemone(ref_model, processor, body, max_length=args.tokens + 512)
                    for qid, question in body["questions"].items():
                        ours = ours_answers[i]["answers"][qid]["x_probabilities"]
                        for option, p in captured[id(question)].items():
                            if option in ours:
                                worst = max(worst, abs(ours[option] - p))
                sync(device)
                seconds = time.perf_counter() - start
        finally:
            jsm.systemone_answer = original
        compared = min(count, len(ours_answers))
        rows.append({"system": "transformers + reference head, one at a time", "requests": count,
                     "tokens_per_s": sum(record_tokens[:count]) / seconds,
                     "mfu": sum(flops[:count]) / seconds / peak})

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{name}, {args.dtype}, records of {min(record_tokens)}-{max(record_tokens)} tokens, "
          f"3 questions each; MFU against {peak / 1e12:.1f} TFLOP/s ({peak_source})")
    print(f"{'system':<48} {'requests':>8} {'prefill tok/s':>14} {'MFU':>7}")
    for row in rows:
        print(f"{row['system']:<48} {row['requests']:>8} {row['tokens_per_s']:>14,.0f} {row['mfu']:>6.1%}")
    ratio = rows[-2]["tokens_per_s"] / rows[-1]["tokens_per_s"]
    print(f"ours at concurrency {args.concurrency[-1]} / reference: {ratio:.1f}x; max |Δp| over "
          f"{compared} records: {worst:.2e}")
    print(kernels)
    print(f"total {time.perf_counter() - started:.0f} s")
    if math.isnan(worst):
        raise SystemExit("max |Δp| is NaN")
    return [*rows, {"max_dp": worst, "kernels": kernels}]


if __name__ == "__main__":
    main()
