"""Request limits of the System One HTTP API, in one place (the README lists them from here).

The question, label and level bounds follow Cloudflare's hosted Clef (systemone-api.md §2.2). The body
size bound is a flag (``--max-body-bytes``, ``EngineConfig.max_body_bytes``, default 1 MiB); the state's
token budget is ``--max-length`` and is enforced by the model layer, which cuts the state to fit.
"""

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
