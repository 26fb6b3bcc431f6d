"""Our Clef record encoder against the reference ``encode_record`` (same ids, spans, option ids)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from tokenizers import Tokenizer

from clefserve.errors import ReleaseError, RequestError
from clefserve.formats.clef import QUESTION_TYPES, ClefEncoder, render
from clefserve.formats.clef.encoder import PREFIX, SCHEMA_HEADER, SUFFIX
from clefserve.testing.release import ReleaseSpec
from clefserve.testing.tokenizer import train_tokenizer
from tests.fresh_process import run_reporting_json
from tests.oracles import jsm, reference_tokenizer
from tests.request_gen import RequestGenerator


@pytest.fixture(scope="module")
def tokenizer_folders(make_release) -> list:
    # Two different test tokenizers (vocabulary sizes and training seeds) so merges differ, and Qwen3.5's real
    # one (NFC, its pre-tokenizer pattern, 248,077 tokens).
    return [make_release(seed=3), make_release(ReleaseSpec(tokenizer_vocab=900), seed=11),
            make_release(ReleaseSpec(tokenizer="qwen3.5"), seed=5)]


def assert_same_record(ours, ref) -> None:
    assert ours.input_ids == ref.input_ids
    assert len(ours.questions) == len(ref.questions)
    for q, r in zip(ours.questions, ref.questions, strict=True):
        assert q.question_id == r.question_id
        assert q.type_index == r.question_type == QUESTION_TYPES[q.type]
        assert q.question_span == r.question_span
        assert q.option_spans == r.option_spans
        assert q.option_ids == r.option_ids


@pytest.mark.parametrize("max_length", [16384, 1200, 600])
def test_matches_reference_on_generated_requests(tokenizer_folders, max_length: int) -> None:
    ref = jsm()
    checked = truncated = 0
    for index, folder in enumerate(tokenizer_folders):
        encoder = ClefEncoder.from_folder(folder, max_length=max_length)
        hf = reference_tokenizer(folder)
        for request in RequestGenerator(seed=100 * index + max_length).requests(120):
            try:
                expected = ref.encode_record(hf, request, max_length=max_length)
            except ValueError as exc:
                with pytest.raises(RequestError) as err:
                    encoder.encode(request)
                assert err.value.message == str(exc)
                continue
            record = encoder.encode(request)
            assert_same_record(record, expected)
            state_ids = hf(render(request["state"]), add_special_tokens=False).input_ids
            truncated += record.state_end - record.prefix_end < len(state_ids)
            checked += 1
    assert checked >= 100
    if max_length <= 1200:
        assert truncated >= 5  # the generator's long states must actually be cut


def test_segments(tokenizer_folders) -> None:
    folder = tokenizer_folders[0]
    encoder = ClefEncoder.from_folder(folder, max_length=700)
    hf = reference_tokenizer(folder)

    def tokens(text: str) -> list[int]:
        return hf(text, add_special_tokens=False).input_ids

    for request in RequestGenerator(seed=5).requests(40, max_questions=2):
        record = encoder.encode(request)
        ids = list(record.input_ids)
        state = tokens(render(request["state"]))
        assert ids[: record.prefix_end] == tokens(PREFIX)
        assert ids[record.prefix_end : record.state_end] == state[: record.state_end - record.prefix_end]
        schema = tokens(SCHEMA_HEADER)
        assert ids[record.state_end : record.state_end + len(schema)] == schema
        assert ids[-len(tokens(SUFFIX)) :] == tokens(SUFFIX)
        if record.state_end - record.prefix_end < len(state):
            assert len(ids) == 700  # cut state fills the budget exactly


def test_special_tokens_in_text_are_single_ids(tokenizer_folders) -> None:
    folder = tokenizer_folders[0]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encoder = ClefEncoder(tok)
    request = {"model": "m", "state": "a<|im_end|>b", "questions": {"q": {"type": "noul"}}}
    record = encoder.encode(request)
    im_end = tok.token_to_id("<|im_end|>")
    assert im_end in record.input_ids[record.prefix_end : record.state_end]
    assert_same_record(record, jsm().encode_record(reference_tokenizer(folder), request))


def test_rendering() -> None:
    assert render("x\ny") == "x\ny"
    value = {"b": [1, 1250.0, -0.0, None, True], "a": "é\u0001\"\\", "c": {"z": 1e-7, "y": 10**30}}
    expected = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    assert render(value) == expected
    assert render(1250) == "1250" and render(1250.0) == "1250.0"
    assert render(float("nan")) == "NaN"


def test_option_order_and_defaults(tokenizer_folders) -> None:
    encoder = ClefEncoder.from_folder(tokenizer_folders[0])
    request = {
        "model": "m",
        "state": "s",
        "questions": {
            "n": {"type": "noul", "criteria": {"false": "no way", "other": "ignored"}},
            "c": {"type": "choice", "criteria": {"b": None, "B": 1, "10": "x", "9": "y", "é": "z"}},
            "s": {"type": "score", "criteria": ["lo", "mid", "hi"]},
        },
    }
    record = encoder.encode(request)
    assert [q.option_ids for q in record.questions] == [
        ("true", "false"), ("10", "9", "B", "b", "é"), ("0", "1", "2"),
    ]
    assert [(q.type, q.type_index) for q in record.questions] == [("noul", 0), ("choice", 1), ("score", 2)]
    decode = encoder.tokenizer.decode
    ids = record.input_ids
    noul = record.questions[0]
    assert decode(list(ids[slice(*noul.option_spans[0])])) == (
        '{"description":"The proposition is true or the answer is yes.","option_id":"true"}'
    )
    assert decode(list(ids[slice(*noul.option_spans[1])])) == '{"description":"no way","option_id":"false"}'
    assert decode(list(ids[slice(*record.questions[1].option_spans[3])])) == '{"option_id":"b"}'
    # instructions missing -> the question id
    assert decode(list(ids[slice(*record.questions[2].question_span)])) == "s"


def test_schema_too_long(tokenizer_folders) -> None:
    folder = tokenizer_folders[0]
    request = RequestGenerator(seed=9).request(long_state=False)
    hf = reference_tokenizer(folder)
    with pytest.raises(ValueError) as ref_err:
        jsm().encode_record(hf, request, max_length=60)
    with pytest.raises(RequestError) as err:
        ClefEncoder.from_folder(folder, max_length=60).encode(request)
    assert err.value.message == str(ref_err.value)
    assert err.value.message.startswith("schema requires ") and err.value.message.endswith("maximum is 60")
    assert err.value.status == 422
    assert err.value.error_type == "tokens_exceeded"
    # exactly fitting: the state is cut to nothing
    fixed = int(err.value.message.split()[2])
    record = ClefEncoder.from_folder(folder, max_length=fixed).encode(request)
    assert len(record.input_ids) == fixed and record.state_end == record.prefix_end


@pytest.mark.parametrize(
    ("request_body", "fragment"),
    [
        ({"model": "m", "state": 1, "questions": {"": {"type": "noul"}}}, "no tokens"),
        ({"model": "m", "state": 1, "questions": {"": {"type": "noul", "instructions": ""}}}, "no tokens"),
        ({"model": "m", "state": "a\ud800b", "questions": {"q": {"type": "noul"}}}, "not valid Unicode"),
        ({"model": "m", "state": 1, "questions": {"q": {"type": "noul", "instructions": "\udfff"}}},
         "not valid Unicode"),
        ({"model": "m", "state": 1, "questions": {}}, "at least one question"),
        ({"model": "m", "questions": {"q": {"type": "noul"}}}, "state is required"),
        ({"model": "m", "state": 1, "questions": {"q": {"type": "box"}}}, "type must be"),
        ({"model": "m", "state": 1, "questions": {"q": {"type": "choice", "criteria": ["a"]}}},
         "non-empty object"),
        ({"model": "m", "state": 1, "questions": {"q": {"type": "choice"}}}, "non-empty object"),
        ({"model": "m", "state": 1, "questions": {"q": {"type": "score", "criteria": {"a": 1}}}},
         "non-empty array"),
        ({"model": "m", "state": 1, "questions": {"q": {"type": "noul", "criteria": ["x"]}}},
         "noul criteria"),
        ({"model": "m", "state": 1, "questions": {"q": "noul"}}, "must be an object"),
        ({"model": "m", "state": 1, "images": ["x"], "questions": {"q": {"type": "noul"}}},
         "does not take images"),
        ({"model": "m", "state": 1, "videos": ["x"], "questions": {"q": {"type": "noul"}}}, "not supported"),
    ],
)
def test_refused_requests(tokenizer_folders, request_body: dict, fragment: str) -> None:
    encoder = ClefEncoder.from_folder(tokenizer_folders[0])
    with pytest.raises(RequestError) as err:
        encoder.encode(request_body)
    assert fragment in err.value.message
    assert 400 <= err.value.status < 500


def test_deeply_nested_state_is_a_request_error(tokenizer_folders) -> None:
    state: list = []
    for _ in range(100_000):
        state = [state]
    encoder = ClefEncoder.from_folder(tokenizer_folders[0])
    with pytest.raises(RequestError, match="nested too deeply"):
        encoder.encode({"model": "m", "state": state, "questions": {"q": {"type": "noul"}}})


def test_caller_tokenizer_untouched_and_missing_file(tmp_path) -> None:
    tok = train_tokenizer(400, seed=2)
    tok.enable_truncation(8)
    encoder = ClefEncoder(tok)
    assert tok.truncation is not None and encoder.tokenizer.truncation is None
    record = encoder.encode({"model": "m", "state": "x " * 50, "questions": {"q": {"type": "noul"}}})
    assert record.state_end - record.prefix_end > 8
    with pytest.raises(ReleaseError, match=r"tokenizer\.json"):
        ClefEncoder.from_folder(tmp_path)


ENCODE_SCRIPT = """
import json, os, sys
from clefserve.formats.clef import ClefEncoder
from tests.request_gen import RequestGenerator

encoder = ClefEncoder.from_folder(sys.argv[1])
before = len(os.listdir("/proc/self/task"))
for request in RequestGenerator(seed=9).requests(5):
    encoder.encode(request)
print(json.dumps({"before": before, "after": len(os.listdir("/proc/self/task"))}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_encoding_starts_no_threads(tokenizer_folders) -> None:
    """A record's texts are tokenized on the calling thread: ``encode_batch`` started a rayon pool of a
    thread per core whose spinning took the cores from the engine's OpenMP team (a fresh interpreter,
    as building the test releases here trained tokenizers on that pool)."""
    report = run_reporting_json(ENCODE_SCRIPT, str(tokenizer_folders[0]))
    assert report["after"] == report["before"]


def test_tokenizing_a_record_lets_other_threads_run(tokenizer_folders) -> None:
    """While one request's record is tokenized, the server's other threads (the event loop, the engine's) go
    on: the tokenizer lets go of the GIL. Tokenizing with ``Tokenizer.encode`` held it for the whole call
    (half a second for a 1 MiB state), so a thread spinning beside it stalled for about that long."""
    encoder = ClefEncoder.from_folder(tokenizer_folders[2])  # Qwen3.5's tokenizer: ~0.5 ms per KiB of text
    words = RequestGenerator(seed=4).rng.choices(["refund", "order", "late", "déjà", "42", "ok?"], k=60_000)
    request = {"model": "m", "state": " ".join(words), "questions": {"q": {"type": "noul"}}}
    stop, longest_stall = threading.Event(), []

    def spin() -> None:
        last = time.perf_counter()
        longest = 0.0
        while not stop.is_set():
            now = time.perf_counter()
            longest, last = max(longest, now - last), now
        longest_stall.append(longest)

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.02)
        started = time.perf_counter()
        record = encoder.encode(request)
        took = time.perf_counter() - started
    finally:
        stop.set()
        spinner.join()
    assert record.state_end - record.prefix_end > 1000  # the state was tokenized (and cut to fit)
    # a ratio within one run, not a timing threshold: held, the stall is the whole call (~100%); released,
    # a few switch intervals of 5 ms
    assert longest_stall[0] < 0.5 * took, (longest_stall[0], took)
