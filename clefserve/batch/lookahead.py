"""Records read ahead of the engine, grouped so that those sharing a state run next to each other.

A Clef record is PREFIX, STATE, SCHEMA: records with the same state share every token up to the end of
the state, which the engine's prefix cache computes once (a record that waits for a running one to reach
that point is parked until then, then resumes from it). The cache is LRU and bounded, so the batch sends
such records together: up to ``max_records`` records (and ``max_bytes`` of their JSON) are read ahead and
handed out group by group, the group whose state was seen first going first, so nothing is overtaken by
more than the lookahead.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

from clefserve.batch.records import Item
from clefserve.formats.clef.encoder import render


def state_key(item: Item) -> bytes:
    """The state as the encoder writes it (key order does not matter, ``1`` and ``1.0`` do), hashed."""
    assert item.body is not None
    try:
        text = render(item.body.get("state"), "state")
    except ValueError:  # not encodable: the encoder will refuse it; its own group
        return item.key.encode()
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class Lookahead:
    def __init__(self, max_records: int, max_bytes: int) -> None:
        self.max_records, self.max_bytes = max(1, max_records), max_bytes
        self._groups: OrderedDict[bytes, deque[Item]] = OrderedDict()
        self._count = 0
        self._bytes = 0

    def __len__(self) -> int:
        return self._count

    @property
    def full(self) -> bool:
        return self._count >= self.max_records or self._bytes >= self.max_bytes

    def add(self, item: Item) -> None:
        self._groups.setdefault(state_key(item), deque()).append(item)
        self._count += 1
        self._bytes += item.size

    def pop(self) -> Item:
        """The next record: the rest of the oldest group first."""
        key, group = next(iter(self._groups.items()))
        item = group.popleft()
        if not group:
            del self._groups[key]
        self._count -= 1
        self._bytes -= item.size
        return item

    def push_front(self, item: Item) -> None:
        """Give back a record that could not be submitted; it comes out next."""
        key = state_key(item)
        group = self._groups.setdefault(key, deque())
        group.appendleft(item)
        self._groups.move_to_end(key, last=False)
        self._count += 1
        self._bytes += item.size
