"""Batch invariance through a real server process: answers do not depend on what a request was batched with.

40 requests of mixed lengths (tiny ones and ones several times --prefill-chunk-size) are sent at once and
then one at a time to the same clef-serve process; unrounded probabilities (``--x-raw-probabilities``)
must agree within 1e-5 (fp32) and choices must be identical. The prefix cache is off here: it would serve
the second pass from the first one's rows (tests/test_prefix_cache.py checks cached against cold answers).
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from clefserve.testing.server_process import ServerProcess
from clefserve.testing.tokenizer import WORDS

CHUNK = 320
TOLERANCE = 1e-5


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(low, high)))


def question(rng: random.Random, kind: str) -> dict:
    if kind == "noul":
        return {"type": "noul", "instructions": words(rng, 3, 9)}
    if kind == "choice":
        labels = rng.sample(WORDS, rng.randint(2, 6))
        return {"type": "choice", "instructions": words(rng, 3, 9),
                "criteria": {label: rng.choice([None, words(rng, 1, 5)]) for label in labels}}
    return {"type": "score", "instructions": {"ask": words(rng, 2, 6)},
            "criteria": [words(rng, 1, 4) for _ in range(rng.randint(2, 5))]}


def mixed_requests(count: int, seed: int) -> list[dict]:
    """Tiny states, medium ones and ones several times the chunk size; 1-4 questions of all types."""
    rng = random.Random(seed)
    sizes = [(1, 3), (20, 80), (600, 1200)]
    return [
        {
            "model": "clef",
            "state": {"ticket": rng.randint(1, 9999), "message": words(rng, *sizes[i % 3])},
            "questions": {f"q{j}": question(rng, rng.choice(["noul", "choice", "score"]))
                          for j in range(rng.randint(1, 4))},
        }
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def server(make_release, tmp_path_factory):
    flags = ["--dtype", "f32", "--max-num-seqs", "4", "--prefill-chunk-size", str(CHUNK),
             "--block-size", "16", "--kv-cache-mb", "64", "--x-raw-probabilities", "--no-prefix-cache"]
    log = tmp_path_factory.mktemp("invariance") / "server.log"
    with ServerProcess(make_release(seed=21), log, *flags, threads=1) as srv:
        yield srv


def ask(client: httpx.Client, request: dict) -> dict:
    response = client.post("/v1/systemone", json=request)
    assert response.status_code == 200, response.text
    return response.json()


def test_concurrent_answers_equal_one_at_a_time(server) -> None:
    requests = mixed_requests(40, seed=5)
    with httpx.Client(base_url=server.url, timeout=300) as client:
        with ThreadPoolExecutor(40) as pool:
            together = list(pool.map(lambda r: ask(client, r), requests))
        alone = [ask(client, r) for r in requests]
    lengths = [a["usage"]["input_tokens"] for a in alone]
    assert max(lengths) > 4 * CHUNK and min(lengths) < CHUNK
    worst = 0.0
    for one, many in zip(alone, together, strict=True):
        assert one["usage"] == many["usage"]
        assert one["answers"].keys() == many["answers"].keys()
        for qid, answer in one["answers"].items():
            other = many["answers"][qid]
            assert answer.get("choice") == other.get("choice"), qid
            for option, p in answer["x_probabilities"].items():
                worst = max(worst, abs(p - other["x_probabilities"][option]))
    assert worst <= TOLERANCE


def test_raw_probabilities_agree_with_the_rounded_answer(server) -> None:
    request = mixed_requests(1, seed=9)[0]
    with httpx.Client(base_url=server.url, timeout=300) as client:
        body = ask(client, request)
    for answer in body["answers"].values():
        raw = answer["x_probabilities"]
        assert abs(sum(raw.values()) - 1.0) < 1e-5
        if answer["type"] == "noul":
            assert answer["noul"] == round(raw["true"], 4)
        else:
            assert answer["probabilities"] == {k: round(raw[k], 4) for k in answer["probabilities"]}


def test_log_states_the_pool_sizes(server) -> None:
    text = Path(server.log).read_text()
    assert "KV pool" in text and "GDN" in text, text[-2000:]
