"""Admission and token budgeting: which sequences run in the next step, and how many tokens each.

- FIFO waiting queue: the head is admitted when a GDN slot and all the KV blocks its record needs are free;
  nothing behind a head that does not fit yet is admitted before it (no starvation).
- At most ``max_num_seqs`` running. All blocks are reserved at admission, so prefill never preempts.
- Each step spends ``token_budget`` tokens over the running sequences in admission order: a long record runs
  as several chunks, and the budget its last chunk leaves goes to the sequences beside it.

Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from clefserve.engine.errors import QueueFullError, tokens_exceeded
from clefserve.engine.kv_pool import BlockAllocator
from clefserve.engine.sequence import Sequence, Status
from clefserve.engine.state_pool import SlotAllocator
from clefserve.errors import RequestError


@dataclass
class StepPlan:
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)


class Scheduler:
    def __init__(
        self,
        blocks: BlockAllocator,
        slots: SlotAllocator,
        block_size: int,
        max_num_seqs: int,
        token_budget: int,
        max_queue: int,
        max_length: int,
    ) -> None:
        if token_budget < 1:
            raise ValueError("--prefill-chunk-size must be at least 1")
        self.blocks, self.slots, self.block_size = blocks, slots, block_size
        self.max_num_seqs, self.token_budget, self.max_queue = max_num_seqs, token_budget, max_queue
        self.max_length = max_length
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.tokens_per_second = 0.0  # recent throughput, kept by the engine; sizes Retry-After

    @property
    def token_capacity(self) -> int:
        return self.blocks.num_blocks * self.block_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check(self, num_tokens: int) -> None:
        """Refuse at once a record that could never run (raises :class:`RequestError`)."""
        if num_tokens < 1:
            raise RequestError("the record has no tokens", status=422, error_type="invalid_request")
        if num_tokens > self.token_capacity:
            raise tokens_exceeded(
                num_tokens, self.token_capacity,
                f"the KV pool holds {self.blocks.num_blocks} blocks of {self.block_size} tokens",
            )
        if num_tokens > self.max_length:
            raise tokens_exceeded(num_tokens, self.max_length, "--max-length")

    def add(self, seq: Sequence) -> None:
        self.check(seq.num_tokens)
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(
                f"the server is busy: {len(self.waiting)} requests wait (--max-queue {self.max_queue})",
                retry_after=self._retry_after(),
            )
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def _retry_after(self) -> int:
        queued = sum(s.num_pending for s in self.waiting) + sum(s.num_pending for s in self.running)
        if self.tokens_per_second <= 0:
            return 1
        return max(1, min(60, math.ceil(queued / self.tokens_per_second)))

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = self.blocks_for(seq.num_tokens)
            if self.slots.num_free == 0 or not self.blocks.can_allocate(need):
                break  # the head waits for room; nobody overtakes it
            self.waiting.popleft()
            seq.block_table = self.blocks.allocate(need)
            seq.slot = self.slots.allocate()
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.admitted.append(seq)
        budget = self.token_budget
        for seq in self.running:
            if budget == 0:
                break
            if seq.cancel_requested:
                continue
            n = min(seq.num_pending, budget)
            if n > 0:
                plan.chunks.append((seq, n))
                budget -= n
        return plan

    def complete(self, plan: StepPlan) -> list[Sequence]:
        """Advance the step's sequences; release and return those whose last token has run."""
        done = []
        for seq, n in plan.chunks:
            if seq.status is not Status.RUNNING:
                continue
            seq.num_computed += n
            if seq.is_done:
                seq.status = Status.FINISHED
                self._release(seq)
                done.append(seq)
        return done

    def remove(self, seq: Sequence, status: Status) -> bool:
        """Take a waiting or running sequence out (cancel, failure) and free what it holds."""
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self._release(seq)
        else:
            return False
        seq.status = status
        return True

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.block_table = []
        seq.block_table_tensor = None
        seq.first_block = None
        if seq.slot is not None:
            self.slots.free(seq.slot)
            seq.slot = None
