"""Non-finite hidden rows never become an answer: the request fails with a 500 that says so, /metrics counts
it, and the other records of the same steps still get their answers.

NaN is injected into one token's embedding row: every record holding that token gets NaN hidden rows from
there on (as an f16 overflow or a broken kernel would give), the others stay finite.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from fastapi.testclient import TestClient

from clefserve.errors import NonFiniteError, all_finite
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.engine_backend import EngineBackend
from clefserve.server import create_app
from clefserve.testing.release import ReleaseSpec
from tests.engine_support import small_config
from tests.test_observability import samples

QUESTIONS = {"spam": {"type": "noul", "instructions": "Is it spam?"},
             "team": {"type": "choice", "criteria": {"billing": None, "technical": None}}}
HEALTHY = {"model": "m", "state": {"message": "please refund order one"}, "questions": QUESTIONS}
POISONED = {"model": "m", "state": {"message": "zqzqzq xkcd"}, "questions": QUESTIONS}


@pytest.fixture(scope="module")
def decider(make_release) -> ClefDecider:
    decider = ClefDecider(make_release(ReleaseSpec(), seed=4), max_length=400)
    healthy = set(decider.encode(HEALTHY).input_ids)
    poisoned = [t for t in decider.encode(POISONED).input_ids if t not in healthy]
    assert poisoned, "the poisoned request needs a token the healthy one lacks"
    with torch.no_grad():
        decider.backbone.embed_tokens.weight[poisoned[0]] = float("nan")
    return decider


def test_nan_hidden_rows_are_a_500_that_says_so_and_are_counted(decider):
    backend = EngineBackend(decider, small_config(max_num_seqs=4, prefill_chunk_size=64), "m")
    try:
        with TestClient(create_app(backend, backend.config), raise_server_exceptions=False) as client:
            requests = [HEALTHY, POISONED, HEALTHY, POISONED, HEALTHY]
            with ThreadPoolExecutor(5) as pool:  # at once, so healthy and poisoned records share steps
                responses = list(pool.map(lambda body: client.post("/v1/systemone", json=body), requests))
            for body, response in zip(requests, responses, strict=True):
                if body is HEALTHY:
                    assert response.status_code == 200, response.text
                    answer = response.json()["answers"]["spam"]["noul"]
                    assert 0.0 <= answer <= 1.0
                else:
                    assert response.status_code == 500
                    detail = response.json()["detail"]
                    assert detail["error_type"] == "non_finite_output"
                    assert "non-finite values (NaN or Inf) in the hidden states" in detail["message"]
            metrics = samples(client)
            assert metrics["clef_nonfinite_outputs_total"] == 2
            assert metrics['clef_request_errors_total{error_type="non_finite_output"}'] == 2
            assert metrics['clef_http_requests_total{method="POST",route="/v1/systemone",status="500"}'] == 2
    finally:
        assert backend.engine is not None
        backend.engine.shutdown()


def test_the_reference_path_refuses_nan_too(decider):
    with pytest.raises(NonFiniteError, match="hidden states"):
        decider.decide_batch([POISONED])
    assert decider.decide_batch([HEALTHY])[0]["answers"]["spam"]["type"] == "noul"


def test_nan_logits_are_refused(decider, monkeypatch):
    backend = EngineBackend(decider, small_config(), "m")
    try:
        real = decider.logits

        def nan_logits(hiddens, records):
            return [[q * float("nan") for q in record] for record in real(hiddens, records)]

        monkeypatch.setattr(decider, "logits", nan_logits)
        record = decider.encode(HEALTHY)
        future = backend._submit(backend.engine, HEALTHY, record, raw=False)
        with pytest.raises(NonFiniteError, match="logits"):
            future.result(timeout=60)
        assert backend.stats()["nonfinite_outputs"] == 1
    finally:
        backend.engine.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finiteness_check_is_exact_where_a_sum_would_overflow_or_hide_nothing(dtype):
    big = torch.finfo(dtype).max
    assert all_finite([torch.randn(300, 64).to(dtype), torch.empty(0, dtype=dtype), torch.arange(5)])
    assert all_finite([torch.full((4, 3), big, dtype=dtype)])  # finite values whose sum overflows
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in ((0, 0), (299, 63), (150, 17)):
            x = torch.randn(300, 64).to(dtype)
            x[where] = bad
            assert not all_finite([torch.ones(3, dtype=dtype), x])
    mixed = torch.tensor([big, -big, float("inf")], dtype=dtype)  # sum is NaN, one element is infinite
    assert not all_finite([mixed])
