"""Deterministic synthetic token streams: equal keys give equal tokens, distinct keys give unrelated tokens.

A stream is addressed by a 64-bit key; token ``j`` of stream ``key`` is ``splitmix64(splitmix64(key) + j)``
mapped onto ``[0, vocab)`` (``vocab`` below 2**31). Keys come from a domain string (``"mooncake-output"``,
``"sessions-tool"`` ...) and integers (``stream_key``), so streams of different domains coincide only on a
64-bit collision. Everything is vectorised over numpy uint64 arrays, whose arithmetic wraps modulo 2**64 as
splitmix64 requires.
"""

from __future__ import annotations

import numpy as np
import xxhash

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser over a uint64 array (a bijection of 64-bit integers); returns a new array."""
    z = x + _GOLDEN
    t = z >> np.uint64(30)
    z ^= t
    z *= _M1
    np.right_shift(z, np.uint64(27), out=t)
    z ^= t
    z *= _M2
    np.right_shift(z, np.uint64(31), out=t)
    z ^= t
    return z


def stream_key(domain: str, *parts: int) -> int:
    """A 64-bit stream key for ``domain`` and integer ``parts`` (each in [0, 2**63))."""
    data = domain.encode("utf-8") + b"".join(int(p).to_bytes(8, "little") for p in parts)
    return xxhash.xxh64_intdigest(data)


def streams(keys: np.ndarray, length: int, vocab: int) -> np.ndarray:
    """Tokens ``0 .. length-1`` of each stream in ``keys``, concatenated, as int32 in ``[0, vocab)``."""
    base = splitmix64(np.asarray(keys, dtype=np.uint64))
    x = splitmix64((base[:, None] + np.arange(length, dtype=np.uint64)[None, :]).reshape(-1))
    # Lemire's multiply-shift maps the high 32 bits onto [0, vocab) without a 64-bit division.
    x >>= np.uint64(32)
    x *= np.uint64(vocab)
    x >>= np.uint64(32)
    return x.astype(np.int32)


def stream(key: int, length: int, vocab: int) -> np.ndarray:
    """Tokens ``0 .. length-1`` of one stream as int32 in ``[0, vocab)``."""
    return streams(np.asarray([key], dtype=np.uint64), length, vocab)
