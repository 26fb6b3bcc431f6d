"""Ray Data integration: each Ray actor holds one engine, and ``Dataset.map_batches`` maps batches of
records through it. Beyond one machine, Ray does the distribution; nothing here knows about clusters.

Install the extra (``pip install 'clefserve[ray]'``), then::

    import ray
    from clefserve.ray import ClefDecisions, decide

    ds = ray.data.read_text("tickets.jsonl")     # a "text" column: one /v1/systemone body per line ...
    ds = ray.data.read_csv("tickets.csv")        # ... or a table, with questions and state_columns
    answers = decide(ds, actors=4, num_gpus=1, batch_size=256,   # 4 actors, one engine and GPU each
                     weights="/models/clef-flash", device="0", dtype="bf16", max_num_seqs=32,
                     questions=questions, state_columns=["message"])
    answers.write_parquet("answers/")

``decide`` is ``ds.map_batches(ClefDecisions, fn_constructor_kwargs=..., compute=ActorPoolStrategy(size=
actors), ...)``; call ``map_batches`` yourself for anything else. Ray counts CPUs as slots: each actor
takes ``num_cpus`` (default 1) and reading the input takes one more, so a cluster needs at least
``actors * num_cpus + 1`` of them or the read waits forever (``ray.init(num_cpus=...)`` on one machine).

A row is a record in one of two forms: a ``text`` column (``body_column``) holding a whole
``/v1/systemone`` body as JSON text, a line of ``clef-serve batch``'s JSONL with its optional ``id`` (read
JSONL with ``read_text``: ``read_json`` would turn each body into typed columns and change it), or state
columns asked ``questions`` (as ``clef-serve batch``'s CSV/Parquet). Each output row is the input row plus
``status`` (200, or the 4xx the HTTP server would answer), ``response`` (the response body as JSON text,
null on error) and ``error`` (the error as JSON text, null on success), and ``id`` (the body's id) when
the input has no id column: answers are computed by exactly the code of the server and of
``clef-serve batch``. A record that fails with an internal error gets status 500 instead of failing the
whole batch. ``scripts/ray_example.py`` is a runnable example on the embedded demo model.
Unlike ``clef-serve batch``, nothing here resumes an interrupted run: Ray retries failed tasks, and the
output is written by the Dataset's own writers.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from clefserve.batch.feeder import EngineFeeder, Outcome, answer_all, window_for
from clefserve.batch.records import ID_FIELD, Item, item_from_json, item_from_row
from clefserve.config import EngineConfig

log = logging.getLogger(__name__)

OUTPUT_COLUMNS = ("status", "response", "error")


def _plain(value: Any) -> Any:
    """numpy scalars (what Ray's numpy batches hold) as Python values."""
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "ndim", None) == 0 else value


def _columns(batch: Any) -> dict[str, list[Any]]:
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas
        return {str(name): batch[name].tolist() for name in batch.columns}
    return {name: list(values.tolist() if hasattr(values, "tolist") else values)
            for name, values in batch.items()}


def _as_json(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


def outcome_columns(outcome: Outcome) -> tuple[int, str | None, str | None]:
    """(status, response JSON, error JSON) of one record."""
    if outcome.response is not None:
        return 200, json.dumps(outcome.response, ensure_ascii=False), None
    error = outcome.error
    if error is None:  # an internal failure (or abandoned): say so in the row, do not fail the batch
        reason = outcome.failure or "the engine stopped before this record finished"
        error = {"status": 500, "error_type": "unknown", "message": f"internal error: {reason}"}
    return int(error["status"]), None, json.dumps(error, ensure_ascii=False)


class ClefDecisions:
    """A callable class for ``Dataset.map_batches``: one engine per actor.

    ``weights``: the release folder (default: the embedded demo model). ``questions`` (a questions object)
    with ``state_columns`` (default: every column but ``id_column``) asks those questions of each row;
    without ``questions`` each row's ``body_column`` holds the whole request. ``model``: the request's
    model field for table rows. Other keyword arguments are :class:`~clefserve.config.EngineConfig` fields,
    the command line's flags with underscores: ``device``, ``dtype``, ``max_num_seqs``, ``kv_cache_mb``,
    ``max_length``, ``raw_probabilities``... ``self_check`` runs the startup self-check in each actor.
    """

    def __init__(
        self,
        weights: str | None = None,
        *,
        questions: dict[str, Any] | None = None,
        state_columns: list[str] | None = None,
        id_column: str = "id",
        body_column: str = "text",
        model: str | None = None,
        self_check: bool = True,
        **engine_options: Any,
    ) -> None:
        from clefserve.cli import serving_decider
        from clefserve.demo import DEMO_FOLDER, DEMO_MODEL_NAME
        from clefserve.formats.clef.engine_backend import EngineBackend

        self.config = EngineConfig(weights=weights, **engine_options)
        folder = Path(weights) if weights is not None else DEMO_FOLDER
        if not folder.is_dir():
            raise ValueError(f"weights {folder}: not a directory")
        name = self.config.served_model_name or (folder.resolve().name if weights else DEMO_MODEL_NAME)
        self.questions, self.state_columns, self.id_column = questions, state_columns, id_column
        self.body_column, self.model = body_column, model or name
        self.backend = EngineBackend(serving_decider(folder, self.config, self.config.torch_device),
                                     self.config, name)
        if self_check:
            problems = self.backend.run_self_check()
            if problems:
                self.close()
                raise RuntimeError(f"the startup self-check failed: {problems[0]}")
        self.feeder = EngineFeeder(self.backend, window_for(self.config.max_num_seqs, self.config.max_queue))

    def _items(self, columns: dict[str, list[Any]], rows: int) -> list[Item]:
        """The batch's records; for bodies without an id column, their own ids go in ``columns``."""
        limit = self.config.max_body_bytes
        ids = columns.get(self.id_column)
        if self.questions is None:
            if self.body_column not in columns:
                raise KeyError(f"no {self.body_column!r} column (and no questions given): columns are "
                               f"{', '.join(columns)}")
            items = [item_from_json(_as_json(_plain(body)), i + 1, limit)
                     for i, body in enumerate(columns[self.body_column])]
            if ids is None:
                columns[self.id_column] = [item.id if item.body is not None and ID_FIELD in item.body
                                           else None for item in items]
            else:
                for item, record_id in zip(items, ids, strict=True):
                    item.id = _plain(record_id)
            return items
        names = self.state_columns or [c for c in columns if c != self.id_column and c not in OUTPUT_COLUMNS]
        missing = [c for c in names if c not in columns]
        if missing:
            raise KeyError(f"no {missing[0]!r} column: columns are {', '.join(columns)}")
        items = []
        for i in range(rows):
            if self.state_columns and len(names) == 1:
                state = _plain(columns[names[0]][i])
            else:
                state = {c: _plain(columns[c][i]) for c in names}
            record_id = _plain(ids[i]) if ids is not None else None
            items.append(item_from_row(record_id, i + 1, state, self.questions, self.model, limit))
        return items

    def __call__(self, batch: Any) -> Any:
        columns = _columns(batch)
        rows = len(next(iter(columns.values()))) if columns else 0
        added_id = self.id_column not in columns
        outcomes = answer_all(self.feeder, self._items(columns, rows))
        extra = {self.id_column: columns[self.id_column]} if added_id and self.id_column in columns else {}
        rows_out = [outcome_columns(outcome) for outcome in outcomes]
        status = [row[0] for row in rows_out]
        response = [row[1] for row in rows_out]
        error = [row[2] for row in rows_out]
        if hasattr(batch, "assign"):  # pandas
            return batch.assign(**extra, status=status, response=response, error=error)
        import numpy as np

        out = dict(batch)
        for name, values in extra.items():
            out[name] = np.asarray(values, dtype=object)
        out["status"] = np.asarray(status, dtype=np.int32)
        out["response"] = np.asarray(response, dtype=object)
        out["error"] = np.asarray(error, dtype=object)
        return out

    def close(self) -> None:
        engine = self.backend.engine
        if engine is not None and not engine.closed:
            engine.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown
            self.close()


def decide(
    dataset: Any,
    *,
    actors: int = 1,
    batch_size: int = 64,
    num_cpus: float = 1,
    num_gpus: float = 0,
    decisions_class: type[ClefDecisions] = ClefDecisions,
    **options: Any,
) -> Any:
    """``dataset`` mapped through ``actors`` actors of ``decisions_class`` (one engine each), ``batch_size``
    records per call; ``options`` go to its constructor (see :class:`ClefDecisions`). Lazy, like every
    Dataset transform: the work runs when the result is consumed or written."""
    import ray.data

    return dataset.map_batches(
        decisions_class, fn_constructor_kwargs=options, batch_size=batch_size, num_cpus=num_cpus,
        num_gpus=num_gpus, compute=ray.data.ActorPoolStrategy(size=actors),
    )
