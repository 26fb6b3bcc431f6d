"""The benchmark workload: System One requests whose records have a given token count."""

from __future__ import annotations

import random

from clefserve.formats.clef.encoder import ClefEncoder
from clefserve.testing.tokenizer import WORDS


def make_request(encoder: ClefEncoder, tokens: int, rng: random.Random) -> dict:
    questions = {
        "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
        "team": {"type": "choice", "instructions": "Which team should handle it?",
                 "criteria": {"billing": "Payments and refunds", "technical": "Bugs and outages",
                              "sales": "Plans and prices", "account": None}},
        "urgency": {"type": "score", "instructions": "How urgent is it?",
                    "criteria": ["Can wait", "This week", "Today", "Right now"]},
    }
    request: dict = {"model": "bench", "state": "", "questions": questions}
    ticket = rng.randint(1, 99999)

    def length(words: list[str]) -> int:
        request["state"] = {"ticket": ticket, "message": " ".join(words)}
        return len(encoder.encode(request).input_ids)

    words = rng.choices(WORDS, k=64)
    while length(words) < tokens:
        words += rng.choices(WORDS, k=len(words))
    low, high = 0, len(words)  # the fewest words that reach ``tokens``
    while low < high:
        middle = (low + high) // 2
        if length(words[:middle]) >= tokens:
            high = middle
        else:
            low = middle + 1
    length(words[:low])
    return request
