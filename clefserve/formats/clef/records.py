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
