"""The encoder cache: a picture's vision-tower rows by the digest of its pixels, LRU under a byte budget.

A picture that several requests share (a product photo asked about many times) is encoded once. The rows
of one picture depend on that picture alone (the tower never attends across pictures), so a cached entry
equals a fresh encoding.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, int(budget_bytes))
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.counts = dict.fromkeys(("hits", "misses", "evictions", "skipped_too_large"), 0)

    def get(self, digest: str) -> torch.Tensor | None:
        with self._lock:
            rows = self._entries.get(digest)
            if rows is None:
                self.counts["misses"] += 1
                return None
            self._entries.move_to_end(digest)
            self.counts["hits"] += 1
            return rows

    def put(self, digest: str, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        with self._lock:
            if size > self.budget_bytes:
                self.counts["skipped_too_large"] += 1
                return
            old = self._entries.pop(digest, None)
            if old is not None:
                self.nbytes -= old.numel() * old.element_size()
            self._entries[digest] = rows
            self.nbytes += size
            while self.nbytes > self.budget_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.nbytes -= evicted.numel() * evicted.element_size()
                self.counts["evictions"] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**{f"encoder_cache_{k}": v for k, v in self.counts.items()},
                    "encoder_cache_bytes": self.nbytes, "encoder_cache_budget_bytes": self.budget_bytes,
                    "encoder_cache_entries": len(self._entries)}
