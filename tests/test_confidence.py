"""``--confidence``: Clef's top probability (the default) or TypeSafe's documented formulas.

The formulas are checked against the worked examples of systemone-api.md §10 (and the docs' own example),
and on random probability vectors against an independent vectorised implementation written here from the
definitions (closed-form uniform spread instead of a sum, numpy instead of Python floats).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient

from clefserve.confidence import confidence, typesafe_choice_confidence, typesafe_score_confidence
from clefserve.config import EngineConfig
from clefserve.server import create_app
from tests.request_gen import RequestGenerator, api_valid


def independent_choice(p: np.ndarray) -> float:
    n = len(p)
    p = p / p.sum() if p.sum() > 0 else np.full(n, 1.0 / n)
    return 1.0 if n == 1 else float((n * p.max() - 1.0) / (n - 1.0))


def independent_score(p: np.ndarray) -> float:
    n = len(p)
    if n == 1:
        return 1.0
    p = p / p.sum() if p.sum() > 0 else np.full(n, 1.0 / n)
    uniform_spread = n / 4 if n % 2 == 0 else (n * n - 1) / (4 * n)  # mean |i - (n-1)/2| over 0..n-1
    spread = float(p @ np.abs(np.arange(n) - int(np.argmax(p))))
    return max(0.0, 1.0 - spread / uniform_spread)


def test_worked_examples_of_the_contract() -> None:
    # systemone-api.md §10: choice (0.90 - 1/3) / (2/3) = 0.85
    assert typesafe_choice_confidence([0.9, 0.07, 0.03]) == pytest.approx(0.85, abs=1e-12)
    # §10: score, mode 2, deviation 0.37, D = 1.0 -> 0.63
    assert typesafe_score_confidence([0.02, 0.18, 0.65, 0.15]) == pytest.approx(0.63, abs=1e-12)
    # §3.1: the docs' example [0, .95, .05] -> 0.92 at two decimals; exactly 1 - 0.05 / (2/3) = 0.925
    assert typesafe_score_confidence([0.0, 0.95, 0.05]) == pytest.approx(0.925, abs=1e-12)
    # §3.1: for three options the docs state (3 * largest - 1) / 2
    for top in (1 / 3, 0.5, 0.9, 1.0):
        rest = (1 - top) / 2
        assert typesafe_choice_confidence([rest, top, rest]) == pytest.approx((3 * top - 1) / 2, abs=1e-12)


def test_edges() -> None:
    assert typesafe_choice_confidence([1.0]) == typesafe_score_confidence([1.0]) == 1.0
    assert typesafe_choice_confidence([0.25] * 4) == pytest.approx(0.0, abs=1e-12)
    assert typesafe_choice_confidence([0.0, 0.0, 0.0]) == 0.0  # all zero: uniform
    assert typesafe_score_confidence([0.0, 0.0]) == 0.0
    assert typesafe_score_confidence([0.0, 0.0, 1.0]) == 1.0
    assert typesafe_score_confidence([0.5, 0.0, 0.0, 0.0, 0.5]) == 0.0  # spread beyond uniform: clamped
    assert typesafe_choice_confidence([2.0, 1.0, 1.0]) == pytest.approx(typesafe_choice_confidence(
        [0.5, 0.25, 0.25]))  # renormalised first
    assert confidence("choice", [0.2, 0.7, 0.1]) == 0.7  # clef: the top probability
    with pytest.raises(ValueError):
        confidence("noul", [0.5, 0.5], "typesafe")
    with pytest.raises(ValueError):
        confidence("choice", [0.5, 0.5], "entropy")


@pytest.mark.parametrize("seed", range(4))
def test_random_vectors_match_the_independent_implementation(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(500):
        n = int(rng.integers(1, 11)) if rng.random() < 0.7 else int(rng.integers(11, 256))
        p = rng.dirichlet(np.full(n, rng.choice([0.05, 0.5, 1.0, 5.0]))).astype(np.float32).astype(float)
        if rng.random() < 0.1:
            p[rng.integers(n)] = p.max()  # a tie at the top
        if rng.random() < 0.1:
            p = p * rng.uniform(0.5, 2.0)  # not normalised
        assert typesafe_choice_confidence(list(p)) == pytest.approx(independent_choice(p), abs=1e-9)
        if n <= 10:
            assert typesafe_score_confidence(list(p)) == pytest.approx(independent_score(p), abs=1e-9)


# ---- through the server -----------------------------------------------------------------------------

def _client(release, mode: str) -> TestClient:
    from clefserve.formats.clef import ClefDecider
    from clefserve.formats.clef.engine_backend import EngineBackend

    config = EngineConfig(kv_cache_mb=16, prefill_chunk_size=512, raw_probabilities=True, confidence=mode)
    backend = EngineBackend(ClefDecider(release, confidence=mode), config, "clef-conf")
    return TestClient(create_app(backend, config))


@pytest.fixture(scope="module")
def clients(make_release) -> Iterator[dict[str, TestClient]]:
    release = make_release(seed=9)
    with _client(release, "clef") as clef, _client(release, "typesafe") as typesafe:
        yield {"clef": clef, "typesafe": typesafe}


def test_served_confidence_follows_the_flag(clients: dict[str, TestClient]) -> None:
    checked = 0
    for request in RequestGenerator(seed=12).requests(12, max_questions=5):
        request = api_valid(request)
        answers = {mode: client.post("/v1/systemone", json=request).json()["answers"]
                   for mode, client in clients.items()}
        for qid, question in request["questions"].items():
            clef, typesafe = answers["clef"][qid], answers["typesafe"][qid]
            raw = clef["x_probabilities"]
            assert typesafe["x_probabilities"] == raw  # the flag changes nothing but confidence
            if question["type"] == "noul":
                assert "confidence" not in clef and "confidence" not in typesafe
                continue
            options = list(question["criteria"]) if question["type"] == "choice" else \
                [str(i) for i in range(len(question["criteria"]))]
            p = np.array([raw[o] for o in options])
            independent = independent_choice(p) if question["type"] == "choice" else independent_score(p)
            assert typesafe["confidence"] == pytest.approx(round(independent, 4), abs=1e-4 + 1e-12)
            assert clef["confidence"] == round(max(raw.values()), 4)
            assert {k: v for k, v in typesafe.items() if k != "confidence"} == \
                {k: v for k, v in clef.items() if k != "confidence"}
            checked += 1
    assert checked >= 15


@pytest.mark.parametrize("mode", ["clef", "typesafe"])
def test_openapi_and_model_cards_say_which_confidence(clients: dict[str, TestClient], mode: str) -> None:
    client = clients[mode]
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for answer in ("ChoiceAnswer", "ScoreAnswer"):
        assert f"--confidence {mode}" in schemas[answer]["properties"]["confidence"]["description"]
    [card] = client.get("/v1/models").json()["models"]
    assert card["x_confidence"] == mode and card["x_question_ids"] == "prompt"
