"""The ids a batch has already written or seen, in about 8 bytes each.

A rerun must skip every id already in OUTPUT, and a repeated id in the input must not be answered twice,
so the set grows with the number of records (the one thing that does). Ids are kept as 64-bit BLAKE2b
digests of their text: a sorted numpy array, plus a small Python set of recent ids merged into it in
bulk. Two different ids share a digest with probability about n²/2⁶⁵ (3·10⁻⁸ for a million ids).
"""

from __future__ import annotations

import hashlib

import numpy as np

MERGE_EVERY = 1 << 16


def digest(key: str) -> int:
    text = key.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


class IdSet:
    def __init__(self) -> None:
        self._sorted = np.empty(0, dtype=np.uint64)
        self._recent: set[int] = set()

    def __len__(self) -> int:
        return len(self._sorted) + len(self._recent)

    def __contains__(self, key: str) -> bool:
        return self._has(digest(key))

    def _has(self, h: int) -> bool:
        if h in self._recent:
            return True
        i = int(np.searchsorted(self._sorted, np.uint64(h)))
        return i < len(self._sorted) and int(self._sorted[i]) == h

    def add(self, key: str) -> bool:
        """Add ``key``; False when it was there already."""
        h = digest(key)
        if self._has(h):
            return False
        self._recent.add(h)
        if len(self._recent) >= MERGE_EVERY:
            self._merge()
        return True

    def _merge(self) -> None:
        recent = np.fromiter(self._recent, dtype=np.uint64, count=len(self._recent))
        self._sorted = np.union1d(self._sorted, recent)
        self._recent.clear()
