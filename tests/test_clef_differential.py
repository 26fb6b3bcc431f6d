"""End to end: ``ClefDecider.decide_batch`` against the reference ``systemone`` on random releases."""

from __future__ import annotations

import pytest
import torch

from clefserve.errors import RequestError
from clefserve.formats.clef import ClefDecider
from clefserve.testing.release import ReleaseSpec
from tests import device as test_device
from tests.compare import assert_same_response
from tests.oracles import jsm, reference_clef
from tests.request_gen import RequestGenerator

REQUESTS_PER_RELEASE = 50
BATCH = 8
CASES = {
    "default": (ReleaseSpec(), 0, 1200),
    "2heads-1route-3layers": (
        ReleaseSpec(
            hidden_size=48,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            num_hidden_layers=3,
            tokenizer_vocab=800,
            head={"hidden_size": 48, "width": 16, "routing_layers": 1, "layers": 3, "heads": 2,
                  "feedforward": 48},
        ),
        1,
        900,
    ),
    # Qwen3.5's real tokenizer: NFC, its pre-tokenizer pattern and special tokens, ~3.6x fewer tokens
    "qwen3.5-tokenizer": (ReleaseSpec(tokenizer="qwen3.5"), 5, 600),
    "causal-lm-4heads": (
        ReleaseSpec(
            conditional_generation=False,
            head={"hidden_size": 64, "width": 32, "routing_layers": 2, "layers": 1, "heads": 4,
                  "feedforward": 32},
        ),
        2,
        700,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_decide_batch_matches_reference_systemone(make_release, monkeypatch, case: str) -> None:
    spec, seed, max_length = CASES[case]
    folder = make_release(spec, seed=seed)
    dtype, device = test_device.dtype(), test_device.device()
    decider = ClefDecider(folder, dtype, device, max_length=max_length)
    ref = jsm()
    model, processor = reference_clef(folder, dtype)
    model = model.to(device)

    # The reference's unrounded probabilities, captured where systemone hands them to systemone_answer.
    ref_probs: dict[str, dict[str, float]] = {}

    def capture_answer(question, probabilities):
        ref_probs[id(question)] = dict(probabilities)
        return original_answer(question, probabilities)

    original_answer = ref.systemone_answer
    monkeypatch.setattr(ref, "systemone_answer", capture_answer)

    # Our raw logits, captured where decide_batch hands them to answer().
    our_logits: list = []
    original_build = decider.answer

    def capture_logits(request, record, logits, *args, **kwargs):
        our_logits.append([q.detach().float().clone() for q in logits])
        return original_build(request, record, logits, *args, **kwargs)

    decider.answer = capture_logits

    generator = RequestGenerator(seed=1000 + seed)
    accepted: list[tuple[dict, dict, dict]] = []
    refused = truncated = 0
    while len(accepted) < REQUESTS_PER_RELEASE:
        request = generator.request(long_state=len(accepted) % 10 == 3 or None)
        ref_probs.clear()
        try:
            expected = ref.systemone(model, processor, request, max_length=max_length)
        except ValueError as exc:  # schema longer than max_length: we must refuse it the same way
            with pytest.raises(RequestError) as err:
                decider.encode(request)
            assert err.value.message == str(exc) and err.value.error_type == "tokens_exceeded"
            refused += 1
            continue
        probs = {qid: ref_probs[id(q)] for qid, q in request["questions"].items()}
        accepted.append((request, expected, probs))
        truncated += expected["usage"]["input_tokens"] == max_length

    responses = []
    for start in range(0, len(accepted), BATCH):
        responses += decider.decide_batch([request for request, _, _ in accepted[start : start + BATCH]])

    flips = compared = 0
    worst = 0.0
    exact = dtype == torch.float32  # f16/bf16: probabilities within the dtype's tolerance, no JSON compare
    for (request, expected, probs), ours, logits in zip(accepted, responses, our_logits, strict=True):
        assert ours["usage"] == expected["usage"]
        if exact:
            report = assert_same_response(ours, expected, request, probs, tolerance=2e-4, margin=1e-5)
            flips += len(report.boundary_flips)
            compared += report.compared
        record = decider.encode(request)
        for question, q_logits in zip(record.questions, logits, strict=True):
            ours_p = q_logits.softmax(-1).tolist()
            ref_p = [probs[question.question_id][o] for o in question.option_ids]
            worst = max(worst, max(abs(a - b) for a, b in zip(ours_p, ref_p, strict=True)))
    assert worst <= test_device.tolerance(2e-4), worst
    assert truncated >= 3, truncated
    assert not exact or (compared > 200 and flips <= compared // 100), (flips, compared)
    print(f"{case}: {len(accepted)} requests, {refused} refused, {truncated} truncated, "
          f"{compared} values, {flips} boundary flips, max |dp| {worst:.2e}")


@pytest.mark.slow
def test_decide_batch_equals_one_by_one(make_release) -> None:
    spec, seed, max_length = CASES["default"]
    decider = ClefDecider(make_release(spec, seed=seed), test_device.dtype(), test_device.device(),
                          max_length=max_length)
    requests = RequestGenerator(seed=77).requests(12, max_questions=4)
    batched = decider.decide_batch(requests)
    for request, answer in zip(requests, batched, strict=True):
        alone = decider.decide_batch([request])[0]
        assert alone["usage"] == answer["usage"]
        tolerance = test_device.tolerance(2e-4)
        margin = 1e-5 if tolerance == 2e-4 else tolerance  # f16/bf16: any difference within the tolerance
        report = assert_same_response(alone, answer, request, _probs_of(decider, request), tolerance, margin)
        assert len(report.boundary_flips) <= 1 or tolerance > 2e-4
    assert decider.decide_batch([]) == []


def _probs_of(decider: ClefDecider, request: dict) -> dict[str, dict[str, float]]:
    record = decider.encode(request)
    with torch.inference_mode():
        hidden = decider.backbone.run_sequence(torch.tensor(record.input_ids))[0]
        logits = decider.logits([hidden], [record])[0]
    return {
        q.question_id: dict(zip(q.option_ids, ql.float().softmax(-1).tolist(), strict=True))
        for q, ql in zip(record.questions, logits, strict=True)
    }
