"""Pydantic models of the System One wire format (systemone-api.md §2-§4).

The request models only *validate*: the route hands the backend the body exactly as parsed, because the
model renders values with ``json.dumps`` and key order and ``1`` vs ``1.0`` change the tokens.
The response models document the answers in the OpenAPI schema; answers are not re-validated.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from clefserve.server.limits import (
    MAX_CHOICE_LABELS,
    MAX_QUESTIONS,
    MAX_SCORE_LEVELS,
    MIN_CHOICE_LABELS,
    MIN_QUESTIONS,
    MIN_SCORE_LEVELS,
    RequestLimits,
)


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, dict | list):
        return "an object" if isinstance(value, dict) else "an array"
    return type(value).__name__


def _description(value: Any) -> Any:
    if value is None or isinstance(value, str | dict | list):
        return value
    raise PydanticCustomError(
        "description_type", "must be a string, an object, an array or null, not {kind}",
        {"kind": _json_kind(value)},
    )


# Instructions and criteria descriptions: text, or JSON the question can point into. One validator
# (not a union) so that a wrong type is one error with a plain location.
Description = Annotated[
    Any,
    PlainValidator(_description),
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "object"}, {"type": "array"}, {"type": "null"}]}),
]


def _level(value: Any) -> Any:
    if isinstance(value, str):
        if not value.strip():
            raise PydanticCustomError("empty_level", "a score level must not be empty or blank")
        return value
    raise PydanticCustomError(
        "level_type", "a score level must be a string, not {kind}",
        {"kind": "null" if value is None else _json_kind(value)},
    )


# A score level: what the legend echoes and the model reads as that level's description. TypeSafe's
# OpenAPI contract types levels as strings (unlike choice descriptions, which may be any JSON value); blank
# text says nothing and is refused too.
Level = Annotated[
    Any,
    PlainValidator(_level),
    WithJsonSchema({"type": "string", "minLength": 1, "pattern": "\\S"}),
]


def _count_error(what: str, n: int, low: int, high: int, flag: str) -> PydanticCustomError:
    if n < low:
        return PydanticCustomError(
            "too_short", "{what}: at least {min_length} required, got {actual_length}",
            {"what": what, "min_length": low, "actual_length": n},
        )
    return PydanticCustomError(
        "too_long", "{what}: at most {max_length} allowed, got {actual_length} (this server's {flag})",
        {"what": what, "max_length": high, "actual_length": n, "flag": flag},
    )


def _limits(info: ValidationInfo) -> RequestLimits:
    """The operator's limits, passed as ``model_validate(..., context={"limits": RequestLimits(...)})``."""
    limits = (info.context or {}).get("limits")
    return limits if isinstance(limits, RequestLimits) else RequestLimits()


def _check_count(what: str, n: int, low: int, limits: RequestLimits, name: str) -> None:
    high = getattr(limits, name)
    if not low <= n <= high:
        raise _count_error(what, n, low, high, RequestLimits.FLAGS[name])


class _Question(BaseModel):
    # Unknown question fields are refused: a typo such as "instruction" would otherwise be dropped
    # silently and the model would read the question id instead.
    model_config = ConfigDict(extra="forbid")

    instructions: Description = Field(
        None, description="The question. When missing, null or empty, the question id is used instead.",
    )


class NoulCriteria(BaseModel):
    model_config = ConfigDict(extra="forbid")

    true: Description = Field(None, description="What counts as yes (default: a generic yes).")
    false: Description = Field(None, description="What counts as no (default: a generic no).")


class NoulQuestion(_Question):
    type: Literal["noul"]
    criteria: NoulCriteria | None = None


class ChoiceQuestion(_Question):
    type: Literal["choice"]
    criteria: dict[str, Description] = Field(
        description=f"Label -> description (null: the label alone), at least {MIN_CHOICE_LABELS} non-empty "
                    f"labels, at most --max-choice-labels (default {MAX_CHOICE_LABELS}).",
        min_length=MIN_CHOICE_LABELS, json_schema_extra={"maxProperties": MAX_CHOICE_LABELS},
    )

    @field_validator("criteria", mode="before")
    @classmethod
    def _labels(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, dict):
            _check_count("choice labels", len(value), MIN_CHOICE_LABELS, _limits(info), "max_choice_labels")
            if "" in value:
                raise PydanticCustomError("empty_label", "choice labels must be non-empty strings")
        return value


class ScoreQuestion(_Question):
    type: Literal["score"]
    criteria: list[Level] = Field(
        description=f"Ordered level descriptions, index 0 = lowest, at least {MIN_SCORE_LEVELS} levels, at "
                    f"most --max-score-levels (default {MAX_SCORE_LEVELS}); each a non-blank string.",
        min_length=MIN_SCORE_LEVELS, json_schema_extra={"maxItems": MAX_SCORE_LEVELS},
    )

    @field_validator("criteria", mode="before")
    @classmethod
    def _levels(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, dict):
            raise PydanticCustomError(
                "score_criteria_object",
                'score criteria must be an array of level descriptions (index 0 = lowest); '
                'the older object form {"0": ..., "1": ...} is not accepted',
            )
        if isinstance(value, list):
            _check_count("score levels", len(value), MIN_SCORE_LEVELS, _limits(info), "max_score_levels")
        return value


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


def unsupported_questions(body: Any, supported: tuple[str, ...]) -> list[tuple[str, str]]:
    """(question id, type) of each question whose ``type`` is a name this model does not answer (``box``, or
    any other); a missing or non-string type is left to validation."""
    questions = body.get("questions") if isinstance(body, dict) else None
    if not isinstance(questions, dict):
        return []
    return [(qid, q["type"]) for qid, q in questions.items()
            if isinstance(q, dict) and isinstance(q.get("type"), str) and q["type"]
            and q["type"] not in supported]


class SystemOneRequest(BaseModel):
    """``POST /v1/systemone``. Unknown top-level fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(description="Model name or alias; echoed in the response.", examples=["jev-latest"])
    state: Any = Field(description="The content every question refers to: any JSON value, null included.")
    questions: dict[str, Question] = Field(
        description=f"Question id -> question, at least {MIN_QUESTIONS}, at most --max-questions (default "
                    f"{MAX_QUESTIONS}), with non-empty ids; ids are echoed as answer keys.",
        min_length=MIN_QUESTIONS, json_schema_extra={"maxProperties": MAX_QUESTIONS},
    )
    images: list[str] | None = Field(
        None,
        description="Pictures the questions may refer to, as base64 or data:image/...;base64, URLs "
                    "(PNG, JPEG, WebP, GIF first frame, BMP), up to --max-images (default 4); only for "
                    "models with a vision tower. URLs and file paths are refused, never fetched or read.",
    )
    # Media inputs of the reference and of TypeSafe's API that this server does not read: answering a
    # question about a video without the video would be a wrong answer, so they are refused.
    videos: SkipJsonSchema[Any] = None
    assets: SkipJsonSchema[Any] = None

    @field_validator("questions", mode="before")
    @classmethod
    def _questions(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, dict):
            _check_count("questions", len(value), MIN_QUESTIONS, _limits(info), "max_questions")
            if "" in value:
                raise PydanticCustomError("empty_question_id", "question ids must be non-empty strings")
        return value

    @field_validator("images", mode="before")
    @classmethod
    def _image_list(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, list):
            raise PydanticCustomError(
                "images_type", "images must be a list of base64 strings or data:image/...;base64, URLs")
        return value

    @field_validator("videos", "assets", mode="before")
    @classmethod
    def _no_media(cls, value: Any) -> Any:
        if value not in (None, [], {}):
            raise PydanticCustomError("media_unsupported",
                                      "video and asset inputs are not supported; send pictures in images")
        return value


# ---- responses (documentation) ----

class NoulAnswer(BaseModel):
    type: Literal["noul"]
    noul: float = Field(description="P(yes), in [0, 1].")
    x_probabilities: dict[str, float] | None = Field(
        None, description="Extension (--x-raw-probabilities): unrounded float32 probabilities by option id.")


class ChoiceAnswer(BaseModel):
    type: Literal["choice"]
    choice: str = Field(description="The most probable label (ties: the earlier label in request order).")
    confidence: float
    probabilities: dict[str, float] = Field(description="Keyed by exactly the request's labels.")
    x_probabilities: dict[str, float] | None = Field(
        None, description="Extension (--x-raw-probabilities): unrounded float32 probabilities by option id.")


class ScoreAnswer(BaseModel):
    type: Literal["score"]
    score: float = Field(description="Expected level index, sum of i * p_i, on the 0..N-1 scale.")
    confidence: float
    legend: dict[str, Level] = Field(description='"0".."N-1" -> the criteria as sent.')
    probabilities: dict[str, float]
    x_probabilities: dict[str, float] | None = Field(
        None, description="Extension (--x-raw-probabilities): unrounded float32 probabilities by option id.")


Answer = Annotated[NoulAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]


class Usage(BaseModel):
    input_tokens: int = Field(description="Length of the record in tokens.")
    output_tokens: int = Field(description="Always 0: a decision generates no tokens.")
    x_cached_tokens: int | None = Field(
        None, description="Extension: the record's leading tokens served from the prefix cache.")


class SystemOneResponse(BaseModel):
    model: str
    answers: dict[str, Answer] = Field(description="One answer per question id, in request order.")
    usage: Usage


class ModelCard(BaseModel):
    name: str
    description: str
    release_date: str = Field(description="YYYY-MM-DD")
    x_confidence: Literal["clef", "typesafe"] | None = Field(
        None, description="Extension: the confidence definition in force (--confidence).")
    x_question_ids: Literal["prompt", "opaque"] | None = Field(
        None, description="Extension: whether question ids reach the model (--question-ids).")
    x_question_types: list[str] | None = Field(
        None, description="Extension: the question types this model answers; any other type is a 422 "
                          "unsupported_question_type.")


class OpenAIModel(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    """TypeSafe's ``models`` and OpenAI's ``object``/``data`` in one body."""

    models: list[ModelCard]
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


class ErrorBody(BaseModel):
    message: str
    error_type: str


class ErrorResponse(BaseModel):
    detail: ErrorBody


class ValidationErrorItem(BaseModel):
    loc: list[str | int] = Field(examples=[["body", "questions", "urgency", "score", "criteria"]])
    msg: str
    type: str
    input: Any = None
    ctx: dict[str, Any] | None = None


class HTTPValidationError(BaseModel):
    detail: list[ValidationErrorItem]


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


class ReadyResponse(BaseModel):
    status: Literal["ready", "not_ready"]
    reason: str
