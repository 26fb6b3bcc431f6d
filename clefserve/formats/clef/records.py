"""The encoded form of one Clef record: token ids plus the spans and boundaries the head and cache read."""

from __future__ import annotations

from dataclasses import dataclass

# Row of ``type_embedding`` for each question type (clef-format.md §5 step 9).
QUESTION_TYPES: dict[str, int] = {"noul": 0, "choice": 1, "score": 2}


@dataclass(frozen=True)
class EncodedQuestion:
    question_id: str
    type: str
    type_index: int
    # Half-open [start, end) positions in ``EncodedRecord.input_ids``.
    question_span: tuple[int, int]
    option_spans: tuple[tuple[int, int], ...]
    # Option ids in the order the head scores them (§3.2), parallel to ``option_spans``.
    option_ids: tuple[str, ...]


# A state shorter than this is cheaper to compute again than to end an engine step at: a step over a few
# tokens costs about what one over a hundred does (every weight is read once per step), and a request alone
# in the engine would pay that step on every record.
MIN_STATE_SNAPSHOT_TOKENS = 64


@dataclass(frozen=True)
class EncodedRecord:
    input_ids: tuple[int, ...]
    questions: tuple[EncodedQuestion, ...]
    # Segment boundaries: PREFIX is ids[:prefix_end], the kept STATE is ids[prefix_end:state_end],
    # then come SCHEMA and SUFFIX.
    prefix_end: int
    state_end: int

    @property
    def num_options(self) -> int:
        return sum(len(q.option_ids) for q in self.questions)

    @property
    def resume_points(self) -> tuple[int, ...]:
        """Where the prefix cache keeps a resume point: after the fixed prefix, after the state (the same
        state asked other questions) unless it is shorter than ``MIN_STATE_SNAPSHOT_TOKENS``, and the whole
        record (an identical request)."""
        state = (self.state_end,) if self.state_end - self.prefix_end >= MIN_STATE_SNAPSHOT_TOKENS else ()
        return (self.prefix_end, *state, len(self.input_ids))
