"""Clef record encoding (clef-format.md §3): prompt pieces tokenized one by one, spans, state truncation.

Every piece is tokenized on its own (no special tokens added, special-token strings in the text parsed),
and the id lists are concatenated: PREFIX, STATE (cut to fit), SCHEMA, SUFFIX.
"""

from __future__ import annotations

import json
import os
from itertools import accumulate
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from clefserve.errors import ReleaseError, RequestError
from clefserve.formats.clef.records import QUESTION_TYPES, EncodedQuestion, EncodedRecord, RecordImage
from clefserve.vision.inputs import PreparedImage
from clefserve.vision.positions import ImageSpan

SYSTEM_PROMPT = (
    "Read the complete state and schema. Decide every field jointly. "
    "Each answer must be exactly one of that field's allowed options."
)
PREFIX = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nSTATE:\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
SCHEMA_HEADER = "\n\nSCHEMA FIELDS:\n"
OPTIONS_HEADER = "\nALLOWED OPTIONS:\n"
OPTION_END = "\n"
FIELD_END = "END FIELD\n"
# around each picture's <|image_pad|> tokens; after the last picture comes MEDIA_END
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
MEDIA_END = "\n"
NOUL_DEFAULTS = {
    "true": "The proposition is true or the answer is yes.",
    "false": "The proposition is false or the answer is no.",
}
DEFAULT_MAX_LENGTH = 16384
# --question-ids: "prompt" writes the client's question id into the record (Cloudflare's encoding, what the
# model was trained on); "opaque" writes a positional name instead (q1, q2, ...), so that ids never reach
# the model, as TypeSafe's contract says.
QUESTION_ID_MODES = ("prompt", "opaque")
# tokenizers runs encode_batch on a rayon pool of a thread per core unless this says otherwise (read at every
# call); the encoder sets it to false where the environment does not set it.
TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"
# "OPTION {j}: " ids are cached for the first labels only, so the cache stays bounded.
_OPTION_LABEL_CACHE = 256

Piece = str | tuple[int, ...]  # text still to tokenize, or ids already known


def render(value: Any, what: str = "value") -> str:
    """A string unchanged; any other JSON value as compact, key-sorted, non-ASCII-escaping JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    except RecursionError as exc:
        raise RequestError(f"{what} is nested too deeply to encode") from exc
    except (TypeError, ValueError) as exc:
        raise RequestError(f"{what} is not a JSON value: {exc}") from exc


def question_options(question_id: str, question: dict[str, Any]) -> list[tuple[str, Any]]:
    """(option id, description) pairs in the order the head scores them (§3.2)."""
    kind = question.get("type")
    criteria = question.get("criteria")
    if kind == "noul":
        overrides = criteria or {}
        if not isinstance(overrides, dict):
            raise RequestError(f"{question_id}: noul criteria must be an object with true/false keys")
        return [(key, overrides.get(key, default)) for key, default in NOUL_DEFAULTS.items()]
    if kind == "choice":
        if not isinstance(criteria, dict) or not criteria:
            raise RequestError(f"{question_id}: choice criteria must be a non-empty object")
        return sorted(((str(label), description) for label, description in criteria.items()),
                      key=lambda pair: pair[0])
    if kind == "score":
        if not isinstance(criteria, list) or not criteria:
            raise RequestError(f"{question_id}: score criteria must be a non-empty array")
        return [(str(level), description) for level, description in enumerate(criteria)]
    raise RequestError(f"{question_id}: type must be noul, choice, or score")


def _instructions(question_id: str, question: dict[str, Any], name: str) -> str:
    """The instruction text; missing, null or "" instructions fall back to the name the record shows."""
    instructions = question.get("instructions")
    if instructions is None or (isinstance(instructions, str) and instructions == ""):
        return name
    return render(instructions, f"{question_id}: instructions")


def positional_name(number: int) -> str:
    """The name ``--question-ids opaque`` writes for the ``number``-th question (1-based)."""
    return f"q{number}"


class ClefEncoder:
    def __init__(
        self, tokenizer: Tokenizer, max_length: int = DEFAULT_MAX_LENGTH, question_ids: str = "prompt"
    ) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        if question_ids not in QUESTION_ID_MODES:
            raise ValueError(f"question_ids must be one of {QUESTION_ID_MODES}, not {question_ids!r}")
        self.question_ids = question_ids
        os.environ.setdefault(TOKENIZERS_PARALLELISM, "false")  # see _tokenize
        # A private copy: we switch off truncation/padding (as transformers does per call)
        # without touching the caller's tokenizer.
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.max_length = max_length
        self._prefix = self._ids(PREFIX)
        self._suffix = self._ids(SUFFIX)
        self._schema_header = self._ids(SCHEMA_HEADER)
        self._options_header = self._ids(OPTIONS_HEADER)
        self._option_end = self._ids(OPTION_END)
        self._field_end = self._ids(FIELD_END)
        self._media_end = self._ids(MEDIA_END)
        self._option_labels: dict[int, tuple[int, ...]] = {}

    def vision_token_ids(self) -> tuple[int | None, int | None, int | None]:
        """Ids of <|vision_start|>, <|image_pad|>, <|vision_end|> (None where the tokenizer lacks one)."""
        ids = tuple(self.tokenizer.token_to_id(t) for t in (VISION_START, IMAGE_PAD, VISION_END))
        return ids  # type: ignore[return-value]

    def _media(self, images: list[PreparedImage], start: int) -> tuple[list[int], list[RecordImage]]:
        """The placeholders of ``images`` (as the reference's processor expands them) placed at ``start``."""
        vision_start, pad, vision_end = self.vision_token_ids()
        if vision_start is None or pad is None or vision_end is None:
            raise RequestError("this model's tokenizer has no vision tokens: images are not supported",
                               error_type="unsupported")
        ids: list[int] = []
        placed = []
        for image in images:
            ids.append(vision_start)
            span = ImageSpan(start + len(ids), image.patches.grid, image.merge_size)
            placed.append(RecordImage(span, image.digest))
            ids.extend([pad] * image.num_tokens)
            ids.append(vision_end)
        ids.extend(self._media_end)
        return ids, placed

    @classmethod
    def from_folder(
        cls, folder: str | Path, max_length: int = DEFAULT_MAX_LENGTH, question_ids: str = "prompt"
    ) -> ClefEncoder:
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise ReleaseError(f"{Path(folder)}: no tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception
            raise ReleaseError(f"{path}: not a readable tokenizers file ({exc})") from exc
        return cls(tokenizer, max_length, question_ids)

    def _ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _option_label(self, number: int) -> Piece:
        text = f"OPTION {number}: "
        if number > _OPTION_LABEL_CACHE:
            return text
        if number not in self._option_labels:
            self._option_labels[number] = self._ids(text)
        return self._option_labels[number]

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        """A record's texts in one ``encode_batch`` call, which lets go of the GIL while it works. ``encode``
        holds it for the whole call, and with it every other thread of the server: the event loop (probes,
        other requests) and the engine's, which dispatches its ops from Python. For Qwen3.5's tokenizer that
        is ~7 ms for a 3,000-token state and over half a second for a 1 MiB one.

        With ``TOKENIZERS_PARALLELISM`` false (set at construction where the environment leaves it unset)
        the batch runs on the calling thread. Otherwise it would go to a rayon pool of a thread per core,
        whose threads spin after the work on the engine's cores."""
        try:
            return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
        except TypeError:
            # tokenizers refuses str objects that are not valid Unicode (lone surrogates from JSON "\ud800").
            for text in texts:
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise RequestError(f"request text is not valid Unicode: {exc.reason}") from exc
            raise

    def _check_pad_text(self, input_ids: list[int], placed: list[RecordImage]) -> None:
        """With pictures, every <|image_pad|> token must be a picture's: the model puts the pictures' rows
        on all of them in order (the reference fails on such a record), so "<|image_pad|>" written in the
        state or a question is refused rather than given a picture's rows."""
        pad = self.vision_token_ids()[1]
        expected = sum(image.span.length for image in placed)
        if sum(1 for i in input_ids if i == pad) != expected:
            raise RequestError(f"the state or a question contains the text {IMAGE_PAD}, which a request "
                               "with images cannot hold (the model takes it for a picture's token)")

    def encode(self, request: dict[str, Any], images: list[PreparedImage] | None = None) -> EncodedRecord:
        """Encode a validated ``/v1/systemone`` body into ids, spans and segment ends; ``images``: the
        request's pictures, prepared (the caller decodes ``request["images"]``)."""
        questions = request.get("questions")
        if not isinstance(questions, dict) or not questions:
            raise RequestError("at least one question is required")
        if "state" not in request:
            raise RequestError("state is required")
        if request.get("videos"):
            raise RequestError("videos: video inputs are not supported by this server",
                               error_type="unsupported")
        if request.get("images") and not images:
            raise RequestError("images: this model does not take images (its release has no vision tower)",
                               error_type="unsupported")

        pieces: list[Piece] = [render(request["state"], "state"), self._schema_header]
        # Per question: (id, type, index of the instruction piece, option ids, indexes of the option pieces).
        layout: list[tuple[str, str, int, list[str], list[int]]] = []
        for number, (question_id, question) in enumerate(questions.items(), 1):
            question_id = str(question_id)
            if not isinstance(question, dict):
                raise RequestError(f"{question_id}: a question must be an object")
            options = question_options(question_id, question)
            kind = question["type"]
            name = positional_name(number) if self.question_ids == "opaque" else question_id
            pieces.append(f"\nFIELD {number}\nID: {name}\nTYPE: {kind}\nINSTRUCTION: ")
            instruction_piece = len(pieces)
            pieces.append(_instructions(question_id, question, name))
            pieces.append(self._options_header)
            option_pieces = []
            for option_number, (option_id, description) in enumerate(options, 1):
                pieces.append(self._option_label(option_number))
                option_pieces.append(len(pieces))
                semantics = {"option_id": option_id}
                if description is not None:
                    semantics["description"] = description
                pieces.append(render(semantics, f"{question_id}: criteria {option_id!r}"))
                pieces.append(self._option_end)
            pieces.append(self._field_end)
            layout.append((question_id, kind, instruction_piece, [o for o, _ in options], option_pieces))

        texts = [p for p in pieces if isinstance(p, str)]
        tokenized = iter(self._tokenize(texts))
        piece_ids = [next(tokenized) if isinstance(p, str) else p for p in pieces]
        state_ids, schema_pieces = piece_ids[0], piece_ids[1:]

        prefix_end = len(self._prefix)
        media_ids, placed = self._media(images, prefix_end) if images else ([], [])
        media_end = prefix_end + len(media_ids)
        schema_length = sum(len(ids) for ids in schema_pieces)
        fixed = media_end + schema_length + len(self._suffix)
        if fixed > self.max_length:
            what = f"schema and {len(placed)} image(s)" if placed else "schema"
            raise RequestError(
                f"{what} requires {fixed} tokens before state; maximum is {self.max_length}",
                error_type="tokens_exceeded",
            )
        state_ids = state_ids[: self.max_length - fixed]
        state_end = media_end + len(state_ids)

        # starts[k] = absolute position of pieces[k] (pieces[0] is the state).
        lengths = [len(state_ids), *(len(ids) for ids in schema_pieces)]
        starts = [media_end + s for s in accumulate(lengths, initial=0)]

        def span(piece: int) -> tuple[int, int]:
            return starts[piece], starts[piece] + lengths[piece]

        encoded_questions = []
        for question_id, kind, instruction_piece, option_ids, option_pieces in layout:
            question_span = span(instruction_piece)
            if question_span[0] == question_span[1]:
                raise RequestError(f"{question_id}: instructions encode to no tokens")
            encoded_questions.append(
                EncodedQuestion(
                    question_id=question_id,
                    type=kind,
                    type_index=QUESTION_TYPES[kind],
                    question_span=question_span,
                    option_spans=tuple(span(p) for p in option_pieces),
                    option_ids=tuple(option_ids),
                )
            )

        input_ids: list[int] = [*self._prefix, *media_ids, *state_ids]
        for ids in schema_pieces:
            input_ids.extend(ids)
        input_ids.extend(self._suffix)
        if placed:
            self._check_pad_text(input_ids, placed)
        return EncodedRecord(
            input_ids=tuple(input_ids),
            questions=tuple(encoded_questions),
            prefix_end=prefix_end,
            state_end=state_end,
            media_end=media_end if placed else None,
            images=tuple(placed),
            prepared_images=tuple(images or ()),
        )
