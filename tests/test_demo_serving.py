"""The README's run command serves the embedded demo model, and its documented ``curl`` gets the documented
answer from a real server process (so the README cannot drift from what a new user sees)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import httpx
import pytest

from clefserve.testing.server_process import ROOT, ServerProcess

README = ROOT / "README.md"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def run_command_arguments() -> list[str]:
    """The ``clef-serve`` arguments of the README's run command (the first bash block)."""
    command = code_blocks("bash")[0]
    words = shlex.split(command.split("&&")[-1])
    assert Path(words[0]).name == "clef-serve", command
    return words[1:]


def documented_request() -> tuple[str, dict]:
    """The path and JSON body of the README's first ``curl``."""
    command = next(block for block in code_blocks("bash") if block.lstrip().startswith("curl"))
    words = shlex.split(command)
    url = next(w for w in words if "/v1/" in w)
    return url[url.index("/v1/"):], json.loads(words[words.index("-d") + 1])


def documented_response() -> dict:
    """The response the README shows right after that ``curl``."""
    text = README.read_text()
    curl = text.index("```bash\ncurl")
    return json.loads(re.search(r"```json\n(.*?)```", text[curl:], flags=re.S).group(1))


def test_the_run_command_needs_no_weights():
    arguments = run_command_arguments()
    assert "--w" not in arguments and "--weights" not in arguments


@pytest.mark.slow
def test_the_documented_curl_gets_the_documented_answer(tmp_path):
    arguments = run_command_arguments()
    if "--p" in arguments:  # the test server takes a free port instead
        del arguments[arguments.index("--p") : arguments.index("--p") + 2]
    path, body = documented_request()
    expected = documented_response()
    with ServerProcess(None, tmp_path / "server.log", *arguments, "--log-level", "warning") as server:
        assert httpx.get(f"{server.url}/v1/models").json()["models"][0]["name"] == body["model"]
        response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"] == expected["usage"]
    answers = response.json()["answers"]
    assert answers.keys() == expected["answers"].keys()
    for question_id, want in expected["answers"].items():
        got = answers[question_id]
        assert got["type"] == want["type"]
        if want["type"] == "choice":
            assert got["choice"] == want["choice"], (question_id, got)
        if want["type"] == "noul":
            assert got["noul"] == pytest.approx(want["noul"], abs=0.02), (question_id, got)
        if want["type"] == "score":
            assert got["score"] == pytest.approx(want["score"], abs=0.05), (question_id, got)
        for option, probability in want.get("probabilities", {}).items():
            assert got["probabilities"][option] == pytest.approx(probability, abs=0.02), (question_id, got)
