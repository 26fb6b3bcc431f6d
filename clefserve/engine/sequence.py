"""One sequence's life in the engine: its tokens, how far the model has run them, and what it holds.

A prefill-only request (a decision record) finishes when every token has been computed. Generation will
append one token per decode step (:meth:`Sequence.append_token`) and finish on its own stop rule; nothing
here assumes the token count is fixed.
"""

from __future__ import annotations

import enum
import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from clefserve.model.inputs import InputsProvider, SequenceInputs

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"


class Sequence:
    def __init__(
        self,
        token_ids: torch.Tensor,
        payload: Any = None,
        keep_hidden: bool = True,
        snapshot_points: tuple[int, ...] = (),
        inputs: SequenceInputs | InputsProvider | None = None,
        cache_keys: list | None = None,
    ) -> None:
        self.seq_id = next(_ids)
        # a CPU buffer with room to grow; only the first ``num_tokens`` entries are the sequence
        self._ids = token_ids.to(dtype=torch.long, device="cpu").contiguous()
        self.num_tokens = int(self._ids.shape[0])
        self.num_prompt_tokens = self.num_tokens
        self.num_computed = 0
        self.payload = payload
        self.keep_hidden = keep_hidden
        self.status = Status.WAITING
        self.future: Future = Future()
        self.cancel_requested = False
        # resources, set at admission
        self.block_table: list[int] = []
        self.block_table_tensor: torch.Tensor | None = None  # on the model's device
        self.first_block: int | None = None  # set when the block table is one run of adjacent blocks
        self.slot: int | None = None
        self.steps_passed_over = 0  # consecutive steps this running sequence got no tokens (scheduler)
        self.hidden: torch.Tensor | None = None  # [num_prompt_tokens, H] when keep_hidden
        # time.perf_counter() stamps for latency metrics: queued, admitted (first step), last token run
        self.submitted_at = time.perf_counter()
        self.admitted_at: float | None = None
        self.finished_at: float | None = None
        # prefix cache: positions where the GDN state is worth a snapshot (ascending), how many leading
        # tokens came from the cache, and the cache's own bookkeeping (clefserve.engine.prefix_cache)
        self.snapshot_points = snapshot_points
        # a snapshot point inside this step's piece: its offset in the piece (0: none), set by the scheduler,
        # and the GDN states there (conv, recurrent stacked over the GDN layers), set by the runner
        self.capture_at = 0
        self.captured: tuple[torch.Tensor, torch.Tensor] | None = None
        self.num_cached = 0
        self.prefix: Any = None
        # pictures: rows replacing token embeddings and M-RoPE positions (None: text), or what computes
        # them at admission; the prefix cache compares ``cache_keys`` instead of the token ids when given
        # (a picture's tokens all share one id)
        self.inputs: SequenceInputs | InputsProvider | None = inputs
        self.cache_keys = cache_keys

    @property
    def token_ids(self) -> torch.Tensor:
        return self._ids[: self.num_tokens]

    @property
    def num_pending(self) -> int:
        """Tokens not yet run through the model."""
        return self.num_tokens - self.num_computed

    @property
    def is_done(self) -> bool:
        return self.num_pending == 0

    def append_token(self, token_id: int) -> None:
        """Decode: one more token to run next step (its KV block must be reserved by the scheduler)."""
        if self.num_tokens == self._ids.shape[0]:
            grown = torch.empty(max(16, 2 * self.num_tokens), dtype=torch.long)
            grown[: self.num_tokens] = self._ids[: self.num_tokens]
            self._ids = grown
        self._ids[self.num_tokens] = token_id
        self.num_tokens += 1

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed}, "
            f"status={self.status.value})"
        )


@dataclass
class FinishedSequence:
    """What the engine's ``finish`` callback receives for one sequence whose last token has run."""

    seq_id: int
    payload: Any
    token_ids: torch.Tensor  # [T] int64, CPU
    hidden: torch.Tensor | None  # final-norm rows [T, H] on the model's device; None without keep_hidden
    # time.perf_counter() stamps: submitted, admitted (resources reserved, first step), last token run
    submitted_at: float = 0.0
    admitted_at: float = 0.0
    finished_at: float = 0.0
    cached_tokens: int = 0  # leading tokens served from the prefix cache instead of computed
