"""The self-check's canaries are sized in tokens from the engine's configuration, and what the engine did
with them (chunk splits, cache resumes, batched steps) is read back and logged."""

from __future__ import annotations

import logging
import re

import pytest

from clefserve.config import EngineConfig
from clefserve.formats.clef import ClefDecider
from clefserve.formats.clef.canary import LONG_MARGIN_TOKENS, build_canaries, coverage
from clefserve.formats.clef.engine_backend import EngineBackend


@pytest.fixture(scope="module")
def decider(make_release) -> ClefDecider:
    return ClefDecider(make_release(seed=21))


@pytest.mark.parametrize("chunk", [64, 300, 1024, 4096])
def test_the_long_state_exceeds_one_chunk_by_the_margin_and_no_more(decider: ClefDecider, chunk: int) -> None:
    canaries, splits = build_canaries(decider.encode, chunk, 16384)
    long = canaries[0]
    assert splits
    # a few tokens over at most: the history is cut character by character
    assert chunk + LONG_MARGIN_TOKENS <= long.state_tokens <= chunk + LONG_MARGIN_TOKENS + 3
    assert long.record.input_ids == decider.encode(long.request).input_ids


def test_every_question_type_and_a_shared_state(decider: ClefDecider) -> None:
    canaries, _ = build_canaries(decider.encode, 256, 16384)
    assert [c.name for c in canaries] == ["long", "shared-a", "shared-b"]
    types = {q["type"] for c in canaries for q in c.request["questions"].values()}
    assert types == {"noul", "choice", "score"}
    a, b = canaries[1].record, canaries[2].record
    assert a.input_ids[: a.state_end] == b.input_ids[: b.state_end]  # the shared state
    assert a.input_ids[a.state_end:] != b.input_ids[b.state_end:]  # other questions after it
    assert a.state_end - a.prefix_end > 0


def test_records_that_cannot_exceed_a_chunk_get_a_short_long_canary(decider: ClefDecider) -> None:
    canaries, splits = build_canaries(decider.encode, 4096, 2000)  # --max-length below the chunk
    assert not splits
    assert canaries[0].state_tokens == 4 * LONG_MARGIN_TOKENS
    assert canaries[0].tokens <= 2000


def canaries_fixed_tokens(decider: ClefDecider) -> int:
    long = build_canaries(decider.encode, 64, 16384)[0][0]
    return long.tokens - long.state_tokens


def test_a_small_kv_pool_bounds_the_long_canary(decider: ClefDecider) -> None:
    """The encoder cuts states to --max-length only; a KV pool below it must not get a record it refuses."""
    schema_and_prefix = canaries_fixed_tokens(decider)
    limit = schema_and_prefix + 1024 + LONG_MARGIN_TOKENS // 2  # room for a state of one chunk and a bit
    canaries, splits = build_canaries(decider.encode, 1024, limit)
    assert splits and canaries[0].tokens <= limit
    assert 1024 < canaries[0].state_tokens <= limit - schema_and_prefix


def _run_check(decider: ClefDecider, caplog, **config) -> str:
    backend = EngineBackend(decider, EngineConfig(kv_cache_mb=16, **config), "clef-test")
    try:
        with caplog.at_level(logging.INFO, logger="clefserve"):
            assert backend.run_self_check() == []
        return caplog.text
    finally:
        assert backend.engine is not None
        backend.engine.shutdown()


def test_progress_and_coverage_are_logged(decider: ClefDecider, caplog) -> None:
    text = _run_check(decider, caplog, prefill_chunk_size=200)
    assert re.search(r"startup self-check: 3 canaries of [\d,]+ \+ [\d,]+ \+ [\d,]+ tokens", text)
    for i, name in enumerate(("long", "shared-a", "shared-b"), 1):
        assert re.search(rf"canary {i} of 3 \({name}\), serving path: \d+ tokens "
                         r"\(\d+ from the prefix cache\) after [\d.]+ s", text)
        assert re.search(rf"canary {i} of 3 \({name}\), reference path: \d+ tokens in [\d.]+ s", text)
    passed = re.search(r"startup self-check passed .* in [\d.]+ s \(serving path [\d.]+ s, reference "
                       r"path [\d.]+ s\): long canary in (\d+) chunks \[([\d, ]+)\] \(split inside its state",
                       text)
    assert passed, text
    chunks = [int(n) for n in passed.group(2).split(", ")]
    # state pieces cut where a step's budget of 200 ran out (the scheduler shares steps with the shorter
    # canaries, so a piece may be below 200; the fixed prefix's snapshot is kept inside the first), the schema
    assert len(chunks) == int(passed.group(1)) >= 3 and max(chunks) <= 200
    assert "shared state resumed from the prefix cache" in text
    assert "WARNING" not in text


def test_without_the_prefix_cache_the_log_says_what_was_not_checked(decider: ClefDecider, caplog) -> None:
    text = _run_check(decider, caplog, prefill_chunk_size=200, prefix_cache=False)
    assert "shared state NOT resumed" in text
    assert "no canary resumed a shared state from the prefix cache (--no-prefix-cache)" in text


def test_a_piece_that_ends_inside_the_long_state_counts_as_a_budget_split(decider: ClefDecider) -> None:
    """Whether or not its step used the whole budget: the scheduler may end a cut on a delta-rule chunk
    boundary and leave the rest of the budget unused (the demo model's canary at chunk 1024 runs so)."""
    canaries, _ = build_canaries(decider.encode, 1024, 16384)
    long, record = canaries[0], canaries[0].record
    fresh = long.tokens - record.prefix_end
    served = [{"usage": {"x_cached_tokens": record.prefix_end}}, {"usage": {}},
              {"usage": {"x_cached_tokens": canaries[2].record.state_end}}]
    inside = 64 * (record.prefix_end // 64 + 2) - record.prefix_end  # ends on a chunk boundary in the state
    steps = [((7, inside), (8, 100)), ((7, fresh - inside),)]  # neither step is full
    covered = coverage(canaries, served, steps)
    assert covered.long_chunks == [inside, fresh - inside] and covered.budget_split
    at_the_end = coverage(canaries, served, [((7, record.state_end - record.prefix_end),),
                                             ((7, long.tokens - record.state_end),)])
    assert not at_the_end.budget_split  # cut only at the state's end (a snapshot point)
