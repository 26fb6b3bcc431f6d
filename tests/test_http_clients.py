"""Clients of hosted Clef and of System One mirrors, unchanged but for their base URL, against a real
``clef-serve`` process: the official ``cloudflare`` SDK (Workers AI's ``ai.run``), an OpenRouter-style
client (``/api/alpha/decisions``) and the official ``typesafe-sdk`` under OpenRouter's base URL. Each gets the
answer ``/v1/systemone`` gives for the same request (equal probabilities)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudflare
import httpx
import pytest
from cloudflare import Cloudflare
from typesafe_sdk import Noul, RetryPolicy, Score, TypeSafeClient, TypeSafeUnprocessableEntityError

from clefserve.testing.server_process import ServerFailed, ServerProcess

KEY = "cf-api-token"
ACCOUNT = "023e105f4ecef8ad9ca31a8372d0c353"
STATE = {"channel": "email", "message": "I was charged twice for order A-104; please refund one charge."}
QUESTIONS: dict[str, Any] = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "team": {"type": "choice", "instructions": "Which team?",
             "criteria": {"billing": "Payments", "technical": "Bugs", "sales": None}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["Later", "Today", "Now"]},
}


@pytest.fixture(scope="module")
def server(make_release, tmp_path_factory) -> Iterator[ServerProcess]:
    srv = ServerProcess(make_release(seed=17), tmp_path_factory.mktemp("clients") / "server.log",
                        "--api-key", KEY, "--x-raw-probabilities", "--served-model-name", "clef-random")
    try:
        srv.wait_ready(180)
    except ServerFailed as exc:
        srv.stop()
        pytest.fail(str(exc))
    yield srv
    srv.stop()


def systemone(server: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/v1/systemone", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    return response.json()


def assert_same_answers(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert list(got["answers"]) == list(expected["answers"])
    for qid, answer in expected["answers"].items():
        other = got["answers"][qid]
        assert {k: v for k, v in other.items() if k != "x_probabilities"} == \
            {k: v for k, v in answer.items() if k != "x_probabilities"}
        raw, raw_expected = other["x_probabilities"], answer["x_probabilities"]
        assert raw.keys() == raw_expected.keys()
        assert max(abs(raw[o] - raw_expected[o]) for o in raw) <= 1e-6
    assert got["usage"]["input_tokens"] == expected["usage"]["input_tokens"]
    assert got["usage"]["output_tokens"] == 0


@pytest.fixture
def cf(server: ServerProcess) -> Iterator[Cloudflare]:
    with Cloudflare(api_token=KEY, base_url=f"{server.url}/client/v4", max_retries=0, timeout=60) as client:
        yield client


@pytest.mark.parametrize("model", ["clef-flash", "clef"])
def test_cloudflare_sdk_ai_run(cf: Cloudflare, server: ServerProcess, model: str) -> None:
    result = cf.ai.run(model_name=f"@cf/cloudflare/{model}", account_id=ACCOUNT,
                       extra_body={"state": STATE, "questions": QUESTIONS})
    # the SDK unwraps the envelope and returns its result
    result = result if isinstance(result, dict) else result.model_dump()
    assert result["model"] == f"@cf/cloudflare/{model}"
    assert_same_answers(result, systemone(server, {"model": "m", "state": STATE, "questions": QUESTIONS}))


def test_cloudflare_sdk_errors(cf: Cloudflare, server: ServerProcess) -> None:
    with pytest.raises(cloudflare.BadRequestError) as bad:
        null_level = {"q": {"type": "score", "criteria": ["calm", None]}}
        cf.ai.run(model_name="@cf/cloudflare/clef-flash", account_id=ACCOUNT,
                  extra_body={"state": STATE, "questions": null_level})
    assert bad.value.status_code == 400
    assert "questions.q.score.criteria.1" in str(bad.value) and "5006" in str(bad.value)
    with pytest.raises(cloudflare.BadRequestError) as unknown:
        cf.ai.run(model_name="@cf/meta/llama-3.1-8b-instruct", account_id=ACCOUNT,
                  extra_body={"prompt": "hi"})
    assert "No such model @cf/meta/llama-3.1-8b-instruct" in str(unknown.value)
    with Cloudflare(api_token="wrong", base_url=f"{server.url}/client/v4", max_retries=0) as wrong, \
            pytest.raises(cloudflare.AuthenticationError):
        wrong.ai.run(model_name="@cf/cloudflare/clef", account_id=ACCOUNT,
                     extra_body={"state": STATE, "questions": QUESTIONS})


def test_workers_ai_short_form_and_openrouter_paths(server: ServerProcess) -> None:
    expected = systemone(server, {"model": "m", "state": STATE, "questions": QUESTIONS})
    headers = {"Authorization": f"Bearer {KEY}"}
    short = httpx.post(f"{server.url}/ai/run/@cf/cloudflare/clef", headers=headers, timeout=60,
                       json={"state": STATE, "questions": QUESTIONS}).json()
    assert short["success"] is True
    assert_same_answers(short["result"], expected)
    body = {"model": "typesafe/jev-1.13", "state": STATE, "questions": QUESTIONS}
    routed = httpx.post(f"{server.url}/api/alpha/decisions", json=body, headers=headers, timeout=60).json()
    assert routed["model"] == "typesafe/jev-1.13"
    assert_same_answers(routed, expected)


def test_typesafe_sdk_under_openrouters_base_url(server: ServerProcess) -> None:
    expected = systemone(server, {"model": "m", "state": STATE, "questions": QUESTIONS})
    with TypeSafeClient(api_key=KEY, base_url=f"{server.url}/api", retry=RetryPolicy(max_retries=0),
                        timeout=60) as client:
        result = client.system_one(state=STATE, questions=QUESTIONS, model="typesafe/jev-1.13")
        answers = result.model_dump()["answers"]
        for qid, answer in expected["answers"].items():
            got = answers[qid]
            for key in ("noul", "choice", "confidence", "score"):
                assert got.get(key) == answer.get(key), (qid, key)
            if "probabilities" in answer:
                assert {str(k): v for k, v in got["probabilities"].items()} == answer["probabilities"]

        with pytest.raises(TypeSafeUnprocessableEntityError) as box:
            client.system_one(state="a photo", questions={"dog": {"type": "box", "instructions": "The dog"}})
        assert "cannot answer question 'dog'" in str(box.value)
        too_many = {f"q{i}": Noul(instructions="Is it?") for i in range(65)}
        with pytest.raises(TypeSafeUnprocessableEntityError) as many:
            client.system_one(state="x", questions=too_many)
        assert "--max-questions" in str(many.value)
        with pytest.raises(TypeSafeUnprocessableEntityError):
            client.system_one(state="x", questions={"r": Score(criteria=["ok", " "])})


def test_models_list_the_question_types(server: ServerProcess) -> None:
    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    [card] = models["models"]
    assert card["x_question_types"] == ["noul", "choice", "score"]


def test_server_log_has_no_tracebacks(server: ServerProcess) -> None:
    assert "Traceback" not in Path(server.log).read_text()
