"""The ``clef-serve`` command.

``serve`` is the default subcommand (the others: ``verify``, ``batch``), so candle-vllm style arguments
work as they are:
``clef-serve --w /models/clef-flash --d 0 --dtype bf16 --p 8080``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from clefserve import __version__
from clefserve.config import EngineConfig, add_engine_arguments

log = logging.getLogger("clefserve")

DESCRIPTION = """\
clef-serve: an inference server for System One decision models (Cloudflare Clef / Clef-flash release
format). It answers POST /v1/systemone like the published reference code (also under OpenRouter's
/api/alpha/decisions and Workers AI's /client/v4/accounts/ID/ai/run/@cf/cloudflare/clef), and also serves
GET /v1/models, GET /v1/status, GET /health (liveness), GET /ready (readiness) and a browser console at /."""

SERVE_EXAMPLES = """\
examples:
  clef-serve --d cpu --p 8080          # the embedded demo model (support-ticket triage)
  clef-serve --w /models/clef-flash --d 0 --dtype bf16 --p 8080
  clef-serve serve --w ./clef-flash --d cpu --host 127.0.0.1 --p 8080 --api-key "$KEY"

  curl -s localhost:8080/v1/systemone -H 'content-type: application/json' -d '{
    "model": "clef-demo", "state": {"customer": {"plan": "pro"},
      "message": "I was charged twice for order A-104, please refund me."},
    "questions": {"team": {"type": "choice",
                           "criteria": {"billing": null, "technical": null, "shipping": null}},
                  "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}'"""

EXAMPLES = SERVE_EXAMPLES + "\n\nCOMMAND defaults to serve; run 'clef-serve serve --help' for every flag."

SERVE_DESCRIPTION = """\
Load a Clef release folder (without --w: the embedded demo model) and serve the System One API over
HTTP. /health answers at once; /ready answers 503 until the model is loaded and its startup self-check
has passed, then 200. Open http://HOST:PORT/ in a browser for the console (ask a decision, see the
probabilities, watch the engine); --no-console turns it off."""


def configure_logging(level: str) -> None:
    """One JSON object per line on stderr (ts, level, logger, msg, request_id, extra fields)."""
    from clefserve.server.logging import configure_json_logging

    configure_json_logging(level)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # uvicorn handles SIGTERM while it serves (drain, then lifespan shutdown) and re-raises it to the
    # handler that was there before once it is done: this one, so the process exits 0, not -15.
    raise SystemExit(0)


def _release_date(folder: Path) -> dt.date:
    """The day the release's config.json was written: a stand-in for a release date."""
    try:
        return dt.date.fromtimestamp((folder / "config.json").stat().st_mtime)
    except OSError:
        return dt.date.today()


def release_folder(config: EngineConfig, parser: argparse.ArgumentParser) -> tuple[Path, str]:
    """The folder to load and the name to serve it under: ``--w``, else the embedded demo model."""
    from clefserve.demo import DEMO_FOLDER, DEMO_MODEL_NAME

    if config.weights is None:
        return DEMO_FOLDER, config.served_model_name or DEMO_MODEL_NAME
    folder = Path(config.weights)
    if not folder.is_dir():
        parser.error(f"--w {folder}: not a directory")
    return folder, config.served_model_name or folder.resolve().name


def command_setup(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[EngineConfig, Path, str, Any]:
    """What a command that loads a release does first: its config, the folder and the name to serve, the
    torch device, and the refusals that come before anything loads (a bad ``--d``, :func:`preflight`)."""
    config = EngineConfig.from_args(args)
    folder, name = release_folder(config, parser)
    try:
        device = config.torch_device
    except ValueError:
        parser.error(f"--d {config.device!r}: expected 'cpu' or a GPU index such as 0")
    preflight(config, parser)
    return config, folder, name, device


def preflight(config: EngineConfig, parser: argparse.ArgumentParser) -> None:
    """Refuse at once, before anything loads, what this device cannot do: ``--dtype bf16`` on a GPU without
    bf16 (a V100), ``--kernels fast`` on a CPU without Triton's interpreter and fla."""
    from clefserve.errors import StartupError
    from clefserve.model.device import check_dtype, device_facts
    from clefserve.model.ops.select import fla_unavailable

    try:
        facts = device_facts(config.torch_device)
        check_dtype(facts, config.torch_dtype)
        if config.kernels == "fast" and not facts.is_cuda:
            why = fla_unavailable(facts, config.torch_dtype)
            if why is not None:
                raise StartupError(f"--kernels fast on a CPU: {why}; --kernels auto takes the CPU ops")
    except StartupError as exc:
        parser.exit(2, f"clef-serve: error: {exc}\n")


def serving_decider(folder: Path, config: EngineConfig, device: Any) -> Any:
    """The release with the ops it will serve with (a fault injected on purpose only through
    ``CLEF_FAULT_ZERO_CONV_BAND``, for tests that prove the self-check catches it)."""
    from clefserve.formats.clef.decider import ClefDecider
    from clefserve.model.ops.faults import ops_from_environment
    from clefserve.model.ops.select import describe
    from clefserve.vision.inputs import ImageLimits

    limits = ImageLimits(config.max_images, config.max_image_pixels, config.max_image_bytes)
    decider = ClefDecider(folder, config.torch_dtype, device, config.max_length, config.kernels,
                          confidence=config.confidence, question_ids=config.question_ids, image_limits=limits,
                          image_cache_bytes=config.image_cache_mb << 20)
    decider.backbone.set_ops(ops_from_environment(decider.backbone.config, decider.backbone.ops))
    log.info(describe(decider.backbone.ops, decider.backbone.device, config.torch_dtype))
    if decider.images is not None:
        tower, pre = decider.images.encoder.tower.config, decider.images.inputs.preprocessor
        log.info("images: vision tower of %d blocks (width %d); up to %d per request, %d bytes and %d pixels "
                 "each; resized to %d-%d pixels, %d pixels per token side; encoder cache %d MiB",
                 tower.depth, tower.hidden_size, config.max_images, config.max_image_bytes,
                 config.max_image_pixels, pre.min_pixels, pre.max_pixels, pre.factor, config.image_cache_mb)
    else:
        log.info("images: refused (%s)", decider.images_refused)
    return decider


def run_verify(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Exit 0 when the serving path agrees with the reference path (and with transformers when installed)."""
    from clefserve.formats.clef.engine_backend import EngineBackend

    config, folder, name, device = command_setup(args, parser)
    configure_logging(config.log_level)
    decider = serving_decider(folder, config, device)
    backend = EngineBackend(decider, config, name)
    try:
        problems = backend.run_self_check()
    finally:
        assert backend.engine is not None
        backend.engine.shutdown()
    problems += transformers_check(folder, decider, config)
    for problem in problems:
        print(f"MISMATCH {problem}")
    verdict = "FAILED" if problems else "passed"
    print(f"verify {folder}: {verdict} ({decider.backbone.ops.name} ops, {config.dtype})")
    return 1 if problems else 0


def transformers_check(folder: Path, decider: Any, config: EngineConfig) -> list[str]:
    """Final hidden rows of the canary records against transformers' Qwen3.5, when it is installed."""
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: skipping the check against its backbone")
        return []
    import torch

    from clefserve.formats.clef.canary import build_canaries

    transformers.logging.set_verbosity_error()
    arch = decider.backbone.config.architecture
    model = getattr(transformers, arch).from_pretrained(folder, dtype=decider.backbone.dtype).eval()
    text = model.model.language_model if hasattr(model.model, "language_model") else model.model
    tolerance = 1e-3 if decider.backbone.dtype == torch.float32 else 1e-1
    problems = []
    with torch.inference_mode():
        canaries, _ = build_canaries(decider.encode, config.prefill_chunk_size, config.max_length,
                                     images=decider.takes_images)
        for i, canary in enumerate(canaries):
            record = canary.record
            ids = torch.tensor(record.input_ids)
            ours, _ = decider.backbone.run_sequence(ids, inputs=decider.inputs(record, fresh=True))
            if record.images:  # the vision tower too: transformers' model with the pixels
                ref = model.model(input_ids=ids[None].to(ours.device), use_cache=False,
                                  **_transformers_media(record, ours.device)).last_hidden_state[0]
            else:
                ref = text(input_ids=ids[None].to(ours.device), use_cache=False).last_hidden_state[0]
            diff = (ours.float() - ref.float()).abs().max().item()
            if not diff <= tolerance * max(1.0, ref.float().abs().max().item()):
                problems.append(f"canary {i + 1} ({canary.name}): hidden rows differ from transformers by "
                                f"{diff:.3g}")
    return problems


def _transformers_media(record: Any, device: Any) -> dict[str, Any]:
    """A record's pictures as transformers' Qwen3.5 takes them (pixels, grids, token types)."""
    import torch

    pixels = torch.cat([torch.from_numpy(p.patches.pixels) for p in record.prepared_images])
    grids = torch.tensor([p.patches.grid for p in record.prepared_images])
    types = torch.zeros(1, len(record.input_ids), dtype=torch.long)
    for image in record.images:
        types[0, image.span.start : image.span.end] = 1
    return {"pixel_values": pixels.to(device), "image_grid_thw": grids.to(device),
            "mm_token_type_ids": types.to(device)}


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import uvicorn

    from clefserve.formats.clef.engine_backend import EngineBackend
    from clefserve.server import create_app

    config, folder, name, device = command_setup(args, parser)
    configure_logging(config.log_level)
    if config.weights is None:
        log.warning("no --w given: serving the embedded demo model %s, a tiny support-ticket triage model "
                    "(see clefserve/demo/README.md); pass --w DIR to serve a real Clef release", name)

    def load():  # runs off the event loop, after the server has started

        log.info("loading %s from %s (device %s, dtype %s)", name, folder, device, config.dtype)
        return serving_decider(folder, config, device)

    backend = EngineBackend.loading(load, config, name, release_date=_release_date(folder),
                                    description=f"Clef decision model {name} served by clef-serve",
                                    self_check=True, freeze_heap=True)
    app = create_app(backend, config)
    log.info("clef-serve %s serving %s on http://%s:%d (auth %s)", __version__, name, config.host,
             config.port, "on" if config.api_key else "off")
    if config.console:
        log.info("console: open %s in a browser", console_address(config.host, config.port))
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        # On SIGTERM uvicorn closes the listening socket, lets in-flight requests finish for up to
        # --shutdown-grace-s (the engine keeps running them), cancels what is left, then runs the
        # lifespan shutdown, which stops the engine (EngineBackend.stop).
        uvicorn.run(app, host=config.host, port=config.port, log_config=None, access_log=False,
                    log_level=config.log_level, timeout_graceful_shutdown=config.shutdown_grace_s)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    log.info("clef-serve stopped")
    return 0


def console_address(host: str, port: int) -> str:
    """The console's address for the log: a wildcard bind address is reachable as localhost."""
    if host in ("0.0.0.0", "::", ""):
        host = "localhost"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


Runner = Callable[[argparse.Namespace, argparse.ArgumentParser], int]
# Subcommand names; the first argument is taken as one of these, else "serve" is assumed.
COMMANDS = ("serve", "verify", "batch")


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="clef-serve", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"clef-serve {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser("serve", help="serve the HTTP API (the default)",
                                description=SERVE_DESCRIPTION, epilog=SERVE_EXAMPLES,
                                formatter_class=formatter)
    add_engine_arguments(serve)
    serve.set_defaults(run=run_serve, command_parser=serve)
    verify = commands.add_parser(
        "verify", help="check the serving path against the reference path on canary records",
        description="Run canary records through the serving path (engine: batched, chunked, prefix cache) "
        "and the plain one-piece reference path, and against transformers' backbone when it is installed. "
        "Exits non-zero on any mismatch: run it in CI/CD before a rollout.",
    )
    add_engine_arguments(verify)
    verify.set_defaults(run=run_verify, command_parser=verify)
    from clefserve.batch.command import add_batch_command

    add_batch_command(commands)
    return parser


def _with_default_command(argv: Sequence[str]) -> list[str]:
    argv = list(argv)
    if argv and (argv[0] in COMMANDS or argv[0] in ("-h", "--help", "--version")):
        return argv
    return ["serve", *argv]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_with_default_command(sys.argv[1:] if argv is None else argv))
    run: Runner = args.run
    return run(args, args.command_parser)


if __name__ == "__main__":
    sys.exit(main())
