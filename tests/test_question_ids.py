"""``--question-ids opaque``: question ids never reach the model, so renaming every key changes nothing.

The opaque record of a request is, token for token, Cloudflare's record of the same request with its keys
renamed to q1, q2, ... (checked against the reference ``systemone`` too); through the server, 20 random
requests with every key renamed (unicode, spaces, dots) keep their probabilities within 1e-6, while the
default ``prompt`` mode (Cloudflare's encoding, covered by the differential tests) moves them.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from clefserve.config import EngineConfig
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.encoder import positional_name
from clefserve.server import create_app
from tests.oracles import jsm, reference_clef
from tests.request_gen import RequestGenerator, api_valid

RENAME_PARTS = ("é", "中文", "🙂", " ", ".", "..", "a.b", " lead", "trail ", "Ω", "\t", "key", "ID: x", "0")


def renamed(request: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {**request, "questions": dict(zip(names, request["questions"].values(), strict=True))}


def random_names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(RENAME_PARTS) for _ in range(rng.randint(1, 4)))
        if name not in names:
            names.append(name)
    return names


@pytest.fixture(scope="module")
def release(make_release):
    return make_release(seed=14)


def test_opaque_record_is_the_reference_record_with_positional_names(release) -> None:
    opaque = ClefDecider(release, question_ids="opaque").encoder
    prompt = ClefDecider(release).encoder
    for request in RequestGenerator(seed=40).requests(60):
        positional = renamed(request, [positional_name(i + 1) for i in range(len(request["questions"]))])
        ours, theirs = opaque.encode(request), prompt.encode(positional)
        assert ours.input_ids == theirs.input_ids
        assert [q.question_span for q in ours.questions] == [q.question_span for q in theirs.questions]
        assert [q.question_id for q in ours.questions] == list(request["questions"])  # mapped back


def test_opaque_answers_equal_the_reference_on_positional_names(release) -> None:
    """Cloudflare's systemone() on the request renamed q1..qN gives the probabilities that --question-ids
    opaque gives for the request as sent, under the request's own keys."""
    ref = jsm()
    model, processor = reference_clef(release)
    decider = ClefDecider(release, question_ids="opaque")
    captured: list[dict[str, float]] = []
    original = ref.systemone_answer

    def capture(question, probabilities):
        captured.append(dict(probabilities))
        return original(question, probabilities)

    ref.systemone_answer = capture
    try:
        for request in RequestGenerator(seed=41).requests(3, long_state=False, max_questions=4):
            captured.clear()
            names = [positional_name(i + 1) for i in range(len(request["questions"]))]
            expected = ref.systemone(model, processor, renamed(request, names))
            [ours] = decider.decide_batch([request], raw=True)
            assert list(ours["answers"]) == list(request["questions"])
            assert ours["usage"] == expected["usage"]
            for qid, probs in zip(request["questions"], captured, strict=True):
                got = ours["answers"][qid]["x_probabilities"]
                assert got.keys() == probs.keys()
                assert max(abs(got[o] - probs[o]) for o in probs) <= 2e-4
    finally:
        ref.systemone_answer = original


def _client(release, mode: str) -> TestClient:
    from clefserve.formats.clef.engine_backend import EngineBackend

    # no prefix cache: every answer is computed, never a replay of an identical record
    config = EngineConfig(kv_cache_mb=16, prefill_chunk_size=512, raw_probabilities=True, question_ids=mode,
                          prefix_cache=False)
    backend = EngineBackend(ClefDecider(release, question_ids=mode), config, "clef-ids")
    return TestClient(create_app(backend, config))


@pytest.fixture(scope="module")
def clients(release) -> Iterator[dict[str, TestClient]]:
    with _client(release, "prompt") as prompt, _client(release, "opaque") as opaque:
        yield {"prompt": prompt, "opaque": opaque}


def _largest_change(client: TestClient, requests: list[dict[str, Any]], rng: random.Random) -> float:
    worst = 0.0
    for request in requests:
        names = random_names(rng, len(request["questions"]))
        before = client.post("/v1/systemone", json=request)
        after = client.post("/v1/systemone", json=renamed(request, names))
        assert before.status_code == after.status_code == 200, (before.text, after.text)
        answers, renamed_answers = before.json()["answers"], after.json()["answers"]
        assert list(renamed_answers) == names
        for qid, name in zip(request["questions"], names, strict=True):
            p, q = answers[qid]["x_probabilities"], renamed_answers[name]["x_probabilities"]
            assert p.keys() == q.keys()
            worst = max(worst, *(abs(p[o] - q[o]) for o in p))
    return worst


def test_renaming_every_key_keeps_the_probabilities(clients: dict[str, TestClient]) -> None:
    generated = RequestGenerator(seed=42).requests(20, long_state=False, max_questions=5)
    requests = [api_valid(r) for r in generated]
    opaque = _largest_change(clients["opaque"], requests, random.Random(0))
    assert opaque <= 1e-6, opaque
    # the same renaming moves Cloudflare's encoding: the check above can fail
    prompt = _largest_change(clients["prompt"], requests, random.Random(0))
    assert prompt > 1e-3, prompt
    print(f"largest probability change on renaming every key: opaque {opaque:.2e}, prompt {prompt:.2e}")


def test_opaque_is_stated_in_openapi_and_model_cards(clients: dict[str, TestClient]) -> None:
    for mode, client in clients.items():
        schema = client.get("/openapi.json").json()["components"]["schemas"]["SystemOneRequest"]
        assert f"--question-ids {mode}" in schema["properties"]["questions"]["description"]
        [card] = client.get("/v1/models").json()["models"]
        assert card["x_question_ids"] == mode
