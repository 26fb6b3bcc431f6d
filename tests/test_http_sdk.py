"""The official TypeSafe SDK against a real ``clef-serve`` process on a random release."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from typesafe_sdk import (
    Choice,
    Noul,
    RetryPolicy,
    Score,
    TypeSafeAuthenticationError,
    TypeSafeClient,
    TypeSafeUnprocessableEntityError,
)

from clefserve.testing.server_process import ServerFailed, ServerProcess

ROOT = Path(__file__).resolve().parents[1]
SERVED_NAME = "clef-random"
KEY = "test-key"
START_TIMEOUT_S = 120

# Short texts: the random release runs the plain torch reference path on the CPU, slowly.
QUESTIONS = {
    "billing": Noul(instructions="About a charge?", criteria={"true": "Charges", "false": "Other"}),
    "team": Choice(instructions="Which team?",
                   criteria={"billing": "Payments", "tech": "Bugs", "sales": None}),
    "urgency": Score(instructions={"task": "How urgent?"}, criteria=["Later", "Today", "Now"]),
    "spam": {"type": "noul", "instructions": "Spam?"},
}
STATE = {"amount": 1250.0, "message": "Charged twice, refund today."}


class Server(ServerProcess):
    def __init__(self, folder: Path, log: Path, *extra: str) -> None:
        super().__init__(folder, log, "--served-model-name", SERVED_NAME, *extra)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        try:
            super().wait_ready(timeout_s)
        except ServerFailed as exc:
            pytest.fail(str(exc))


@pytest.fixture(scope="module")
def release(make_release) -> Path:
    return make_release(seed=11)


@pytest.fixture(scope="module")
def server(release: Path, tmp_path_factory) -> Iterator[Server]:
    """No --api-key: the SDK's Authorization header must be accepted and ignored."""
    srv = Server(release, tmp_path_factory.mktemp("sdk") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server: Server) -> Iterator[TypeSafeClient]:
    with TypeSafeClient(api_key="ignored-by-this-server", base_url=server.url, model="jev-latest",
                        retry=RetryPolicy(max_retries=0), timeout=60) as c:
        yield c


def test_sdk_parses_all_three_answer_types(client: TypeSafeClient) -> None:
    result = client.system_one(state=STATE, questions=QUESTIONS)
    assert result.model == "jev-latest"
    assert list(result.answers) == list(QUESTIONS)

    for name in ("billing", "spam"):
        assert 0.0 <= result.nouls[name].noul <= 1.0

    team = result.choices["team"]
    labels = list(QUESTIONS["team"].criteria)
    assert list(team.probabilities) == labels
    assert team.choice in labels
    assert team.probabilities[team.choice] == max(team.probabilities.values())
    assert team.confidence == team.probabilities[team.choice]
    assert abs(sum(team.probabilities.values()) - 1) < 1e-3

    urgency = result.scores["urgency"]
    levels = QUESTIONS["urgency"].criteria
    assert urgency.legend == dict(enumerate(levels))
    assert list(urgency.probabilities) == list(range(len(levels)))
    assert 0.0 <= urgency.score <= len(levels) - 1
    assert abs(urgency.score - sum(i * p for i, p in urgency.probabilities.items())) < 2e-3
    assert abs(sum(urgency.probabilities.values()) - 1) < 1e-3

    assert result.usage.input_tokens > 0
    assert result.usage.output_tokens == 0
    assert len(result.request_id) == 32


def test_sdk_lists_the_served_model(client: TypeSafeClient) -> None:
    listed = client.models.list()
    assert [m.name for m in listed.models] == [SERVED_NAME]
    assert len(listed.models[0].release_date) == 10


def test_sdk_sees_validation_errors_as_422(client: TypeSafeClient) -> None:
    too_many = Score(instructions="Rate it", criteria=[f"level {i}" for i in range(11)])
    with pytest.raises(TypeSafeUnprocessableEntityError) as info:
        client.system_one(state="text", questions={"rating": too_many})
    assert "questions.rating.score.criteria" in str(info.value)
    assert "at most 10" in str(info.value)


def test_http_answers_equal_the_decider_in_process(server: Server, release: Path) -> None:
    """The route hands the model the body as sent: 1250.0 stays a float, keys keep their order."""
    from clefserve.formats.clef.decider import ClefDecider

    raw = json.dumps({"model": "m", "state": STATE, "questions": {
        "billing": {"type": "noul", "instructions": "Money?"},
        "team": {"type": "choice", "criteria": {"sales": None, "billing": "Pay", "tech": [1, 2.0]}},
        "urgency": {"type": "score", "criteria": ["low", "high"]},
    }})
    response = httpx.post(f"{server.url}/v1/systemone", content=raw, timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    [expected] = ClefDecider(release).decide_batch([json.loads(raw)])
    body = response.json()
    cached = body["usage"].pop("x_cached_tokens")  # the prefix cache's share of the record
    assert 0 <= cached <= body["usage"]["input_tokens"]
    assert body == expected


def test_concurrent_sdk_calls_agree(client: TypeSafeClient) -> None:
    def ask(_: int) -> dict:
        return client.system_one(state=STATE, questions=QUESTIONS).model_dump()["answers"]

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, range(3)))
    assert all(a == answers[0] for a in answers)


def test_sdk_with_api_key(release: Path, tmp_path: Path) -> None:
    srv = Server(release, tmp_path / "server.log", "--api-key", KEY)
    try:
        srv.wait_ready()
        no_retry = RetryPolicy(max_retries=0)
        with TypeSafeClient(api_key=KEY, base_url=srv.url, retry=no_retry, timeout=60) as good:
            assert good.system_one(state="hello", questions={"q": Noul(instructions="Hi?")}).nouls["q"]
        with TypeSafeClient(api_key="wrong", base_url=srv.url, retry=no_retry) as bad, \
                pytest.raises(TypeSafeAuthenticationError):
            bad.system_one(state="hello", questions={"q": Noul(instructions="Hi?")})
    finally:
        srv.stop()


EDGE_BODIES = {
    "empty-state": {"state": "", "questions": {"q": {"type": "noul"}}},
    "null-state": {"state": None, "questions": {"q": {"type": "noul", "instructions": None}}},
    "empty-instructions-use-the-id": {"state": "x",
                                      "questions": {"Is it?": {"type": "noul", "instructions": ""}}},
    "space-id": {"state": "x", "questions": {" ": {"type": "noul"}}},
    "special-token-labels": {"state": "<|im_end|>", "questions": {"q": {
        "type": "choice", "criteria": {"<|im_end|>": None, "<think>": "x", "é ü": [None], "0": {}}}}},
    "json-state-padded-levels": {"state": [1, 2.5, True],
                                 "questions": {"q": {"type": "score", "criteria": [" low", "mid\n", "hi"]}}},
    "one-sided-noul": {"state": {"a": {"b": []}},
                       "questions": {"q": {"type": "noul", "criteria": {"false": None}}}},
}


@pytest.mark.parametrize("name", list(EDGE_BODIES))
def test_edge_bodies_through_the_real_model(server: Server, name: str) -> None:
    body = {"model": "m", **EDGE_BODIES[name]}
    response = httpx.post(f"{server.url}/v1/systemone", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert list(response.json()["answers"]) == list(body["questions"])
