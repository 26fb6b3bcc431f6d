"""The clef-serve command line: help, the default subcommand, argument errors, and the wiring of serve."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from fastapi.testclient import TestClient

from clefserve import cli
from clefserve.config import EngineConfig
from clefserve.vision.inputs import ImageLimits


def test_help_describes_the_server_with_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "System One" in out and "serve" in out
    assert "clef-serve --w /models/clef-flash --d 0" in out


def test_serve_help_lists_the_engine_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--w", "--d", "--dtype", "--p", "--h", "--served-model-name", "--api-key",
                 "--max-body-bytes"):
        assert flag in out


@pytest.mark.parametrize(("argv", "expected"), [
    (["--w", "x", "--d", "0"], ["serve", "--w", "x", "--d", "0"]),
    ([], ["serve"]),
    (["serve", "--w", "x"], ["serve", "--w", "x"]),
    (["--help"], ["--help"]),
])
def test_serve_is_the_default_command(argv: list[str], expected: list[str]) -> None:
    assert cli._with_default_command(argv) == expected


@pytest.mark.parametrize(("argv", "needle"), [
    (["--w", "/no/such/folder"], "not a directory"),
    (["--w", ".", "--d", "gpu"], "expected 'cpu' or a GPU index"),
    (["verify", "--w", ".", "--d", "gpu"], "expected 'cpu' or a GPU index"),
    (["batch", "in.jsonl", "-o", "out.jsonl", "--w", ".", "--d", "gpu"], "expected 'cpu' or a GPU index"),
    (["--w", ".", "--dtype", "f64"], "invalid choice"),
])
def test_argument_errors(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def recording_decider(release: Path) -> type:
    """A real ClefDecider on ``release`` that records the arguments the CLI passed."""
    from clefserve.formats.clef.decider import ClefDecider

    class RecordingDecider(ClefDecider):
        made: ClassVar[list[tuple[Any, ...]]] = []

        def __init__(self, *args: Any, **semantics: Any) -> None:
            RecordingDecider.made.append((*args, semantics.get("image_limits"),
                                          semantics.get("image_cache_bytes")))
            super().__init__(release, torch.float32, "cpu", args[3], **semantics)

    return RecordingDecider


@pytest.fixture
def serve_in_process(monkeypatch: pytest.MonkeyPatch, make_release) -> tuple[dict[str, Any], type]:
    """``clef-serve`` with uvicorn replaced by a recorder (``ran``: the app and uvicorn's arguments) and
    a recording ClefDecider that loads a random release whatever folder it is given."""
    import uvicorn

    import clefserve.formats.clef.decider as decider_module

    ran: dict[str, Any] = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: ran.update(app=app, **kw))
    decider = recording_decider(make_release(seed=2))
    monkeypatch.setattr(decider_module, "ClefDecider", decider)
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    return ran, decider


def wait_ready(client: TestClient, timeout_s: float = 120.0) -> None:
    """Loading and the startup self-check run in the background: seconds alone, longer on a busy machine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.get("/ready").status_code == 200:
            return
        time.sleep(0.05)
    assert client.get("/ready").status_code == 200


def test_serve_wires_decider_backend_and_uvicorn(tmp_path: Path, serve_in_process) -> None:
    ran, decider = serve_in_process
    folder = tmp_path / "clef-flash"
    folder.mkdir()

    assert cli.main(["--w", str(folder), "--d", "cpu", "--dtype", "bf16", "--p", "9123", "--h", "127.0.0.2",
                     "--api-key", "k", "--max-length", "2048"]) == 0
    assert (ran["host"], ran["port"]) == ("127.0.0.2", 9123)
    with TestClient(ran["app"]) as client:
        wait_ready(client)
        assert decider.made[-1] == (folder, torch.bfloat16, torch.device("cpu"), 2048, "auto",
                                    ImageLimits(4, 40_000_000, 5 << 20), 256 << 20)
        assert client.get("/v1/models").status_code == 401
        models = client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()
        assert models["models"][0]["name"] == "clef-flash"
        answer = client.post("/v1/systemone", headers={"Authorization": "Bearer k"},
                             json={"model": "m", "state": "s", "questions": {"q": {"type": "noul"}}})
        assert answer.status_code == 200
        assert 0.0 <= answer.json()["answers"]["q"]["noul"] <= 1.0


def test_serve_without_weights_loads_the_embedded_demo(serve_in_process) -> None:
    from clefserve.demo import DEMO_FOLDER

    ran, decider = serve_in_process
    assert cli.main(["--p", "9124"]) == 0
    with TestClient(ran["app"]) as client:
        wait_ready(client)
        assert decider.made[-1][0] == DEMO_FOLDER
        assert client.get("/v1/models").json()["models"][0]["name"] == "clef-demo"


def test_semantics_flags_reach_the_decider_and_the_model_cards(serve_in_process) -> None:
    ran, _ = serve_in_process
    assert cli.main(["--p", "9125", "--confidence", "typesafe", "--question-ids", "opaque"]) == 0
    with TestClient(ran["app"]) as client:
        wait_ready(client)
        [card] = client.get("/v1/models").json()["models"]
        assert (card["x_confidence"], card["x_question_ids"]) == ("typesafe", "opaque")
        question = {"type": "choice", "criteria": {"a": None, "b": None}}
        answers = [client.post("/v1/systemone", json={"model": "m", "state": "s",
                                                      "questions": {key: question}}).json()["answers"][key]
                   for key in ("team", "a renamed.key")]
        assert answers[0] == answers[1]  # opaque: the key never reaches the model
        p = max(answers[0]["probabilities"].values())
        # typesafe: (m - 1/2) / (1 - 1/2)
        assert answers[0]["confidence"] == pytest.approx(2 * p - 1, abs=2e-4)


def test_semantics_flags_are_checked() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(["serve", "--confidence", "typesafe", "--question-ids", "opaque"])
    config = EngineConfig.from_args(args)
    assert (config.confidence, config.question_ids) == ("typesafe", "opaque")
    assert EngineConfig.from_args(parser.parse_args(["serve"])).confidence == "clef"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--confidence", "entropy"])
