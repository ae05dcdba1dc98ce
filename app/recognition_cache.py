"""The recognition cache of an HTTP process: the answers of /recognize by the image bytes
they were computed from, so the same picture sent again is answered without reaching an
engine.

A key is a blake2b digest of the model's name, its decoding settings and the image's
bytes. The cache is a least-recently-used map bounded by one budget in bytes, which
counts each entry's key, its two LaTeX strings and its bookkeeping: the number of entries
is bounded by it too. It lives on the event loop of its process and needs no lock.
"""

from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

# What an entry holds beyond its key and strings: the object holding the answer, its
# confidence and size, the OrderedDict's slot and links, and the room its tables keep
# spare as they grow (measured with tracemalloc: tests/test_recognition_cache.py).
ENTRY_OVERHEAD = 360
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class CachedRecognition:
    latex: str
    compact: str
    confidence: float | None
    nbytes: int  # what it counts for in the cache's budget


def _size(key: bytes, latex: str, compact: str) -> int:
    return sys.getsizeof(key) + sys.getsizeof(latex) + sys.getsizeof(compact) + ENTRY_OVERHEAD


class RecognitionCache:
    """A byte-bounded LRU of recognized formulas; `max_bytes` 0 turns it off.

    `variant` names the decoding settings the answers depend on, so that answers of
    other settings never share a key.
    """

    def __init__(self, max_bytes: int, variant: Hashable = ()) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._variant = repr(variant).encode()
        self._entries: OrderedDict[bytes, CachedRecognition] = OrderedDict()
        self.nbytes = 0

    @classmethod
    def of_megabytes(cls, megabytes: float, variant: Hashable = ()) -> RecognitionCache:
        return cls(int(megabytes * MIB), variant)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def key(self, data: bytes, model: str) -> bytes:
        """The key of an image's answer from `model` (the digest of its bytes, the model's
        name and the decoding settings; each part length-prefixed, so none can run into
        the next)."""
        digest = hashlib.blake2b(digest_size=32)
        for part in (model.encode(), self._variant):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
        digest.update(data)
        return digest.digest()

    def get(self, key: bytes) -> CachedRecognition | None:
        """The answer stored under `key`, now the most recently used; None if absent."""
        answer = self._entries.get(key)
        if answer is not None:
            self._entries.move_to_end(key)
        return answer

    def put(self, key: bytes, latex: str, compact: str, confidence: float | None = None) -> int:
        """Store an answer as the most recently used, dropping the least recently used
        ones until the cache is within its budget; how many were dropped. An answer larger
        than the whole budget is not stored."""
        if not self.enabled:
            return 0
        size = _size(key, latex, compact)
        if size > self.max_bytes:
            return 0
        self._discard(key)
        self._entries[key] = CachedRecognition(latex, compact, confidence, size)
        self.nbytes += size
        evicted = 0
        while self.nbytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._discard(oldest)
            evicted += 1
        return evicted

    def _discard(self, key: bytes) -> None:
        answer = self._entries.pop(key, None)
        if answer is not None:
            self.nbytes -= answer.nbytes
