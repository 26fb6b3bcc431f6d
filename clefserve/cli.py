"""The ``clef-serve`` command.

``serve`` is the default subcommand, so candle-vllm style arguments work as they are:
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

from clefserve import __version__
from clefserve.config import EngineConfig, add_engine_arguments

log = logging.getLogger("clefserve")

DESCRIPTION = """\
clef-serve: an inference server for System One decision models (Cloudflare Clef / Clef-flash release
format). It answers POST /v1/systemone like the published reference code, and also serves
GET /v1/models, GET /health (liveness) and GET /ready (readiness)."""

SERVE_EXAMPLES = """\
examples:
  clef-serve --w /models/clef-flash --d 0 --dtype bf16 --p 8080
  clef-serve serve --w ./clef-flash --d cpu --host 127.0.0.1 --p 8080 --api-key "$KEY"

  curl -s localhost:8080/v1/systemone -H 'content-type: application/json' -d '{
    "model": "clef-flash", "state": "I was charged twice for order A-104.",
    "questions": {"billing": {"type": "noul", "instructions": "Is this about a payment?"}}}'"""

EXAMPLES = SERVE_EXAMPLES + "\n\nCOMMAND defaults to serve; run 'clef-serve serve --help' for every flag."

SERVE_DESCRIPTION = """\
Load a Clef release folder and serve the System One API over HTTP. /health answers at once;
/ready answers 503 until the model is loaded, then 200."""


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


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import uvicorn

    from clefserve.formats.clef.engine_backend import EngineBackend
    from clefserve.server import create_app

    config = EngineConfig.from_args(args)
    if config.weights is None:
        parser.error("--w DIR is required: the release folder to serve")
    folder = Path(config.weights)
    if not folder.is_dir():
        parser.error(f"--w {folder}: not a directory")
    try:
        device = config.torch_device
    except ValueError:
        parser.error(f"--d {config.device!r}: expected 'cpu' or a GPU index such as 0")
    configure_logging(config.log_level)
    name = config.served_model_name or folder.resolve().name

    def load():  # runs off the event loop, after the server has started
        from clefserve.formats.clef.decider import ClefDecider

        log.info("loading %s from %s (device %s, dtype %s)", name, folder, device, config.dtype)
        return ClefDecider(folder, config.torch_dtype, device, config.max_length)

    backend = EngineBackend.loading(load, config, name, release_date=_release_date(folder),
                                    description=f"Clef decision model {name} served by clef-serve")
    app = create_app(backend, config)
    log.info("clef-serve %s serving %s on http://%s:%d (auth %s)", __version__, name, config.host,
             config.port, "on" if config.api_key else "off")
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


Runner = Callable[[argparse.Namespace, argparse.ArgumentParser], int]
# Subcommand names; the first argument is taken as one of these, else "serve" is assumed.
COMMANDS = ("serve",)


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
