"""Batch inputs: JSONL lines and table rows become records with the HTTP route's own checks and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from clefserve.batch.records import item_from_json, validate
from clefserve.batch.sources import (
    CsvSource,
    InputError,
    JsonlSource,
    ParquetSource,
    load_questions,
    open_source,
)
from clefserve.config import EngineConfig
from clefserve.server import create_app
from clefserve.server.backend import question_types

QUESTIONS = {"refund": {"type": "noul", "instructions": "Refund?"},
             "team": {"type": "choice", "criteria": {"billing": None, "tech": "Bugs"}}}
BODY = {"model": "m", "state": {"msg": "charged twice"}, "questions": QUESTIONS}


class EchoBackend:
    """Answers every valid body with itself: shows what the HTTP route accepted or refused."""

    def model_cards(self) -> list[dict]:
        return []

    def ready(self) -> tuple[bool, str]:
        return True, "ready"

    async def decide(self, body, request_id, is_disconnected):
        return {"model": body["model"], "answers": {}, "usage": {"input_tokens": 1, "output_tokens": 0}}


@pytest.fixture(scope="module")
def http() -> TestClient:
    return TestClient(create_app(EchoBackend(), EngineConfig(max_body_bytes=2000)))


BAD_LINES = [
    b"{not json",
    b"[1, 2]",
    b'"just a string"',
    b'{"model": "m", "state": 1, "questions": {}}',
    b'{"model": "m", "state": NaN, "questions": {"a": {"type": "noul"}}}',
    b'{"model": "m", "state": 1, "state": 2, "questions": {"a": {"type": "noul"}}}',
    b'{"model": "m", "state": 1, "questions": {"a": {"type": "maybe"}}}',
    b'{"model": "m", "state": 1, "questions": {"a": {"type": "score", "criteria": {"0": "x", "1": "y"}}}}',
    b'{"model": "m", "state": "\\ud800", "questions": {"a": {"type": "noul"}}}',
    b'{"state": 1, "questions": {"a": {"type": "noul", "instruction": "typo"}}}',
    b'{"model": "m", "state": "' + b"x" * 2100 + b'", "questions": {"a": {"type": "noul"}}}',
]


@pytest.mark.parametrize("line", BAD_LINES)
def test_a_bad_line_gets_the_http_routes_status_and_detail(line: bytes, http: TestClient) -> None:
    response = http.post("/v1/systemone", content=line, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500
    item = item_from_json(line, 7, 2000)
    validate(item, supported=question_types(EchoBackend()))
    assert item.body is None and item.error is not None
    assert item.error["status"] == response.status_code
    detail = response.json()["detail"]
    if isinstance(detail, list):
        assert item.error["detail"] == detail
        assert detail[0]["msg"] in item.error["message"]
    else:
        assert (item.error["message"], item.error["error_type"]) == (detail["message"], detail["error_type"])
    assert item.id == 7  # a record that cannot be read keeps its position as id


def test_a_good_line_passes_unchanged_with_its_id(http: TestClient) -> None:
    line = json.dumps({"id": "T-1", **BODY, "state": {"amount": 1250.0, "b": 1}}).encode()
    assert http.post("/v1/systemone", content=line).status_code == 200
    item = item_from_json(line, 3, 2000)
    validate(item, supported=question_types(EchoBackend()))
    assert item.error is None and item.id == "T-1"
    assert item.body == json.loads(line) and isinstance(item.body["state"]["amount"], float)


@pytest.mark.parametrize(("value", "message"), [
    (True, "not bool"), (1.5, "not float"), ({"a": 1}, "not dict"), ("", "must not be empty")])
def test_an_unusable_id_is_an_error_under_the_line_number(value: object, message: str) -> None:
    item = item_from_json(json.dumps({"id": value, **BODY}).encode(), 9, 2000)
    assert item.id == 9 and item.error is not None and item.error["status"] == 422
    assert message in item.error["message"]


def test_jsonl_positions_blank_lines_and_an_overlong_line(tmp_path: Path) -> None:
    good = json.dumps(BODY).encode()
    path = tmp_path / "in.jsonl"
    path.write_bytes(good + b"\n\n   \n" + b'{"a": "' + b"y" * 5000 + b'"}\n' + good + b"\r\n" + good)
    source = JsonlSource(path, 1000)
    items = list(source)
    assert source.count() == 4
    assert [item.position for item in items] == [1, 4, 5, 6]
    assert [item.id for item in items] == [1, 4, 5, 6]
    over = items[1]
    assert over.error == {"status": 413, "error_type": "request_too_large",
                          "message": "request body is larger than 1000 bytes (--max-body-bytes)"}
    assert over.size > 5000
    assert all(item.error is None for item in (items[0], items[2], items[3]))


def test_questions_file_is_read_strictly(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    path.write_text(json.dumps(QUESTIONS))
    assert load_questions(path) == QUESTIONS
    path.write_text('{"a": 1, "a": 2}')
    with pytest.raises(InputError, match="duplicate key"):
        load_questions(path)
    path.write_text("[1]")
    with pytest.raises(InputError, match="JSON object"):
        load_questions(path)


def write_csv(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_csv_rows_become_bodies(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", 'ticket_id,message,plan\nA-1,"Charged twice, refund",pro\n'
                                         'A-2,"multi\nline",free\n,empty id,pro\nA-4,too,many,fields\n')
    one = list(CsvSource(path, QUESTIONS, "clef", ["message"], "ticket_id", 10_000))
    assert [i.id for i in one] == ["A-1", "A-2", 3, 4]
    assert one[0].body == {"model": "clef", "state": "Charged twice, refund", "questions": QUESTIONS}
    assert one[1].body["state"] == "multi\nline"
    assert one[2].error is not None and "must not be empty" in one[2].error["message"]
    assert one[3].error is not None and "4 fields" in one[3].error["message"]
    several = list(CsvSource(path, QUESTIONS, "clef", None, "ticket_id", 10_000))
    assert several[0].body["state"] == {"message": "Charged twice, refund", "plan": "pro"}
    assert CsvSource(path, QUESTIONS, "clef", None, None, 10_000).count() == 4


def test_csv_field_over_the_body_limit_is_a_413_and_the_next_row_still_reads(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", "id,message\n1,short\n2," + "z" * 200_000 + "\n3,after\n")
    items = list(CsvSource(path, QUESTIONS, "clef", ["message"], None, 1000))
    assert [i.error["status"] if i.error else 200 for i in items] == [200, 413, 200]
    assert items[2].id == "3" and items[2].body["state"] == "after"


def test_csv_errors_name_the_columns(tmp_path: Path) -> None:
    path = write_csv(tmp_path / "t.csv", "id,message\n1,x\n")
    with pytest.raises(InputError, match="no such column"):
        list(CsvSource(path, QUESTIONS, "clef", ["text"], None, 1000))
    with pytest.raises(InputError, match="needs --questions"):
        open_source(path, "csv", 1000, None, "clef", None, None)
    with pytest.raises(InputError, match="for CSV and Parquet"):
        open_source(path, "jsonl", 1000, QUESTIONS, "clef", None, None)


def test_parquet_rows_keep_their_types(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"id": [10, 11, 12], "amount": [1250.0, float("nan"), 3.5],
                      "tags": [["a", "b"], [], None], "when": pa.array([0, 86_400_000, 0], pa.date64())})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    source = ParquetSource(path, QUESTIONS, "clef", None, None, 10_000)
    items = list(source)
    assert source.count() == 3 and [i.id for i in items] == [10, 11, 12]
    assert items[0].body["state"] == {"amount": 1250.0, "tags": ["a", "b"], "when": "1970-01-01"}
    assert items[1].error is not None and "NaN" in items[1].error["message"]  # as the server refuses NaN
    assert items[2].body["state"]["tags"] is None


# ---- the command line (errors that come before any model is loaded) ----

def test_batch_help_lists_its_flags_and_hides_the_servers(capsys: pytest.CaptureFixture[str]) -> None:
    from clefserve import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["batch", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("INPUT", "--output", "--questions", "--state-column", "--id-column", "--quiet",
                 "--fsync-interval-s", "--lookahead", "--max-num-seqs", "--x-raw-probabilities", "--w"):
        assert flag in out
    assert "--api-key" not in out and "--port" not in out and "join on id" in out


@pytest.mark.parametrize(("argv", "needle"), [
    (["batch", "in.jsonl"], "required: -o"),
    (["batch", "missing.jsonl", "-o", "out.jsonl"], "no such file"),
    (["batch", "in.jsonl", "-o", "out.jsonl", "--questions", "q.json"], "for CSV and Parquet"),
    (["batch", "in.csv", "-o", "out.jsonl"], "needs --questions"),
    (["batch", "in.jsonl", "-o", "bad.jsonl"], "refusing to append"),
    (["batch", "in.jsonl", "-o", "./in.jsonl"], "the same file"),
])
def test_batch_argument_errors(argv: list[str], needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    from clefserve import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text(json.dumps(BODY) + "\n")
    (tmp_path / "in.csv").write_text("id,message\n1,x\n")
    (tmp_path / "q.json").write_text(json.dumps(QUESTIONS))
    (tmp_path / "bad.jsonl").write_text("not a batch line\n")
    monkeypatch.setattr("clefserve.cli.configure_logging", lambda level: None)
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert needle in capsys.readouterr().err
    assert (tmp_path / "bad.jsonl").read_text() == "not a batch line\n"
