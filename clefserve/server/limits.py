"""Request limits of the System One HTTP API, in one place (the README lists them from here).

The question, label and level bounds default to Cloudflare's hosted Clef (systemone-api.md §2.2); their
maxima are flags (``--max-questions``, ``--max-choice-labels``, ``--max-score-levels``), handed to
validation as :class:`RequestLimits`. The body size bound is ``--max-body-bytes`` (default 1 MiB); the
state's token budget is ``--max-length`` and is enforced by the model layer, which cuts the state to fit.
A refusal names the flag that raises its limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

MIN_QUESTIONS = 1
MAX_QUESTIONS = 64
MIN_CHOICE_LABELS = 2
MAX_CHOICE_LABELS = 255
MIN_SCORE_LEVELS = 2
MAX_SCORE_LEVELS = 10
# Arrays and objects nested inside each other, the body object itself counting as level 1.
MAX_JSON_DEPTH = 64
# Longest integer literal (Python's own default bound on int <-> str conversion).
MAX_INTEGER_DIGITS = 4300
# A client's x-request-id is echoed only if it is this short and made of [A-Za-z0-9._:-].
MAX_REQUEST_ID_LENGTH = 128
# Validation errors echo the offending input only when its JSON is at most this long.
MAX_ECHOED_INPUT_CHARS = 1024


@dataclass(frozen=True)
class RequestLimits:
    """The maxima an operator can raise, with the flags that raise them."""

    max_questions: int = MAX_QUESTIONS
    max_choice_labels: int = MAX_CHOICE_LABELS
    max_score_levels: int = MAX_SCORE_LEVELS

    FLAGS: ClassVar[dict[str, str]] = {"max_questions": "--max-questions",
                                       "max_choice_labels": "--max-choice-labels",
                                       "max_score_levels": "--max-score-levels"}
