"""Prefix cache for hybrid (Gated DeltaNet + attention) models and heads that read every position.

A sequence can skip its first ``P`` tokens only with all three of:

- the attention K/V of positions ``< P``: full blocks are shared, block granular, through a chain of
  blocks keyed by their token ids (a trie: a child is found by the exact tuple of its block's tokens under
  its parent, so a match is token-for-token equal, never a hash collision). The cache holds one reference
  to each block (``BlockAllocator.cache_hold``), a resumed sequence one more of its own;
- the GDN conv + fp32 recurrent state exactly at ``P``: a *snapshot*, taken only at chosen resume points
  (the record encoder's segment ends and the end of every prompt), never at every block;
- the final hidden rows of positions ``< P`` (the Clef head reads every position): kept per block node
  and, for the tail, in the snapshot.

A resume point ``P`` rarely falls on a block boundary. The K/V of the ``P % block_size`` positions of the
cut block are copied into the snapshot; a resumed sequence gets a fresh block there and the copy is
written into it, so it can write its own positions ``>= P`` into that block while other sequences keep
theirs. So resume points need no alignment and blocks are never written by two sequences.

Memory: the byte budget counts snapshots, hidden rows, and the KV blocks held *only* by the cache (a block
a running sequence also holds costs nothing extra). Eviction is LRU over snapshots; a block node lives as
long as some snapshot at or below it (a node without one can never be resumed from), so evicting a
snapshot prunes the nodes it alone kept. Running sequences hold their own references and copies, so
evicting never takes anything from a sequence in flight.

Only the engine's worker thread changes the cache (under the engine lock); other threads read ``stats``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from clefserve.engine.kv_pool import KVPool
from clefserve.engine.state_pool import StatePool
from clefserve.errors import all_finite

if TYPE_CHECKING:
    from clefserve.engine.sequence import Sequence


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Node:
    """One full KV block of a cached prefix: the block holding positions ``depth*bs .. depth*bs+bs-1``."""

    __slots__ = ("block", "children", "depth", "hidden", "key", "parent", "snapshots")

    def __init__(self, parent: Node | None, key: tuple[int, ...], depth: int, block: int) -> None:
        self.parent, self.key, self.depth, self.block = parent, key, depth, block
        self.hidden: torch.Tensor | None = None  # [bs, H] final hidden rows of the block's positions
        self.children: dict[tuple[int, ...], Node] = {}
        self.snapshots: dict[tuple[int, ...], Snapshot] = {}  # by the tokens after this node's block


class Snapshot:
    """Everything that continues a sequence at ``position`` beyond the shared full blocks."""

    __slots__ = ("conv", "nbytes", "node", "position", "recurrent", "tail", "tail_hidden", "tail_k", "tail_v")

    def __init__(self, node: Node, tail: tuple[int, ...], position: int) -> None:
        self.node, self.tail, self.position = node, tail, position
        self.conv = self.recurrent = self.tail_k = self.tail_v = torch.empty(0)
        self.tail_hidden: torch.Tensor | None = None  # [len(tail), H]
        self.nbytes = 0


@dataclass
class Hit:
    """A match: resume at ``snapshot.position`` over the full blocks of ``path``."""

    snapshot: Snapshot
    path: list[Node]

    @property
    def position(self) -> int:
        return self.snapshot.position


@dataclass
class Resume:
    """What a sequence admitted from the cache copies before its first step (kept alive by this object,
    even if the cache evicts the entry meanwhile)."""

    position: int
    blocks: list[int]  # shared full blocks; the sequence holds its own reference to each
    hidden: list[torch.Tensor] | None  # hidden rows of positions < position, in order
    conv: torch.Tensor | None  # None for a whole-prompt hit (nothing left to run)
    recurrent: torch.Tensor | None
    tail_k: torch.Tensor | None  # [attention layers, position % bs, kv heads, head dim]
    tail_v: torch.Tensor | None


@dataclass
class SeqPrefix:
    """A sequence's bookkeeping for the cache: its tokens and block keys, snapshot points still ahead."""

    tokens: list  # token ids, or the sequence's cache keys
    keys: list[tuple]  # the token tuples of its full blocks
    points: list[int] = field(default_factory=list)  # ascending; taken when num_computed reaches them
    resume: Resume | None = None
    parked_on: tuple[Sequence, int] | None = None  # waits for this running sequence to reach this point
    # leading tokens shared with other sequences, by their seq_id (asked again at every admission round)
    common: dict[int, int] = field(default_factory=dict)
    finite_rows: int = 0  # its hidden rows before this are known finite (checked at an earlier snapshot)


class PrefixCache:
    def __init__(self, kv: KVPool, states: StatePool, budget_bytes: int, hidden_size: int,
                 hidden_dtype: torch.dtype) -> None:
        self.kv, self.states, self.allocator = kv, states, kv.allocator
        self.block_size = kv.block_size
        self.budget_bytes = int(budget_bytes)
        self.block_bytes = _nbytes(kv.k[:, 0], kv.v[:, 0])
        row = torch.empty((), dtype=hidden_dtype).element_size() * hidden_size
        self.row_bytes = row  # one hidden row
        self.state_bytes = _nbytes(states.conv[0], states.recurrent[0])
        self.tail_row_bytes = self.block_bytes // max(1, self.block_size) + row
        self.root = Node(None, (), -1, -1)
        self._lru: OrderedDict[Snapshot, None] = OrderedDict()
        self.snapshot_bytes = 0
        self.hidden_bytes = 0
        self.num_nodes = 0
        self.counts = dict.fromkeys(("prefix_hit_tokens", "prefix_hits", "prefix_evictions",
                                     "prefix_inserted", "prefix_skipped_too_large",
                                     "prefix_skipped_non_finite"), 0)

    # ---- per sequence ----

    def track(self, seq: Sequence) -> SeqPrefix:
        if seq.prefix is None:
            # the sequence's cache keys when it has them: a picture's tokens as (digest, index), so two
            # pictures with equal placeholder ids never share blocks, snapshots or hidden rows
            tokens = list(seq.cache_keys) if seq.cache_keys is not None else seq.token_ids.tolist()
            bs = self.block_size
            keys = [tuple(tokens[i : i + bs]) for i in range(0, len(tokens) - bs + 1, bs)]
            seq.prefix = SeqPrefix(tokens, keys)
        return seq.prefix

    def match(self, seq: Sequence) -> Hit | None:
        """The deepest cached resume point whose tokens equal the sequence's (``<= num_tokens``), with
        every block before it cached; with hidden rows too when the sequence keeps them."""
        info = self.track(seq)
        need_hidden = seq.keep_hidden
        n = seq.num_tokens
        node, path = self.root, []
        best: Hit | None = None
        snap = self._best_snapshot(node, info.tokens, 0, n, need_hidden)
        if snap is not None:
            best = Hit(snap, [])
        for key in info.keys:
            child = node.children.get(key)
            if child is None or (need_hidden and child.hidden is None):
                break
            path.append(child)
            node = child
            snap = self._best_snapshot(node, info.tokens, (node.depth + 1) * self.block_size, n, need_hidden)
            if snap is not None:
                best = Hit(snap, list(path))
        return best

    def _best_snapshot(self, node: Node, tokens: list[int], start: int, n: int,
                       need_hidden: bool) -> Snapshot | None:
        if not node.snapshots:
            return None
        best = None
        if len(node.snapshots) <= self.block_size:
            for tail, snap in node.snapshots.items():
                end = start + len(tail)
                if end > n or (best is not None and len(tail) <= len(best.tail)):
                    continue
                if tuple(tokens[start:end]) == tail and (snap.tail_hidden is not None or not need_hidden):
                    best = snap
            return best
        for r in range(min(self.block_size - 1, n - start), -1, -1):
            snap = node.snapshots.get(tuple(tokens[start : start + r]))
            if snap is not None and (snap.tail_hidden is not None or not need_hidden):
                return snap
        return None

    def has_point(self, seq: Sequence, position: int) -> bool:
        """A snapshot exactly at ``position`` of the sequence's tokens (with hidden rows if it keeps them)."""
        info = self.track(seq)
        node = self.root
        full = position // self.block_size
        for key in info.keys[:full]:
            node = node.children.get(key)
            if node is None or (seq.keep_hidden and node.hidden is None):
                return False
        snap = node.snapshots.get(tuple(info.tokens[full * self.block_size : position]))
        return snap is not None and (snap.tail_hidden is not None or not seq.keep_hidden)

    def path_cache_only(self, hit: Hit) -> int:
        """Blocks of the hit held only by the cache (sharing them makes them unavailable to reclaim)."""
        return sum(self.allocator.refs(node.block) == 1 for node in hit.path)

    def acquire(self, hit: Hit, whole: bool, keep_hidden: bool) -> Resume:
        """Take the hit for a sequence being admitted: share its blocks (unless ``whole``: nothing is left
        to run, only the hidden rows are needed) and mark the snapshot as recently used."""
        snap = self._touch(hit.snapshot)
        blocks = [node.block for node in hit.path]
        if not whole:
            for b in blocks:
                self.allocator.share(b)
        hidden = None
        if keep_hidden:
            hidden = [node.hidden for node in hit.path]
            if snap.tail:
                hidden.append(snap.tail_hidden)
        self.counts["prefix_hits"] += 1
        self.counts["prefix_hit_tokens"] += snap.position
        if whole:
            return Resume(snap.position, [], hidden, None, None, None, None)
        return Resume(snap.position, blocks, hidden, snap.conv, snap.recurrent, snap.tail_k, snap.tail_v)

    # ---- taking snapshots ----

    def insert(self, seq: Sequence, position: int,
               states: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """Cache the sequence's prefix up to ``position``, right after a step that ran it: the full blocks
        (shared), and a snapshot of its GDN state, tail K/V and tail hidden rows. The GDN state is the
        slot's (``position`` = ``num_computed``) or ``states`` (conv, recurrent) kept inside the step."""
        if self.state_bytes + position * self.tail_row_bytes > self.budget_bytes:
            self.counts["prefix_skipped_too_large"] += 1
            return False  # could never be held whole: do not evict everything else for it
        if not self._finite(seq, position, states):
            # the record fails on its own (a non-finite answer); no other may resume from its values. A
            # point inside a step can see them too: a later NaN key times its zero attention weight is NaN
            self.counts["prefix_skipped_non_finite"] += 1
            return False
        try:
            return self._insert(seq, position, states)
        except BaseException:
            self._prune_all()  # e.g. out of memory on a copy: drop nodes no snapshot keeps
            raise

    def _finite(self, seq: Sequence, position: int, states: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
        assert seq.slot is not None
        conv, recurrent = states or (self.states.conv[seq.slot], self.states.recurrent[seq.slot])
        info = self.track(seq)
        checked = min(info.finite_rows, position)  # rows of earlier steps do not change
        parts = [conv, recurrent] + ([seq.hidden[checked:position]] if seq.hidden is not None else [])
        if not all_finite(parts):
            return False
        info.finite_rows = max(info.finite_rows, position)
        return True

    def _insert(self, seq: Sequence, position: int,
                states: tuple[torch.Tensor, torch.Tensor] | None) -> bool:
        info = self.track(seq)
        bs = self.block_size
        full, r = divmod(position, bs)
        hidden = seq.hidden
        node = self.root
        for d in range(full):
            key = info.keys[d]
            child = node.children.get(key)
            if child is None:
                child = Node(node, key, d, seq.block_table[d])
                self.allocator.cache_hold(child.block)
                node.children[key] = child
                self.num_nodes += 1
            if child.hidden is None and hidden is not None:
                child.hidden = hidden[d * bs : (d + 1) * bs].clone()
                self.hidden_bytes += _nbytes(child.hidden)
            node = child
        tail = tuple(info.tokens[full * bs : position])
        snap = node.snapshots.get(tail)
        if snap is None:
            assert seq.slot is not None
            snap = Snapshot(node, tail, position)
            if states is None:
                snap.conv = self.states.conv[seq.slot].clone()
                snap.recurrent = self.states.recurrent[seq.slot].clone()
            else:
                snap.conv, snap.recurrent = states
            if r:
                block = seq.block_table[full]
                snap.tail_k = self.kv.k[:, block, :r].clone()
                snap.tail_v = self.kv.v[:, block, :r].clone()
            if hidden is not None:
                snap.tail_hidden = hidden[full * bs : position].clone()
            snap.nbytes = _nbytes(snap.conv, snap.recurrent, snap.tail_k, snap.tail_v, snap.tail_hidden)
            node.snapshots[tail] = snap
            self.snapshot_bytes += snap.nbytes
            self.counts["prefix_inserted"] += 1
        elif snap.tail_hidden is None and hidden is not None:
            snap.tail_hidden = hidden[full * bs : position].clone()
            self.snapshot_bytes += _nbytes(snap.tail_hidden)
            snap.nbytes += _nbytes(snap.tail_hidden)
        self._touch(snap)
        return True

    def _touch(self, snap: Snapshot) -> Snapshot:
        self._lru[snap] = None
        self._lru.move_to_end(snap)
        return snap

    # ---- memory ----

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: snapshots, hidden rows, and KV blocks no sequence holds."""
        return self.snapshot_bytes + self.hidden_bytes + self.allocator.num_cache_only * self.block_bytes

    @property
    def reclaimable_blocks(self) -> int:
        """KV blocks that evicting could free now."""
        return self.allocator.num_cache_only

    def enforce_budget(self) -> None:
        while self.nbytes > self.budget_bytes and self._lru:
            self._evict_one()

    def reclaim(self, num_blocks: int) -> None:
        """Evict (LRU) until ``num_blocks`` KV blocks are free, or nothing is left to evict."""
        while not self.allocator.can_allocate(num_blocks) and self._lru:
            self._evict_one()

    def clear(self) -> None:
        while self._lru:
            self._evict_one(count=False)

    def _evict_one(self, count: bool = True) -> None:
        snap, _ = self._lru.popitem(last=False)
        node = snap.node
        del node.snapshots[snap.tail]
        self.snapshot_bytes -= snap.nbytes
        if count:
            self.counts["prefix_evictions"] += 1
        self._prune(node)

    def _prune(self, node: Node) -> None:
        """Drop ``node`` and its ancestors while they have neither children nor snapshots (nothing can
        resume from them)."""
        while node is not self.root and not node.children and not node.snapshots:
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            self.allocator.cache_release(node.block)
            self.hidden_bytes -= _nbytes(node.hidden)
            self.num_nodes -= 1
            node = parent

    def _prune_all(self) -> None:
        stack = [self.root]
        leaves = []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and not node.snapshots and node is not self.root:
                leaves.append(node)
        for leaf in leaves:
            self._prune(leaf)

    def stats(self) -> dict[str, int]:
        tail_tokens = sum(len(s.tail) for s in self._lru)
        return {
            **self.counts,
            "prefix_cache_bytes": self.nbytes,
            "prefix_cache_budget_bytes": self.budget_bytes,
            "prefix_entries": len(self._lru),
            "prefix_blocks": self.num_nodes,
            "prefix_blocks_cache_only": self.allocator.num_cache_only,
            "prefix_cached_tokens": self.num_nodes * self.block_size + tail_tokens,
        }
