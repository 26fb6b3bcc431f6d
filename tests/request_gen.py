"""Seeded generator of ``/v1/systemone`` request bodies that stress the Clef record encoding.

States and descriptions mix strings, nested objects, ints, floats (``1250`` vs ``1250.0``), unicode,
escapes, control characters, special-token strings, lists and null; questions cover all three types with
labels that need sorting, partial noul criteria and every form of instructions.
"""

from __future__ import annotations

import random
from typing import Any

from clefserve.testing.tokenizer import WORDS

UNICODE = ("é", "ß", "Ω", "中文", "日本", "🙂", "naïve", "Ünïcödé", "\u200b", "ﬁ", "עברית", "😀👍")
SPECIAL = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>", "<|image_pad|>")
ODD = ("\n", "\t", "\r", "\x00", "\x1f", "\x7f", '"', "\\", "\\n", "/", "\u2028", " ", "  ", "'")
FLOATS = (1250.0, 0.1, -0.0, 1e-7, 1e20, 3.141592653589793, 2.5e-300, 1.7976931348623157e308, -12.75)
LABELS = ("billing", "Billing", "sales", "tech", "Z", "a", "_x", "10", "9", "2", "é", "Ω", "中文", "a b",
          "refund", "REFUND", "~", "0", "-1", "🙂", "late", "ok", "true", "false")


class RequestGenerator:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    # --- building blocks ---------------------------------------------------------------------------
    def text(self, words: tuple[int, int] = (1, 12)) -> str:
        rng = self.rng
        parts = []
        for _ in range(rng.randint(*words)):
            roll = rng.random()
            if roll < 0.70:
                parts.append(rng.choice(WORDS))
            elif roll < 0.82:
                parts.append(rng.choice(UNICODE))
            elif roll < 0.94:
                parts.append(rng.choice(ODD))
            else:
                parts.append(rng.choice(SPECIAL))
        sep = rng.choice((" ", " ", "", "\n"))
        return sep.join(parts)

    def number(self) -> int | float:
        rng = self.rng
        roll = rng.random()
        if roll < 0.4:
            return rng.randint(-10, 10_000)
        if roll < 0.6:
            return rng.choice(FLOATS)
        if roll < 0.8:
            return round(rng.uniform(-1000, 1000), rng.randint(0, 6))
        return rng.choice((2**53 + 1, -(2**63), 10**30, 0))

    def value(self, depth: int = 0) -> Any:
        rng = self.rng
        roll = rng.random() if depth < 3 else rng.random() * 0.6
        if roll < 0.25:
            return self.text((1, 6))
        if roll < 0.40:
            return self.number()
        if roll < 0.47:
            return rng.choice((None, True, False))
        if roll < 0.50:
            return ""
        if roll < 0.75:
            return {self.key(): self.value(depth + 1) for _ in range(rng.randint(0, 4))}
        return [self.value(depth + 1) for _ in range(rng.randint(0, 4))]

    def key(self) -> str:
        rng = self.rng
        roll = rng.random()
        if roll < 0.6:
            return rng.choice(WORDS)
        if roll < 0.75:
            return rng.choice(UNICODE)
        if roll < 0.9:
            return str(rng.randint(0, 99))
        return rng.choice(ODD) + rng.choice(WORDS)

    def state(self, long: bool = False) -> Any:
        rng = self.rng
        if long:
            if rng.random() < 0.5:
                return self.text((250, 600))
            return {f"line{i}": self.text((5, 20)) for i in range(rng.randint(25, 50))}
        roll = rng.random()
        if roll < 0.35:
            return self.text((1, 40))
        if roll < 0.8:
            return {self.key(): self.value() for _ in range(rng.randint(1, 6))}
        if roll < 0.9:
            return [self.value() for _ in range(rng.randint(0, 5))]
        return rng.choice((None, 0, 12.5, True, "", [], {}))

    def description(self) -> Any:
        rng = self.rng
        roll = rng.random()
        if roll < 0.2:
            return None
        if roll < 0.7:
            return self.text((1, 5))
        if roll < 0.9:
            return {self.key(): self.value(3) for _ in range(rng.randint(1, 2))}
        return self.value(2)

    def instructions(self) -> Any:
        """Missing (``...``), null, "", a string, or another JSON value."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.12:
            return ...
        if roll < 0.2:
            return None
        if roll < 0.28:
            return ""
        if roll < 0.85:
            return self.text((1, 10))
        return self.value(2)

    def question_id(self, taken: set[str]) -> str:
        rng = self.rng
        while True:
            roll = rng.random()
            if roll < 0.6:
                qid = rng.choice(WORDS) + rng.choice(("", "_", "-", " ")) + str(rng.randint(0, 99))
            elif roll < 0.8:
                qid = rng.choice(UNICODE) + str(rng.randint(0, 9))
            else:
                sep = rng.choice((*ODD[:3], ".", ":"))
                qid = rng.choice(("q", "Q", "field", "x")) + sep + str(len(taken))
            if qid not in taken:
                taken.add(qid)
                return qid

    def question(self, kind: str) -> dict[str, Any]:
        rng = self.rng
        question: dict[str, Any] = {"type": kind}
        instructions = self.instructions()
        if instructions is not ...:
            question["instructions"] = instructions
        if kind == "choice":
            labels = rng.sample(LABELS, rng.randint(1, 5))
            question["criteria"] = {label: self.description() for label in labels}
        elif kind == "score":
            question["criteria"] = [self.description() for _ in range(rng.randint(2, 5))]
        else:
            roll = rng.random()
            if roll < 0.3:
                pass
            elif roll < 0.4:
                question["criteria"] = None
            elif roll < 0.5:
                question["criteria"] = {}
            else:
                criteria = {}
                for key in ("true", "false", "maybe"):
                    if rng.random() < 0.5:
                        criteria[key] = self.description()
                question["criteria"] = criteria
        return question

    # --- whole requests ----------------------------------------------------------------------------
    def request(self, long_state: bool | None = None, max_questions: int = 8) -> dict[str, Any]:
        rng = self.rng
        long_state = rng.random() < 0.15 if long_state is None else long_state
        taken: set[str] = set()
        questions = {
            self.question_id(taken): self.question(rng.choice(("noul", "choice", "score")))
            for _ in range(rng.randint(1, rng.randint(1, max_questions)))
        }
        request = {"model": rng.choice(("clef-flash", "@cf/cloudflare/clef-flash", "x")), "state": None,
                   "questions": questions}
        request["state"] = self.state(long_state)
        if rng.random() < 0.2:
            request["id"] = f"rec-{rng.randint(0, 999)}"
        return request

    def requests(self, count: int, **kwargs: Any) -> list[dict[str, Any]]:
        return [self.request(**kwargs) for _ in range(count)]


def api_valid(request: dict[str, Any]) -> dict[str, Any]:
    """A generated request made acceptable to the HTTP API, in place: the generator also writes what only
    the reference takes (number or boolean descriptions, null or blank score levels, one-label choices,
    unknown noul criteria keys). Returns the request."""

    def description(value: Any) -> Any:
        return value if value is None or isinstance(value, str | dict | list) else str(value)

    for question in request["questions"].values():
        if "instructions" in question:
            question["instructions"] = description(question["instructions"])
        criteria = question.get("criteria")
        if question["type"] == "noul" and isinstance(criteria, dict):
            question["criteria"] = {k: description(v) for k, v in criteria.items() if k in ("true", "false")}
        elif question["type"] == "choice":
            question["criteria"] = {k: description(v) for k, v in criteria.items()}
            if len(criteria) < 2:
                question["criteria"]["zz other"] = None
        elif question["type"] == "score":
            question["criteria"] = [v if isinstance(v, str) and v.strip() else f"level {i}: {v}"
                                    for i, v in enumerate(criteria)]
    return request
