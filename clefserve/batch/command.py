"""``clef-serve batch``: the command line of offline batch decisions."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from clefserve.batch.job import DEFAULT_LOOKAHEAD, DEFAULT_LOOKAHEAD_BYTES
from clefserve.batch.output import DEFAULT_FSYNC_INTERVAL_S
from clefserve.config import add_engine_arguments

log = logging.getLogger("clefserve.batch")

BATCH_DESCRIPTION = """\
Answer every record of a file with the engine in this process (no HTTP): the same validation, encoding,
engine and head as POST /v1/systemone, so each answer is the one the server gives for the same body.

INPUT is JSONL (one /v1/systemone body per line, with an optional "id": a string or an integer), or a CSV
or Parquet table asked --questions FILE.json (the "questions" object of a request) about each row: the
state is the --state-column's value, several columns' values as an object, or without --state-column every
column but the id column as an object. A record's id is its "id" (JSONL) or --id-column (default: a
column named id), else its position: the line number (JSONL) or row number (tables), from 1.

OUTPUT gets one line per record as it finishes, in JSONL: {"id": ..., "model", "answers", "usage"}, or
{"id": ..., "error": {"status", "error_type", "message"[, "detail"]}} with the status and message the HTTP
server would answer (413 for a line over --max-body-bytes, 422 for malformed JSON or an invalid request,
with FastAPI's "detail" list, 413/422 tokens_exceeded). A bad record never stops the run. Lines follow the
order records finish, so join on id: records sharing a state are run next to each other (the prefix cache
computes the state once) and short records overtake long ones. A .parquet OUTPUT has the columns id,
status, response and error (JSON text).

Nothing is lost: each line is written as its record finishes and fsynced at least every
--fsync-interval-s. Ctrl-C or SIGTERM stops reading and lets the records in flight finish (a second one,
or --shutdown-grace-s, abandons them). Run the same command again to continue: ids already in OUTPUT are
skipped, and a half-written last line (the process was killed while writing) is cut off and redone."""

BATCH_EXAMPLES = """\
examples:
  clef-serve batch tickets.jsonl -o answers.jsonl
  clef-serve batch --w /models/clef-flash --d 0 --dtype bf16 --max-num-seqs 32 tickets.jsonl -o answers.jsonl
  clef-serve batch tickets.csv --questions triage.json --state-column message --id-column ticket_id \\
      -o answers.parquet

  a JSONL line:
  {"id": "T-1", "model": "clef-demo", "state": {"message": "Charged twice, refund please"},
   "questions": {"refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"}}}"""

# serve's flags that mean nothing without a listening socket: accepted, hidden from --help
_SERVER_ONLY = ("host", "port", "api_key", "console")


def add_batch_command(commands: Any) -> None:
    from clefserve.batch.sources import FORMATS

    batch = commands.add_parser(
        "batch", help="answer a JSONL, CSV or Parquet file of records offline, resumably",
        description=BATCH_DESCRIPTION, epilog=BATCH_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    batch.add_argument("input", metavar="INPUT", type=Path, help="records: .jsonl, .csv or .parquet")
    batch.add_argument("-o", "--output", metavar="OUTPUT", type=Path, required=True,
                       help="answers, appended to when it exists: .jsonl or .parquet")
    io = batch.add_argument_group("batch")
    io.add_argument("--input-format", choices=FORMATS, help="default: from INPUT's extension (else jsonl)")
    io.add_argument("--output-format", choices=("jsonl", "parquet"),
                    help="default: from OUTPUT's extension (else jsonl)")
    io.add_argument("--questions", metavar="FILE.json", type=Path,
                    help="CSV/Parquet: the questions object asked of every row")
    io.add_argument("--state-column", metavar="NAME", action="append", dest="state_columns",
                    help="CSV/Parquet: the state column; repeat for an object of several columns "
                    "(default: every column but the id column)")
    io.add_argument("--id-column", metavar="NAME",
                    help="CSV/Parquet: the id column (default: 'id' when there is one, else the row number)")
    io.add_argument("--model", metavar="NAME",
                    help="CSV/Parquet: the request's model field, echoed in each answer "
                    "(default: the served model name)")
    io.add_argument("--lookahead", type=int, default=DEFAULT_LOOKAHEAD, metavar="N",
                    help="records read ahead to group those sharing a state (also bounded by "
                    f"{DEFAULT_LOOKAHEAD_BYTES >> 20} MiB of JSON) (default: %(default)s)")
    io.add_argument("--fsync-interval-s", type=float, default=DEFAULT_FSYNC_INTERVAL_S, metavar="S",
                    help="fsync OUTPUT at least this often while lines are unsynced; 0: after every write "
                    "(default: %(default)s)")
    io.add_argument("--quiet", action="store_true",
                    help="no progress bar: a JSON log line every 30 s and a summary line, for logs")
    add_engine_arguments(batch)
    for action in batch._actions:
        if action.dest in _SERVER_ONLY:
            action.help = argparse.SUPPRESS
    batch.set_defaults(run=run_batch, command_parser=batch)


def run_batch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        return _run(args, parser)
    except KeyboardInterrupt:
        print("clef-serve batch: interrupted before any record was sent; nothing was written",
              file=sys.stderr)
        return 128 + signal.SIGINT


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from clefserve.batch.feeder import EngineFeeder, window_for
    from clefserve.batch.idset import IdSet
    from clefserve.batch.job import BatchJob, StopSignals
    from clefserve.batch.lookahead import Lookahead
    from clefserve.batch.output import OutputError, open_output
    from clefserve.batch.progress import Progress
    from clefserve.batch.sources import InputError, format_of, load_questions, open_source
    from clefserve.cli import command_setup, configure_logging, serving_decider
    from clefserve.engine.python_heap import freeze_loaded_objects
    from clefserve.errors import RequestError
    from clefserve.formats.clef.engine_backend import EngineBackend

    config, folder, name, device = command_setup(args, parser)
    if args.lookahead < 1 or args.fsync_interval_s < 0:
        parser.error("--lookahead must be at least 1 and --fsync-interval-s at least 0")
    if args.input.exists() and args.output.exists() and args.input.samefile(args.output):
        parser.error("INPUT and OUTPUT are the same file")
    configure_logging(config.log_level)
    out_format = args.output_format or ("parquet" if args.output.suffix.lower() in (".parquet", ".pq")
                                        else "jsonl")
    done = IdSet()
    try:
        questions = load_questions(args.questions) if args.questions is not None else None
        source = open_source(args.input, format_of(args.input, args.input_format), config.max_body_bytes,
                             questions, args.model or name, args.state_columns, args.id_column,
                             config.image_body_bytes if config.max_images > 0 else 0)
        output = open_output(args.output, out_format, args.fsync_interval_s)
        output.open(done)
    except (InputError, OutputError) as exc:
        print(f"clef-serve batch: {exc}", file=sys.stderr)
        return 2
    try:
        total = source.count()
        log.info("%s: %s records; %s: %d already done", args.input, total, args.output, output.lines)
        log.info("loading %s from %s (device %s, dtype %s)", name, folder, device, config.dtype)
        backend = EngineBackend(serving_decider(folder, config, device), config, name)
        assert backend.engine is not None
        try:
            try:
                problems = backend.run_self_check()
            except RequestError as exc:  # e.g. a --max-length too short for the canary records
                problems = [f"{exc.message}"]
            if problems:
                print(f"clef-serve batch: the startup self-check failed ({problems[0]}; the log has the "
                      "details): not answering with this build and these flags", file=sys.stderr)
                return 1
            freeze_loaded_objects()
            feeder = EngineFeeder(backend, window_for(config.max_num_seqs, config.max_queue))
            progress = Progress(None if total is None else max(0, total - output.lines), args.quiet)
            job = BatchJob(iter(source), feeder, output, done, progress,
                           Lookahead(args.lookahead, DEFAULT_LOOKAHEAD_BYTES), config.shutdown_grace_s)
            with StopSignals() as signals, _logs_beside(progress):
                try:
                    result = job.run(signals)
                except OSError as exc:  # e.g. the disk is full: what was written stays
                    print(f"clef-serve batch: writing {args.output} failed: {exc}. The lines written before "
                          "are kept; run the same command again to continue.", file=sys.stderr)
                    return 1
        finally:
            backend.engine.shutdown()
        if result.completed:
            output.finish()
    finally:
        output.close()
    return _report(result, progress, args)


@contextlib.contextmanager
def _logs_beside(progress: Any) -> Any:
    """Log lines printed above the progress bar instead of through it."""
    if progress.quiet:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm():
        yield


def _report(result: Any, progress: Any, args: argparse.Namespace) -> int:
    text, fields = progress.summary(result.tally)
    print(text, file=sys.stderr)
    if args.quiet:
        log.info("batch finished", extra={"summary": fields})
    tally = result.tally
    if result.signal_name is not None:
        what = ("abandoned at the end of --shutdown-grace-s" if result.abandoned_on_timeout
                else "abandoned" if tally.abandoned else "finished")
        print(f"clef-serve batch: stopped by {result.signal_name}; the records in flight were {what} and "
              f"every finished answer is in {args.output}. Run the same command again to continue: ids "
              "already in OUTPUT are skipped.", file=sys.stderr)
        return 128 + int(signal.Signals[result.signal_name])
    if tally.failed:
        print(f"clef-serve batch: {tally.failed} records failed with internal errors (the log has them) and "
              "were not written; run the same command again to retry them", file=sys.stderr)
        return 1
    return 0
