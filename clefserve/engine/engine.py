"""The engine: a worker thread owns the model and runs schedule -> forward -> finish, step after step.

Other threads only submit, cancel and read stats; every scheduler and pool change happens under one lock,
and the forward itself runs outside it. When sequences finish in a step, ``finish`` is called once with all
of them (a decision head batches there) and each future gets its element of the returned list.
Background work (the live audit) runs on the worker only while no sequence waits or runs, one bounded piece
at a time (:meth:`Engine.set_idle_work`).

On a CPU with two or more intra-op threads a second worker (lane 1) runs a step beside the first one's,
over other sequences, while the first has one in flight; the two share the threads
(:mod:`clefserve.engine.lanes`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from clefserve.config import EngineConfig
from clefserve.engine.errors import EngineClosedError, StepError
from clefserve.engine.host_malloc import keep_freed_memory, prefault_heap
from clefserve.engine.kv_pool import KVPool
from clefserve.engine.lanes import MAX_LANES, ThreadShare
from clefserve.engine.memory import MIB, MemoryBudget, PoolPlan, measure_memory, plan_pools
from clefserve.engine.openmp import release_thread_team
from clefserve.engine.prefix_cache import PrefixCache
from clefserve.engine.runner import ModelRunner
from clefserve.engine.scheduler import Scheduler, StepPlan
from clefserve.engine.sequence import FinishedSequence, Sequence, Status
from clefserve.engine.state_pool import StatePool
from clefserve.engine.subnormals import flush_subnormals_here
from clefserve.errors import RequestError
from clefserve.model.backbone import Backbone
from clefserve.model.inputs import InputsProvider, SequenceInputs

log = logging.getLogger(__name__)

FinishFn = Callable[[list[FinishedSequence]], list[Any]]


class IdleWork(Protocol):
    def pending(self) -> bool:
        """Whether there is work left (cheap; called under the engine's lock)."""
        ...

    def run_piece(self) -> None:
        """One bounded piece of it, on the worker thread, outside the lock; must not raise."""
        ...


class Lane:
    """One worker thread of the engine and the sequences of the steps it has in flight."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.in_flight: set[Sequence] = set()
        self.seconds_in_inner_steps = 0.0  # its thread only: time in steps run inside paused ones
        # steps of short records it started and ended (inner ones too), under the engine's lock: a long step
        # on another lane holds at its next layer boundary until the ones in flight then have ended
        self.short_steps_started = 0
        self.short_steps_ended = 0
        self.thread: threading.Thread | None = None

    def short_step_in_flight(self) -> bool:
        return self.short_steps_ended < self.short_steps_started


class Engine:
    def __init__(
        self,
        model: Backbone,
        config: EngineConfig,
        finish: FinishFn,
        memory_budget_bytes: int | MemoryBudget | None = None,
    ) -> None:
        """``memory_budget_bytes``: what the pools may use (see :func:`~clefserve.engine.memory.plan_pools`);
        measured on the device when None (on a GPU: after a warm-up step)."""
        mc = model.config
        self.model, self.config, self.finish = model, config, finish
        if model.device.type == "cpu":
            keep_freed_memory()
        budget = memory_budget_bytes
        if budget is None:
            budget = measure_memory(model, config)
        self.pools: PoolPlan = plan_pools(mc, config, model.dtype, model.device, budget)
        # plain tensors even when built under inference_mode: the worker updates them in place
        with torch.inference_mode(False):
            self.kv = KVPool(
                len(mc.full_layers), self.pools.num_blocks, config.block_size,
                mc.num_key_value_heads, mc.head_dim, model.dtype, model.device,
            )
            self.states = StatePool(
                self.pools.gdn_slots, len(mc.linear_layers), mc.conv_dim, mc.linear_conv_kernel_dim,
                mc.linear_num_value_heads, mc.linear_key_head_dim, mc.linear_value_head_dim,
                model.dtype, model.device,
            )
        self.runner = ModelRunner(model, self.kv, self.states)
        if model.device.type == "cpu":
            self._fault_in_pools(config)
            log.info("threads: %d intra-op thread(s)", torch.get_num_threads())
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_cache:
            self.prefix_cache = PrefixCache(
                self.kv, self.states, self.pools.prefix_cache_bytes, mc.hidden_size, model.dtype
            )
            log.info("prefix cache: %.0f MiB budget, GDN snapshots of %.2f MiB at segment and prompt ends",
                     self.pools.prefix_cache_bytes / MIB, self.prefix_cache.state_bytes / MIB)
        else:
            log.info("prefix cache: off (--no-prefix-cache)")
        self.scheduler = Scheduler(
            self.kv.allocator, self.states.allocator, config.block_size, config.max_num_seqs,
            config.prefill_chunk_size, config.max_queue, config.max_length, self.prefix_cache,
            pauses_long_steps=config.layer_preemption,
        )
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._to_reap: list[Sequence] = []  # running sequences cancelled from other threads
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()  # run on the worker between steps
        self._idle_work: IdleWork | None = None
        threads = torch.get_num_threads()
        lanes = min(config.cpu_lanes, MAX_LANES, threads) if model.device.type == "cpu" else 1
        self.lanes = [Lane(i) for i in range(max(1, lanes))]
        self._share = ThreadShare(threads, self._wake) if len(self.lanes) > 1 else None
        self._trace: deque[tuple[tuple[int, int], ...]] = deque(maxlen=512)
        self._counts = dict.fromkeys(
            ("steps", "multi_seq_steps", "paused_steps", "held_steps", "side_steps", "prefill_tokens",
             "finished", "cancelled_waiting", "cancelled_running", "failed", "rejected"),
            0,
        )
        if model.device.type == "cpu":
            # zeroing and faulting in the pools ran parallel regions here: the calling thread's idle OpenMP
            # team would make the engine's wait on the kernel in every op (clefserve.engine.openmp)
            release_thread_team()
        if len(self.lanes) > 1:
            log.info("CPU lanes: up to %d steps at once, sharing %d intra-op threads", len(self.lanes),
                     threads)
        for lane in self.lanes:
            name = "engine" if lane.index == 0 else f"engine-lane-{lane.index}"
            lane.thread = threading.Thread(target=self._loop, args=(lane,), name=name, daemon=True)
        self._thread = self.lanes[0].thread
        for lane in self.lanes:
            lane.thread.start()

    # ---- client side (any thread) ----

    def submit(
        self,
        token_ids: Iterable[int] | torch.Tensor,
        payload: Any = None,
        keep_hidden: bool = True,
        snapshot_points: Iterable[int] | None = None,
        inputs: SequenceInputs | InputsProvider | None = None,
        cache_keys: list | None = None,
    ) -> Future:
        """Queue one sequence; the future resolves to ``finish``'s value for it.

        ``snapshot_points``: positions worth a prefix-cache resume point (a format's segment ends); the
        end of the prompt always is one. Points outside ``1..len`` are ignored.
        ``inputs``: rows replacing some token embeddings and M-RoPE positions (pictures), or a provider the
        worker calls at admission with the first position to compute; ``cache_keys``: one hashable per
        token that the prefix cache compares instead of the ids (so the content of a picture, not just its
        placeholder ids, decides a match). Both cover the whole sequence.
        Raises :class:`RequestError` at once for a record that can never run (413 ``tokens_exceeded``) or a
        full queue (429 ``overloaded``, :class:`~clefserve.engine.errors.QueueFullError`).
        """
        if not isinstance(token_ids, torch.Tensor):
            token_ids = torch.tensor(list(token_ids), dtype=torch.long)
        ids = token_ids.to(torch.long)
        if ids.dim() != 1:
            raise RequestError("token ids must be one flat list", status=422, error_type="invalid_request")
        vocab = self.model.config.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise RequestError(f"token ids must lie in [0, {vocab})", 422, "invalid_request")
        n = int(ids.numel())
        if cache_keys is not None and len(cache_keys) != n:
            raise ValueError(f"cache_keys has {len(cache_keys)} entries for {n} tokens")
        if isinstance(inputs, SequenceInputs) and inputs.positions is not None \
                and inputs.positions.shape != (3, n):
            raise ValueError(f"positions of shape {tuple(inputs.positions.shape)} for {n} tokens")
        points = {int(p) for p in (snapshot_points or ())} | {n}
        seq = Sequence(ids, payload, keep_hidden, tuple(sorted(p for p in points if 0 < p <= n)), inputs,
                       cache_keys)
        with self._lock:
            if self.closed:
                raise EngineClosedError("the engine is shut down")
            try:
                self.scheduler.add(seq)
            except RequestError:
                self._counts["rejected"] += 1
                raise
            self._wake.notify_all()
        seq.future.add_done_callback(lambda fut: self._on_done(seq, fut))
        return seq.future

    def cancel(self, future: Future) -> bool:
        """Drop a submitted sequence (client gone), freeing its blocks and slot; as ``future.cancel()``."""
        return future.cancel()

    @property
    def closed(self) -> bool:
        """Shut down (or the worker thread is gone): submit refuses new sequences."""
        return self._closed or not self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = self._counts
            return {
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
                "kv_blocks_free": self.kv.allocator.num_free,
                "kv_blocks_total": self.kv.num_blocks,
                "kv_block_size": self.kv.block_size,
                "kv_tokens_total": self.kv.token_capacity,
                "kv_bytes": self.pools.kv_bytes,
                "gdn_slots_free": self.states.allocator.num_free,
                "gdn_slots_total": self.states.allocator.num_slots,
                "gdn_bytes": self.pools.gdn_bytes,
                "cancelled": c["cancelled_waiting"] + c["cancelled_running"],
                "tokens_per_second": self.scheduler.tokens_per_second,
                "cpu_lanes": len(self.lanes),
                **c,
                **self._prefix_stats(),
            }

    def _prefix_stats(self) -> dict[str, Any]:
        cache = self.prefix_cache
        stats = cache.stats() if cache is not None else {
            "prefix_hit_tokens": 0, "prefix_hits": 0, "prefix_evictions": 0, "prefix_cache_bytes": 0,
            "prefix_cache_budget_bytes": 0, "prefix_entries": 0, "prefix_blocks": 0,
            "prefix_blocks_cache_only": 0, "prefix_cached_tokens": 0,
        }
        return {"prefix_cache": cache is not None, "prefix_computed_tokens": self._counts["prefill_tokens"],
                **stats}

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix (between two steps); sequences in flight keep what they hold."""
        cache = self.prefix_cache
        if cache is None:
            return

        def clear() -> None:
            with self._lock:
                cache.clear()

        self.on_engine_thread(clear)

    def set_idle_work(self, work: IdleWork | None) -> None:
        """Run ``work`` on the worker thread while no sequence waits or runs, one piece per loop turn: the
        worker looks for live work between pieces, so a sequence that arrives waits at most one piece."""
        with self._lock:
            self._idle_work = work
            self._wake.notify_all()

    def recent_steps(self) -> list[tuple[tuple[int, int], ...]]:
        """The last steps' ``((seq_id, tokens), ...)``, oldest first (debugging, tests)."""
        with self._lock:
            return list(self._trace)

    def poison_free_memory(self, value: float = float("nan")) -> None:
        """Test hook: fill every free KV block and free GDN slot with ``value``, between two steps."""

        def poison() -> None:
            self.kv.fill_blocks(self.kv.allocator.free_ids(), value)
            self.states.fill_slots(self.states.allocator.free_ids(), value)

        self.on_engine_thread(poison)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the worker after its current step; unfinished futures fail with EngineClosedError."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with self._lock:
            self._reap()  # running sequences cancelled meanwhile count as cancelled, not failed
            left = [*self.scheduler.waiting, *self.scheduler.running]
            for seq in left:
                self.scheduler.remove(seq, Status.FAILED)
            calls = list(self._calls)
            self._calls.clear()
        closed = EngineClosedError("the engine shut down before this sequence finished")
        for seq in left:
            _set_exception(seq.future, closed)
        for _, fut in calls:
            _set_exception(fut, closed)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals ----

    def _on_done(self, seq: Sequence, fut: Future) -> None:
        if not fut.cancelled():
            return
        with self._lock:
            if seq.status is Status.WAITING:
                self.scheduler.remove(seq, Status.CANCELLED)
                self._counts["cancelled_waiting"] += 1
            elif seq.status is Status.RUNNING:
                seq.cancel_requested = True
                self._to_reap.append(seq)
                self._wake.notify_all()

    def _fault_in_pools(self, config: EngineConfig) -> None:
        """Fault in, before serving, the host pages of the GDN state pool and of the KV blocks that a full
        batch and the prefix cache can hold (the allocator hands out the lowest free blocks, so serving
        stays within them); blocks beyond are faulted in at admission (``KVPool.make_resident``). Without
        it, every step that writes fresh blocks faults their pages in one at a time (see there)."""
        started = time.perf_counter()
        self.states.conv.zero_()
        self.states.recurrent.zero_()
        kv = self.kv
        cached = self.pools.prefix_cache_bytes // max(1, kv.block_bytes)
        in_flight = config.max_num_seqs * kv.blocks_for(config.max_length)
        kv.make_resident(min(kv.num_blocks, cached + in_flight))
        log.info("pools: %.0f MiB of host pages faulted in before serving (%.1f s)",
                 (kv.resident_blocks * kv.block_bytes + self.pools.gdn_bytes) / MIB,
                 time.perf_counter() - started)

    def on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine's own thread, between steps, and return its result (right where it is
        called when that is the engine's thread or the engine is closed): for what must not race a step,
        and for what works per thread, such as a profiler that records the ops of the thread that started
        it."""
        fut: Future = Future()
        with self._lock:
            if self._closed or threading.current_thread() is self._thread or not self._thread.is_alive():
                return fn()
            self._calls.append((fn, fut))
            self._wake.notify_all()
        return fut.result()

    def _loop(self, lane: Lane) -> None:
        if self.model.device.type == "cpu":
            flushed = flush_subnormals_here()
            if lane.index == 0:
                log.info("subnormal floats on the engine thread: %s",
                         "flushed to zero" if flushed else "kept")
                if self.prefix_cache is not None:
                    self._grow_heap_for_cache()
        with torch.inference_mode():
            self._serve(lane)
        with self._wake:  # shut down: a lane waiting for room beside this one must not wait forever
            self._rest(lane)

    def _grow_heap_for_cache(self) -> None:
        """Before serving, on the worker thread, whose heap the prefix cache's snapshots and hidden rows come
        from: grow that heap by what the cache can hold there, so that filling it reuses pages instead of
        faulting them in one at a time inside the forward's parallel region (a page written in bulk costs
        ~1 us, one faulted in by a step's threads 5-15 us; see
        :func:`~clefserve.engine.host_malloc.prefault_heap`). What it can hold there: its budget, and no more
        than the KV pool's size (it holds at most the pool's blocks, and its hidden rows and GDN snapshots
        for those tokens are of the order of their K/V, a quarter of it on Clef's shapes)."""
        started = time.perf_counter()
        try:
            grown = prefault_heap(min(self.pools.prefix_cache_bytes, self.pools.kv_bytes))
        except Exception:  # e.g. no memory for it now: serve anyway; the cache grows the heap as it fills
            log.warning("could not grow the engine thread's heap for the prefix cache", exc_info=True)
            return
        if grown:
            log.info("prefix cache: %.0f MiB of the engine thread's heap faulted in before serving (%.2f s)",
                     grown / MIB, time.perf_counter() - started)

    def _serve(self, lane: Lane) -> None:
        while not self._closed:
            try:
                self._iteration(lane)
            except Exception as exc:  # a bug, not a bad request: fail what is in flight, keep serving
                log.exception("engine loop error; failing the sequences in flight")
                with self._lock:
                    lane.in_flight.clear()
                    elsewhere = self._busy()  # what another lane is running is left to it
                    in_flight = [seq for seq in (*self.scheduler.running, *self.scheduler.waiting)
                                 if seq not in elsewhere]
                self._fail([(seq, exc) for seq in in_flight])

    def _busy(self) -> set[Sequence]:
        """The sequences of the steps in flight, on every lane (with the lock held)."""
        if len(self.lanes) == 1:
            return self.lanes[0].in_flight
        return set().union(*(lane.in_flight for lane in self.lanes))

    def _has_work_for(self, lane: Lane) -> bool:
        """Whether ``lane`` has something to do now (with the lock held). Lane 0 runs the calls, reaps and
        runs the idle work; a further lane plans a step only while the lane before it has one in flight, so
        a lone stream of records stays on lane 0, a second lane's steps run beside another step, and none
        runs beside idle work (which lane 0 runs with nothing in flight)."""
        if lane.index == 0:
            if self._calls or any(seq not in self._busy() for seq in self._to_reap):
                return True
        elif not self.lanes[lane.index - 1].in_flight:
            return False
        return self.scheduler.has_runnable(self._busy())

    def _iteration(self, lane: Lane) -> None:
        with self._wake:
            while not (self._closed or self._has_work_for(lane)):
                if lane.index == 0 and self._idle_work is not None and self._idle_work.pending() \
                        and not self._busy():
                    break
                self._rest(lane)
                self._wake.wait()
            if self._closed:
                return
            plan = None
            if self._has_work_for(lane):
                if lane.index == 0:
                    self._run_calls()
                    self._reap()
                plan = self.scheduler.schedule(self._busy())
                self._take(lane, plan)
            elif self._share is not None:  # idle work on lane 0, with nothing in flight anywhere
                self._share.enter(lane.index)
        if plan is None:
            if self._share is not None:
                self._share.apply(lane.index)  # every thread: no other lane starts a step meanwhile
            self._run_idle_piece()
            return
        self._run_plan(plan, lane)
        if not plan.chunks and not plan.finished and self.scheduler.has_work():
            with self._wake:  # nothing runnable (only cancelled sequences left); do not spin
                self._rest(lane)  # nor hold threads a lane resuming a held step waits for
                self._wake.wait(0.01)

    def _take(self, lane: Lane, plan: StepPlan) -> None:
        """``lane`` runs ``plan`` (with the lock held): its sequences are in flight there, and the lane is
        busy for the thread share."""
        lane.in_flight.update(plan.admitted)
        lane.in_flight.update(seq for seq, _ in plan.chunks)
        if self._share is not None and (plan.chunks or plan.admitted):
            self._share.enter(lane.index)

    def _rest(self, lane: Lane) -> None:
        """``lane`` waits for work (with the lock held): its threads go to the other lanes."""
        if self._share is not None and self._share.leave(lane.index):
            release_thread_team()

    def _run_plan(self, plan: StepPlan, lane: Lane, inside_another: bool = False) -> None:
        """Set up the admitted sequences, answer the wholly cached ones, run the step. ``inside_another``:
        it runs at a layer boundary of a paused step, and is not paused itself. While it runs a step of short
        records, long steps on the other lanes hold at their next layer boundary
        (:meth:`_hold_for_short_steps`)."""
        if not self._runs_short_records(plan):
            self._run_plan_body(plan, lane, inside_another, holds=True)
            return
        with self._wake:
            lane.short_steps_started += 1
        try:
            self._run_plan_body(plan, lane, inside_another, holds=False)
        finally:
            with self._wake:
                lane.short_steps_ended += 1
                self._wake.notify_all()  # a long step held for it goes on

    def _runs_short_records(self, plan: StepPlan) -> bool:
        """Whether ``plan`` is a step of short records that the other lanes' long steps make way for."""
        return (self._share is not None and self.config.layer_preemption
                and any(self.scheduler.is_short(seq) for seq, _ in plan.chunks))

    def _run_plan_body(self, plan: StepPlan, lane: Lane, inside_another: bool, holds: bool) -> None:
        """``holds``: a step of long records, which starts only once the other lanes' steps of short records
        in flight have ended."""
        if self._share is not None and not inside_another and (plan.chunks or plan.admitted):
            if holds and plan.chunks and self.config.layer_preemption:
                self._hold_for_short_steps(lane)
            self._share.apply(lane.index, wait=True)
        admitted_at = time.perf_counter()
        for seq in plan.admitted:
            seq.admitted_at = admitted_at
        self._prepare(plan)
        stepping = {seq for seq, _ in plan.chunks}
        if any(seq not in stepping for seq in plan.admitted):
            with self._wake:  # set up: another lane may give them tokens
                lane.in_flight.difference_update(seq for seq in plan.admitted if seq not in stepping)
                self._wake.notify_all()
        if plan.finished:
            self._finish_cached(plan.finished, lane)
        if plan.chunks:
            self._step(plan, lane, self._between_layers(plan, lane, inside_another))

    def _between_layers(self, plan: StepPlan, lane: Lane, inside_another: bool) -> Callable[[], None] | None:
        """The hook a step calls at its layer boundaries (between a layer's token mixer and its MLP, and
        between two layers): the lane takes its thread share there, and a step of long records pauses for
        short ones (:meth:`_short_records_between_layers`)."""
        pause = None if inside_another else self._short_records_between_layers(plan, lane)
        share = self._share
        if share is None:
            return pause
        index = lane.index

        def between_layers() -> None:
            if pause is not None:
                self._hold_for_short_steps(lane)
            share.apply(index)
            if pause is not None:
                pause()

        return between_layers

    def _hold_for_short_steps(self, lane: Lane) -> None:
        """At a layer boundary of a long step on ``lane``, or before it starts: while steps of short records
        run on other lanes, give them this lane's threads, and go on once those steps (not later ones) have
        ended. Short records are a small share of the work, and beside a long step on half the threads each
        takes ~1.5x as long as on all of them. A long step goes on to at least its next boundary per step of
        short records, so a stream of them slows it without starving it."""
        share = self._share
        assert share is not None
        with self._wake:
            awaited = {other.index: other.short_steps_started for other in self.lanes
                       if other is not lane and other.short_step_in_flight()}
            if not awaited:
                return
            self._counts["held_steps"] += 1
            if share.leave(lane.index):
                release_thread_team()
            while not self._closed and any(self.lanes[i].short_steps_ended < started
                                           for i, started in awaited.items()):
                self._wake.wait()
            share.enter(lane.index)
        share.apply(lane.index, wait=True)

    def _short_records_between_layers(self, plan: StepPlan, lane: Lane) -> Callable[[], None] | None:
        """For a step of long records only: a hook that, at a layer boundary, runs a step of the short
        records that arrived meanwhile (:meth:`Scheduler.schedule_short`), so they wait for a token mixer or
        an MLP rather than the whole step (on a CPU a 1,024-token step of a large model takes seconds). The
        paused step loses nothing: its sequences' state is theirs alone, and it resumes where it stopped."""
        if not self.config.layer_preemption or any(self.scheduler.is_short(seq) for seq, _ in plan.chunks):
            return None  # a step with a short record in it is short itself; it answers that record

        def run_short_records() -> None:
            inner = None
            try:
                with self._lock:
                    busy = self._busy()  # the paused step's sequences and any other lane's
                    if self._closed or not self.scheduler.has_short_work(busy):
                        return
                    inner = self.scheduler.schedule_short(busy)
                    self._take(lane, inner)
                if inner.chunks or inner.admitted:
                    if inner.chunks:
                        with self._lock:
                            self._counts["paused_steps"] += 1
                    started = time.perf_counter()
                    self._run_plan(inner, lane, inside_another=True)
                    lane.seconds_in_inner_steps += time.perf_counter() - started
            except Exception as exc:  # a bug: fail what the inner step took on, let the paused step go on
                log.exception("a step of short records inside a paused step failed")
                if inner is not None:
                    taken = {*inner.admitted, *(s for s, _ in inner.chunks)}
                    with self._lock:
                        lane.in_flight.difference_update(taken)
                    self._fail([(seq, exc) for seq in taken if seq.status is Status.RUNNING])

        return run_short_records

    def _run_idle_piece(self) -> None:
        work = self._idle_work
        if work is None:
            return
        try:
            work.run_piece()
        except Exception:  # it should not raise; if it does, live traffic must not notice
            log.exception("idle work failed; dropping it")
            with self._lock:
                if self._idle_work is work:
                    self._idle_work = None

    def _run_calls(self) -> None:
        while self._calls:
            fn, fut = self._calls.popleft()
            try:
                fut.set_result(fn())
            except Exception as exc:
                fut.set_exception(exc)

    def _reap(self) -> None:
        """Drop the cancelled running sequences, but those in another lane's step (reaped after it)."""
        busy = self._busy()
        for seq in self._to_reap:
            if seq not in busy and self.scheduler.remove(seq, Status.CANCELLED):
                self._counts["cancelled_running"] += 1
        self._to_reap = [seq for seq in self._to_reap if seq in busy]

    def _prepare(self, plan: StepPlan) -> None:
        failed = []
        for seq in plan.admitted:
            try:
                self.runner.prepare(seq)
            except Exception as exc:  # e.g. no memory for the hidden rows: only this sequence fails
                log.exception("could not set up sequence %d", seq.seq_id)
                failed.append((seq, exc))
        if failed:
            self._fail(failed)
            dropped = {id(seq) for seq, _ in failed}
            plan.chunks = [(s, n) for s, n in plan.chunks if id(s) not in dropped]
            plan.finished = [s for s in plan.finished if id(s) not in dropped]

    def _finish_cached(self, seqs: list[Sequence], lane: Lane) -> None:
        """Sequences whose whole prompt came from the prefix cache: nothing to run, finish them now."""
        now = time.perf_counter()
        for seq in seqs:
            seq.finished_at = now
        live = [seq for seq in seqs if seq.future.set_running_or_notify_cancel()]
        if len(live) < len(seqs):
            with self._lock:
                self._counts["cancelled_running"] += len(seqs) - len(live)
        if live:
            self._finish(live, lane)

    def _step(self, plan: StepPlan, lane: Lane, between_layers: Callable[[], None] | None = None) -> None:
        started, inner_before = time.perf_counter(), lane.seconds_in_inner_steps
        try:
            self.runner.run(plan.chunks, between_layers)
        except Exception as exc:
            # the GDN state of every sequence in the step may be half-updated: fail them all
            log.exception("engine step failed (%d sequences, %d tokens)", len(plan.chunks), plan.num_tokens)
            self._fail([(seq, exc) for seq, _ in plan.chunks])
            return
        ended = time.perf_counter()
        elapsed = ended - started - (lane.seconds_in_inner_steps - inner_before)
        with self._wake:
            done = self.scheduler.complete(plan)
            lane.in_flight.difference_update(seq for seq, _ in plan.chunks)
            self._account(plan, elapsed, lane)
            if len(self.lanes) > 1:
                self._wake.notify_all()  # another lane may give these sequences their next tokens
        for seq in done:
            seq.finished_at = ended
        live = [seq for seq in done if seq.future.set_running_or_notify_cancel()]
        if len(live) < len(done):
            with self._lock:
                self._counts["cancelled_running"] += len(done) - len(live)
        if live:
            self._finish(live, lane)

    def _account(self, plan: StepPlan, elapsed: float, lane: Lane) -> None:
        c = self._counts
        c["steps"] += 1
        if lane.index > 0:
            c["side_steps"] += 1
        c["prefill_tokens"] += plan.num_tokens
        if len(plan.chunks) > 1:
            c["multi_seq_steps"] += 1
        self._trace.append(tuple((seq.seq_id, n) for seq, n in plan.chunks))
        busy_lanes = len(self._share.busy) if self._share is not None else 1  # each ran on a share of the CPU
        rate = plan.num_tokens / max(elapsed, 1e-6) * max(1, busy_lanes)
        tps = self.scheduler.tokens_per_second
        self.scheduler.tokens_per_second = rate if tps == 0 else 0.8 * tps + 0.2 * rate

    def _finish(self, seqs: list[Sequence], lane: Lane) -> None:
        if self._share is not None:  # the head runs on the lane's share too
            self._share.apply(lane.index)
        finished = [
            FinishedSequence(s.seq_id, s.payload, s.token_ids, s.hidden, s.submitted_at,
                             s.admitted_at or s.submitted_at, s.finished_at or time.perf_counter(),
                             s.num_cached)
            for s in seqs
        ]
        for seq in seqs:
            seq.hidden = None
        try:
            results = self.finish(finished)
            if len(results) != len(seqs):
                raise StepError(f"finish returned {len(results)} results for {len(seqs)} sequences")
        except Exception as exc:
            log.exception("finish callback failed for %d sequences", len(seqs))
            with self._lock:
                self._counts["failed"] += len(seqs)
            for seq in seqs:
                _set_exception(seq.future, exc)
            return
        with self._lock:
            self._counts["finished"] += len(seqs)
        for seq, result in zip(seqs, results, strict=True):
            if isinstance(result, BaseException):
                _set_exception(seq.future, result)
            else:
                seq.future.set_result(result)

    def _fail(self, failures: list[tuple[Sequence, Exception]]) -> None:
        with self._wake:
            for seq, _ in failures:
                self.scheduler.remove(seq, Status.FAILED)
                for lane in self.lanes:
                    lane.in_flight.discard(seq)
            self._counts["failed"] += len(failures)
            self._wake.notify_all()
        for seq, exc in failures:
            _set_exception(seq.future, exc)


def _set_exception(fut: Future, exc: BaseException) -> None:
    """Fail a future unless it is already resolved or was cancelled."""
    if fut.done() or (not fut.running() and not fut.set_running_or_notify_cancel()):
        return
    fut.set_exception(exc)
