"""Answers from probabilities against the reference ``systemone_answer``, ties and rounding included."""

from __future__ import annotations

import json
import random

import pytest
import torch

from clefserve.formats.clef import (
    EncodedQuestion,
    EncodedRecord,
    answer_question,
    build_response,
    probabilities,
)
from clefserve.formats.clef.encoder import question_options
from tests.oracles import jsm
from tests.request_gen import RequestGenerator


def same_json(a: dict, b: dict) -> bool:
    """Equal values and equal key order everywhere."""
    return json.dumps(a, ensure_ascii=False) == json.dumps(b, ensure_ascii=False)


def reference_answer(question: dict, option_ids: list[str], probs: list[float]) -> dict:
    return jsm().systemone_answer(question, dict(zip(option_ids, probs, strict=True)))


def tie_vectors(rng: random.Random, count: int) -> list[list[float]]:
    """Probability vectors with exact ties, round-half values and extremes."""
    out = [[1.0 / count] * count, [0.0] * (count - 1) + [1.0], [1.0] + [0.0] * (count - 1)]
    if count >= 2:
        top = rng.randrange(count)
        rest = rng.sample([i for i in range(count) if i != top], 1)[0]
        probs = [0.1 / count] * count
        probs[top] = probs[rest] = 0.4
        out.append(probs)
        out.append([0.00005, 0.99995] + [0.0] * (count - 2))
        out.append([0.12345, 0.87655] + [0.0] * (count - 2))
    return out


def random_vectors(rng: random.Random, count: int) -> list[list[float]]:
    logits = torch.tensor([rng.gauss(0, rng.choice((0.1, 1.0, 5.0))) for _ in range(count)])
    return [logits.float().softmax(-1).tolist()]


def test_matches_reference_answers() -> None:
    rng = random.Random(0)
    gen = RequestGenerator(seed=1)
    compared = ties = 0
    for _ in range(300):
        for question in gen.request(max_questions=4)["questions"].values():
            option_ids = [option_id for option_id, _ in question_options("q", question)]
            vectors = random_vectors(rng, len(option_ids)) + tie_vectors(rng, len(option_ids))
            for probs in vectors:
                rng.shuffle(probs)
                ours = answer_question(question, option_ids, probs)
                assert same_json(ours, reference_answer(question, option_ids, probs)), (question, probs)
                compared += 1
                ties += len(set(probs)) < len(probs)
    assert compared > 2000 and ties > 500


def test_choice_ties_go_to_the_earlier_label_in_request_order() -> None:
    question = {"type": "choice", "criteria": {"zeta": None, "alpha": None, "mid": None}}
    option_ids = ["alpha", "mid", "zeta"]  # the head's (sorted) order
    answer = answer_question(question, option_ids, [0.4, 0.2, 0.4])
    assert answer["choice"] == "zeta"  # first in the request, although last in the head's order
    assert list(answer["probabilities"]) == ["zeta", "alpha", "mid"]
    assert answer == reference_answer(question, option_ids, [0.4, 0.2, 0.4])


def test_answer_shapes() -> None:
    noul = answer_question({"type": "noul"}, ["true", "false"], [0.123456, 0.876544])
    assert same_json(noul, {"type": "noul", "noul": 0.1235})
    levels = [{"text": "low"}, None, "high"]
    score = answer_question({"type": "score", "criteria": levels}, ["0", "1", "2"], [0.2, 0.3, 0.5])
    assert list(score) == ["type", "score", "confidence", "legend", "probabilities"]
    assert score["score"] == round(0.3 + 2 * 0.5, 4) and score["confidence"] == 0.5
    assert score["legend"] == {"0": {"text": "low"}, "1": None, "2": "high"}
    choice = answer_question({"type": "choice", "criteria": {"b": 1, "a": 2}}, ["a", "b"], [0.7, 0.3])
    assert list(choice) == ["type", "choice", "confidence", "probabilities"]
    with pytest.raises(FloatingPointError):
        answer_question({"type": "noul"}, ["true", "false"], [float("nan"), float("nan")])


def test_probabilities_are_the_float32_softmax_per_question() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = [torch.randn(k, generator=gen, dtype=torch.float64) * 3 for k in (2, 5, 1, 3)]
    got = probabilities(logits)
    for g, q in zip(got, logits, strict=True):
        assert g == q.float().softmax(-1).tolist()  # bit-equal to the reference's float32 softmax
    bf16 = [q.to(torch.bfloat16) for q in logits]
    assert probabilities(bf16)[1] == bf16[1].float().softmax(-1).tolist()


def test_build_response() -> None:
    request = {
        "model": "@cf/cloudflare/clef-flash",
        "state": "s",
        "questions": {
            "zz": {"type": "score", "criteria": ["a", "b"]},
            "aa": {"type": "choice", "criteria": {"y": None, "x": None}},
            "mm": {"type": "noul"},
        },
    }
    spans = ((0, 1), (1, 2))
    record = EncodedRecord(
        input_ids=tuple(range(40)),
        questions=(
            EncodedQuestion("zz", "score", 2, (0, 1), spans, ("0", "1")),
            EncodedQuestion("aa", "choice", 1, (0, 1), spans, ("x", "y")),
            EncodedQuestion("mm", "noul", 0, (0, 1), spans, ("true", "false")),
        ),
        prefix_end=10,
        state_end=12,
    )
    logits = [torch.tensor([0.0, 1.0]), torch.tensor([2.0, 0.0]), torch.tensor([0.5, -0.5])]
    response = build_response(request, record, logits)
    assert list(response) == ["model", "answers", "usage"]
    assert response["model"] == "@cf/cloudflare/clef-flash"
    assert list(response["answers"]) == ["zz", "aa", "mm"]
    assert response["usage"] == {"input_tokens": 40, "output_tokens": 0}
    assert response["answers"]["aa"]["choice"] == "x"
    assert list(response["answers"]["aa"]["probabilities"]) == ["y", "x"]
    probs = probabilities(logits)
    questions = request["questions"].items()
    for (qid, question), q_probs, encoded in zip(questions, probs, record.questions, strict=True):
        expected = reference_answer(question, list(encoded.option_ids), q_probs)
        assert same_json(response["answers"][qid], expected)
