"""The encoded form of one Clef record: token ids plus the spans and boundaries the head and cache read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from clefserve.vision.positions import ImageSpan, mrope_positions

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
class RecordImage:
    """One picture of a record: its ``<|image_pad|>`` span, patch grid and pixel digest."""

    span: ImageSpan
    digest: str


@dataclass(frozen=True)
class EncodedRecord:
    input_ids: tuple[int, ...]
    questions: tuple[EncodedQuestion, ...]
    # Segment boundaries: PREFIX is ids[:prefix_end], then the MEDIA placeholders (one
    # <|vision_start|><|image_pad|>...<|vision_end|> per picture and a newline) up to media_end, the kept
    # STATE up to state_end, then SCHEMA and SUFFIX. Without pictures media_end == prefix_end.
    prefix_end: int
    state_end: int
    media_end: int | None = None
    images: tuple[RecordImage, ...] = ()
    # the pictures' prepared pixels (clefserve.vision.inputs.PreparedImage), for the vision tower
    prepared_images: tuple = field(default=(), compare=False, repr=False)

    @property
    def num_options(self) -> int:
        return sum(len(q.option_ids) for q in self.questions)

    @property
    def resume_points(self) -> tuple[int, ...]:
        """Where the prefix cache keeps a resume point: after the fixed prefix, after the pictures (the same
        pictures with another state), after the state (the same state asked other questions) unless it is
        shorter than ``MIN_STATE_SNAPSHOT_TOKENS``, and the whole record (an identical request)."""
        pictures = (self.state_start,) if self.state_start != self.prefix_end else ()
        state = (self.state_end,) if self.state_end - self.state_start >= MIN_STATE_SNAPSHOT_TOKENS else ()
        return (self.prefix_end, *pictures, *state, len(self.input_ids))

    @property
    def state_start(self) -> int:
        return self.prefix_end if self.media_end is None else self.media_end

    def positions(self) -> torch.Tensor | None:
        """M-RoPE positions ``[3, len]`` of a record with pictures; None for text (positions = indexes)."""
        if not self.images:
            return None
        return mrope_positions(len(self.input_ids), [image.span for image in self.images])

    def cache_keys(self) -> list:
        """The record's tokens as the prefix cache compares them: each ``<|image_pad|>`` token replaced by
        (its picture's digest, its index in the picture), so two records with different pictures differ
        from the first picture token on, whatever their token ids."""
        keys: list = list(self.input_ids)
        for image in self.images:
            start = image.span.start
            for i in range(image.span.length):
                keys[start + i] = (image.digest, i)
        return keys
