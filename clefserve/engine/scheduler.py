"""Admission and token budgeting: which sequences run in the next step, and how many tokens each.

- FIFO waiting queue: the head is admitted when a GDN slot and all the KV blocks its record needs are free;
  nothing behind a head that does not fit yet is admitted before it (no starvation).
- At most ``max_num_seqs`` running. All blocks are reserved at admission, so prefill never preempts.
- Each step spends ``token_budget`` tokens over the running sequences, shortest remaining work first, so a
  short record is not stuck behind a long one; a long record runs as several chunks, each ending on a
  delta-rule chunk boundary and none a sliver of leftover budget (under a delta-rule chunk, or a quarter of
  the budget if smaller) unless it finishes the record or reaches a snapshot point. While a short record
  (:meth:`Scheduler.is_short`) runs, long records share at most a quarter of the step, so the steps a
  short record waits for stay short. A running sequence that got no tokens for ``STARVATION_STEPS`` steps
  in a row goes first (oldest first); the starved long records share at least a quarter of the budget, so
  none starves.
- Where the engine pauses steps of long records for short ones (``pauses_long_steps``): a short record
  has at most half a budget left, long records get none of a short record's steps, and inside a paused
  step (at a layer boundary) :meth:`Scheduler.schedule_short` plans a step of short records only,
  none of the paused ones.
- With a prefix cache: a sequence is admitted from its deepest cached resume point (sharing the cached
  blocks; cache-only blocks count as room, evicted when needed). A snapshot point that falls inside a
  piece does not end it: the GDN layers keep their state there (``Batch.captures``) and the snapshot is
  taken from it after the step, so a resume point never costs a step of its own; a second point inside
  the same piece ends it. A point at a piece's end is snapshotted from the state pool. A waiting sequence
  whose prefix a running one is about to snapshot is *parked* until then (and the queue moves on past it),
  so a shared prefix is computed once. A sequence whose whole prompt is cached finishes at admission.
- Where the engine runs several steps at once (CPU lanes), each is planned without the sequences of the
  steps in flight (``busy``): they are neither given tokens nor counted as passed over.

Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from clefserve.engine.errors import QueueFullError, tokens_exceeded
from clefserve.engine.kv_pool import BlockAllocator
from clefserve.engine.prefix_cache import PrefixCache
from clefserve.engine.sequence import Sequence, Status
from clefserve.engine.state_pool import SlotAllocator
from clefserve.errors import RequestError
from clefserve.model.ops.delta_rule import CHUNK as DELTA_RULE_CHUNK

log = logging.getLogger(__name__)

# A running sequence passed over this many steps in a row is served first in the next one.
STARVATION_STEPS = 4


@dataclass
class StepPlan:
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # whole prompt cached: done at admission

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
        cache: PrefixCache | None = None,
        pauses_long_steps: bool = False,
    ) -> None:
        """``pauses_long_steps``: the engine pauses steps of long records at a layer boundary for a step of
        short ones (:meth:`schedule_short`)."""
        if token_budget < 1:
            raise ValueError("--prefill-chunk-size must be at least 1")
        self.blocks, self.slots, self.block_size = blocks, slots, block_size
        self.cache = cache
        self.max_num_seqs, self.token_budget, self.max_queue = max_num_seqs, token_budget, max_queue
        self.max_length = max_length
        # the short records of a step run alone when long steps pause for them: none of them waits for a
        # long record's piece, and a long record's last piece (up to a budget) is not short enough to run
        # inside a paused step
        self.short_limit = token_budget // 2 if pauses_long_steps else token_budget
        self.long_share = 0 if pauses_long_steps else token_budget // 4
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.tokens_per_second = 0.0  # recent throughput, kept by the engine; sizes Retry-After

    @property
    def token_capacity(self) -> int:
        return self.blocks.num_blocks * self.block_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_runnable(self, busy: Collection[Sequence] = ()) -> bool:
        """Whether :meth:`schedule` may plan something with the sequences of ``busy`` left out (cheap)."""
        return self._may_admit() or any(seq not in busy and not seq.cancel_requested for seq in self.running)

    def _may_admit(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check(self, num_tokens: int) -> None:
        """Refuse at once a record that could never run (raises :class:`RequestError`)."""
        if num_tokens < 1:
            raise RequestError("the record has no tokens", status=422, error_type="invalid_request")
        if num_tokens > self.token_capacity:
            raise tokens_exceeded(
                num_tokens, self.token_capacity,
                f"the KV pool holds {self.blocks.num_blocks} blocks of {self.block_size} tokens; "
                f"--kv-cache-mb or --kv-fraction raises it",
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

    def schedule(self, busy: Collection[Sequence] = ()) -> StepPlan:
        """The next step; the sequences of ``busy`` (in another step in flight) are left out."""
        plan = StepPlan()
        self._admit_waiting(plan)
        budget = self.token_budget
        order = self._by_priority(busy)
        # while a short record runs, long records get at most ``long_share`` of the budget: its steps stay
        # short, so it answers after a few short steps (one per snapshot point) instead of as many full ones
        long_left = self.long_share if any(self.is_short(seq) for seq in order) else budget
        starved_left = self.token_budget // 4  # starved long records get this much even beside a short one
        for seq in order:
            is_long = not self.is_short(seq)
            if self._waits_whole(seq, plan, budget):
                seq.steps_passed_over += 1
                continue
            starved = seq.steps_passed_over >= STARVATION_STEPS
            cap = budget if not is_long else max(long_left, starved_left) if starved else long_left
            n = self._piece(seq, min(seq.num_pending, budget, cap), budget)
            if n > 0:
                plan.chunks.append((seq, n))
                budget -= n
                if is_long:
                    long_left = max(0, long_left - n)
                    if starved:
                        starved_left = max(0, starved_left - n)
                seq.steps_passed_over = 0
            else:
                seq.steps_passed_over += 1
        return plan

    def _waits_whole(self, seq: Sequence, plan: StepPlan, budget: int) -> bool:
        """A short record that the rest of a step's ``budget`` cannot finish is left whole for the next step
        (or another lane's): cut, it would answer only after a second step, and the step that took its
        first piece would have run longer for nothing."""
        return bool(plan.chunks) and self.is_short(seq) and seq.num_pending > budget

    def is_short(self, seq: Sequence) -> bool:
        """A record that finishes within one step: at most ``short_limit`` tokens left."""
        return seq.num_pending <= self.short_limit

    def has_short_work(self, busy: Collection[Sequence]) -> bool:
        """Whether :meth:`schedule_short` may find something to run (cheap; asked between layers)."""
        return self._may_admit() or any(seq not in busy and not seq.cancel_requested and self.is_short(seq)
                                        for seq in self.running)

    def schedule_short(self, busy: Collection[Sequence]) -> StepPlan:
        """A step run inside a paused one (at a layer boundary): admission as usual, then only short
        records, shortest first, none of ``busy`` (the steps in flight: the paused one's, mid-step, their
        state half advanced, and another lane's). Nobody else's place in line changes: sequences left out
        are not counted as passed over."""
        plan = StepPlan()
        self._admit_waiting(plan)
        budget = self.token_budget
        shorts = sorted((seq for seq in self.running if seq not in busy and not seq.cancel_requested
                         and self.is_short(seq)), key=lambda seq: seq.num_pending)
        for seq in shorts:
            if self._waits_whole(seq, plan, budget):
                continue
            n = self._piece(seq, min(seq.num_pending, budget), budget)
            if n > 0:
                plan.chunks.append((seq, n))
                budget -= n
                seq.steps_passed_over = 0
        return plan

    def _admit_waiting(self, plan: StepPlan) -> None:
        i = 0
        while i < len(self.waiting) and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if self.cache is not None and self._parked(seq):
                i += 1  # waits for a running sequence to snapshot their shared prefix; others go on
                continue
            if not self._admit(seq, plan):
                break  # the head waits for room; nobody overtakes it
            del self.waiting[i]

    def _piece(self, seq: Sequence, n: int, budget: int) -> int:
        """How many of the ``n`` tokens offered ``seq`` runs (``budget``: what is left of the step): a cut
        ends on a delta-rule chunk boundary and at the next snapshot point (the one before it, if inside,
        is captured: ``seq.capture_at``); a sliver of leftover budget runs nothing."""
        if DELTA_RULE_CHUNK <= n < seq.num_pending:  # (steps under a chunk are cut anywhere)
            n = _chunk_aligned(seq.num_computed, n, min(seq.num_pending, budget) - n)
        at_point = False
        seq.capture_at = 0
        if seq.prefix is not None and seq.prefix.points:
            points = seq.prefix.points
            to_point = points[0] - seq.num_computed
            if to_point < n:  # the next snapshot point falls inside the piece: its state is kept there
                seq.capture_at = to_point
                points = points[1:]  # and the one after it, if also inside, ends the piece
            if points:
                to_point = points[0] - seq.num_computed
                at_point = n >= to_point
                n = min(n, to_point)
        min_piece = min(DELTA_RULE_CHUNK, self.token_budget // 4)
        if n < min_piece and n < seq.num_pending and not at_point:
            seq.capture_at = 0
            return 0  # a step's fixed cost for a few tokens, and a cut chunk
        return n

    def _by_priority(self, busy: Collection[Sequence]) -> list[Sequence]:
        """Running sequences, but those of ``busy``, in the order they get tokens: starved ones (oldest
        first), then the rest by remaining work (ties in admission order)."""
        live = [seq for seq in self.running if not seq.cancel_requested and seq not in busy]
        starved = [seq for seq in live if seq.steps_passed_over >= STARVATION_STEPS]
        rest = sorted((seq for seq in live if seq.steps_passed_over < STARVATION_STEPS),
                      key=lambda seq: seq.num_pending)
        return starved + rest

    def _admit(self, seq: Sequence, plan: StepPlan) -> bool:
        """Reserve what ``seq`` needs (resuming from the cache when it can); False when there is no room."""
        cache = self.cache
        hit = cache.match(seq) if cache is not None else None
        if cache is not None and hit is not None and hit.position == seq.num_tokens:
            seq.prefix.resume = cache.acquire(hit, whole=True, keep_hidden=seq.keep_hidden)
            seq.num_computed = seq.num_cached = seq.num_tokens
            seq.status = Status.FINISHED
            plan.admitted.append(seq)
            plan.finished.append(seq)
            return True
        shared = len(hit.path) if hit is not None else 0
        fresh = self.blocks_for(seq.num_tokens) - shared
        if self.slots.num_free == 0:
            return False
        if not self.blocks.can_allocate(fresh):
            if cache is None:
                return False
            reclaimable = cache.reclaimable_blocks - (cache.path_cache_only(hit) if hit is not None else 0)
            if self.blocks.num_free + reclaimable < fresh:
                return False
        resume = None
        if cache is not None and hit is not None:
            resume = cache.acquire(hit, whole=False, keep_hidden=seq.keep_hidden)  # shares the blocks first
        if cache is not None:
            cache.reclaim(fresh)
        seq.block_table = (resume.blocks if resume is not None else []) + self.blocks.allocate(fresh)
        seq.slot = self.slots.allocate()
        seq.status = Status.RUNNING
        if cache is not None:
            info = cache.track(seq)
            info.resume = resume
            seq.num_computed = seq.num_cached = resume.position if resume is not None else 0
            info.points = [p for p in seq.snapshot_points
                           if seq.num_computed < p <= seq.num_tokens and not cache.has_point(seq, p)]
        self.running.append(seq)
        plan.admitted.append(seq)
        return True

    def _parked(self, seq: Sequence) -> bool:
        """Whether ``seq`` should wait for a running sequence that is about to snapshot a longer prefix of
        it than the cache holds now (then it resumes from there instead of computing the prefix too)."""
        assert self.cache is not None
        info = self.cache.track(seq)
        if info.parked_on is not None:
            other, point = info.parked_on
            if other.status is Status.RUNNING and not other.cancel_requested and other.num_computed < point:
                return True
            info.parked_on = None
        if not self.running:
            return False
        hit = self.cache.match(seq)
        have = hit.position if hit is not None else 0
        best: tuple[Sequence, int] | None = None
        for other in self.running:
            points = other.prefix.points if other.prefix is not None else []
            if other.cancel_requested or not points or points[-1] <= have:
                continue
            if seq.keep_hidden and not other.keep_hidden:
                continue
            common = info.common.get(other.seq_id)
            if common is None:
                common = info.common[other.seq_id] = self._common_prefix(seq, other)
            for p in points:
                if have < p <= common and p <= seq.num_tokens and (best is None or p > best[1]):
                    best = (other, p)
        info.parked_on = best
        return best is not None

    def _common_prefix(self, a: Sequence, b: Sequence) -> int:
        """Leading tokens the two sequences share, as the prefix cache compares them (whole blocks first,
        as tuples: a few microseconds where tensor ops took tens, asked for every new pair of sequences)."""
        assert self.cache is not None
        info_a, info_b = self.cache.track(a), self.cache.track(b)
        blocks = 0
        for key_a, key_b in zip(info_a.keys, info_b.keys, strict=False):
            if key_a != key_b:
                break
            blocks += 1
        tokens_a, tokens_b = info_a.tokens, info_b.tokens
        end = min(len(tokens_a), len(tokens_b))
        i = blocks * self.cache.block_size
        while i < end and tokens_a[i] == tokens_b[i]:
            i += 1
        return i

    def complete(self, plan: StepPlan) -> list[Sequence]:
        """Advance the step's sequences, snapshot those at a snapshot point; release and return those
        whose last token has run."""
        done = []
        for seq, n in plan.chunks:
            if seq.status is not Status.RUNNING:
                continue
            inside = seq.num_computed + seq.capture_at if seq.capture_at else None
            seq.num_computed += n
            if self.cache is not None and seq.prefix is not None:
                points = seq.prefix.points
                while points and points[0] <= seq.num_computed:
                    point = points.pop(0)
                    if point == seq.num_computed:
                        self._snapshot(seq, point)
                    elif point == inside and seq.captured is not None:
                        self._snapshot(seq, point, seq.captured)
            seq.capture_at, seq.captured = 0, None
            if seq.is_done:
                seq.status = Status.FINISHED
                self._release(seq)
                done.append(seq)
        if self.cache is not None:
            self.cache.enforce_budget()
        return done

    def _snapshot(self, seq: Sequence, position: int,
                  states: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        assert self.cache is not None
        try:
            self.cache.insert(seq, position, states)
        except Exception:  # the cache is an optimisation: the sequence goes on without the entry
            log.exception("prefix cache: no snapshot of sequence %d at %d", seq.seq_id, position)

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
        if self.cache is not None:
            if seq.prefix is not None:
                seq.prefix.resume = None
            self.cache.enforce_budget()  # blocks only the cache holds now count against its budget


def _chunk_aligned(computed: int, n: int, room: int) -> int:
    """Where a cut leaves a sequence unfinished, end it on a delta-rule chunk boundary (absolute positions):
    a chunk cut in two is computed in full by both pieces, and with long records held to a quarter of the
    budget beside short ones, unaligned cuts cost ~10% more delta-rule time. Up to the boundary when
    ``room`` (tokens the step could still give it) allows, else down to it unless that drops over a quarter
    of ``n``."""
    end = computed + n
    up = -end % DELTA_RULE_CHUNK
    if up <= room:
        return n + up
    down = end % DELTA_RULE_CHUNK
    return n - down if 4 * (n - down) >= 3 * n else n
