"""Page names: chained xxHash 64 rooted in a process fingerprint, and 256-bit media digests (BLAKE2b).

Rules (docs/DESIGN.md, "Names, and what a hit verifies" and "Digests and salts"):

* The fingerprint (model identity, TP rank/size and head slice, KV dtype, attention backend, page size, namer
  version) is encoded canonically once; together with a per-request salt it is the *root material* of a chain.
* Page ``i`` is named ``H(token ids of page i || extras[i])`` with the name of page ``i-1`` (or the root) as
  the xxHash seed, so a name commits to the whole prefix from position 0: equal names at page ``i`` mean
  (barring a 64-bit collision) equal token ids, equal extras and equal roots for pages ``0..i``.
* ``extras[i]`` lists, in position order, ``(media digest, offset in page)`` for each media item whose first
  placeholder token lies in page ``i``.
* Token ids are hashed as little-endian int32; ids outside ``[0, 2**31)`` are refused before hashing.
* Names only nominate. The prefix index verifies ids, extras and parent before it accepts a page, so a
  collision costs a comparison, never a wrong page. Tests may therefore inject a degenerate ``hash_fn``.
* Media digests are BLAKE2b-256 over the bytes as sent plus a canonical encoding of the preprocessor
  parameters. Nothing verifies them against the content they stand for, so they must resist collisions made
  on purpose (xxh3 does not: its public secret lets a sender build two images with one xxh3_128 digest);
  256 bits keep a birthday search at 2**128 work. ``content_hasher`` is the one constructor for such digests.
* A salt is at most ``MAX_SALT_BYTES`` bytes (UTF-8 for a str); ``Namer.salt_bytes`` is the one check, shared by
  the page namer and every store key.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import xxhash

from .checks import unicode_text
from .errors import InvalidRequest

NAMER_VERSION = 1
TOKEN_DTYPE = np.dtype("<i4")
MAX_TOKEN_ID = 2**31 - 1

HashFn = Callable[[Any, int], int]
"""``hash_fn(data, seed) -> unsigned 64-bit int``; the default is ``xxhash.xxh64_intdigest``."""

Extras = tuple  # tuple[tuple[bytes, int], ...]: (media digest, offset in page) in position order


def canonical_encoding(value: Any) -> bytes:
    """Deterministic bytes for a JSON-like value: dict order, tuple-vs-list and numpy scalars do not matter.

    Floats are encoded by ``repr`` (exact round-trip); NaN and infinities are refused because they have no
    single canonical spelling in every producer.
    """
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise InvalidRequest(f"parameter names must be strings, got {k!r}")
            out[k] = _plain(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidRequest(f"parameter value {value!r} has no canonical encoding")
        return value
    if isinstance(value, bytes):
        return {"__bytes__": value.hex()}
    raise InvalidRequest(f"parameter value of type {type(value).__name__} has no canonical encoding")


DIGEST_BYTES = 32  # the size of every content digest and store key (BLAKE2b-256; see the module docstring)
MAX_SALT_BYTES = 256  # a salt's bound: a tenant or request name, not a payload to hash on every page


def content_hasher(domain: bytes) -> "hashlib.blake2b":
    """A fresh BLAKE2b-256 hasher for digests nothing verifies (media, waveforms, prompts, store keys).

    ``domain`` (at most 16 bytes) is BLAKE2b's personalization, so digests of one kind never equal another
    kind's for any input. hashlib's BLAKE2b is in the standard library, so the core's dependencies stay torch,
    numpy and xxhash."""
    return hashlib.blake2b(digest_size=DIGEST_BYTES, person=domain)


def media_digest(raw: bytes | bytearray | memoryview, params: Mapping[str, Any] | None = None) -> bytes:
    """32-byte digest of a media item: BLAKE2b-256 over the bytes as sent, then the canonical parameters.

    ``raw`` is the encoded file (PNG/JPEG/WAV bytes, or a data URL's decoded payload), not decoded pixels.
    ``params`` holds every preprocessor parameter that changes the embedding (size, resize mode, crop,
    mean/std, sample rate, patch size, processor version ...). The length of ``raw`` is hashed too, so no
    byte string can be shifted between the two fields.
    """
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise InvalidRequest(f"media bytes must be bytes-like, got {type(raw).__name__}")
    h = content_hasher(b"mmcache-media")
    h.update(len(raw).to_bytes(8, "little"))
    h.update(raw)
    h.update(canonical_encoding(dict(params or {})))
    return h.digest()


@dataclass(frozen=True)
class Fingerprint:
    """Everything outside the prompt that a stored page's bytes depend on. Hashed once per process."""

    model_digest: str
    kv_dtype: str
    attention_backend: str
    page_size: int
    tp_rank: int = 0
    tp_size: int = 1
    head_slice: tuple[int, int] | None = None
    namer_version: int = NAMER_VERSION

    def __post_init__(self):
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, (int, np.integer)) or self.page_size <= 0:
            raise InvalidRequest(f"page_size must be a positive int, got {self.page_size!r}")
        for name in ("model_digest", "kv_dtype", "attention_backend"):
            if not isinstance(getattr(self, name), str):
                raise InvalidRequest(f"{name} must be a str, got {getattr(self, name)!r}")
        for name in ("tp_rank", "tp_size", "namer_version"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise InvalidRequest(f"{name} must be an int, got {v!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidRequest(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")

    def encode(self) -> bytes:
        return canonical_encoding(asdict(self))

    @classmethod
    def for_tests(cls, page_size: int = 4, model: str = "test-model") -> "Fingerprint":
        return cls(model_digest=model, kv_dtype="none", attention_backend="none", page_size=page_size)


@dataclass(frozen=True)
class MediaItem:
    """A media item in a prompt: its digest and the absolute position of its first placeholder token.

    The digest is ``DIGEST_BYTES`` (32) long, as ``media_digest`` gives it, and nothing else: nothing checks a
    media item against stored data the way token ids are checked, so a shorter one could make two images share
    pages (and a caller's own digest must resist crafted collisions, as ``media_digest`` does)."""

    digest: bytes
    position: int

    def __post_init__(self):
        if not isinstance(self.digest, (bytes, bytearray)) or len(self.digest) != DIGEST_BYTES:
            got = f"{len(self.digest)} bytes" if isinstance(self.digest, (bytes, bytearray)) else repr(self.digest)
            raise InvalidRequest(f"media digest must be {DIGEST_BYTES} bytes (BLAKE2b-256, as media_digest gives), "
                                 f"got {got:.60}")
        if isinstance(self.position, bool) or not isinstance(self.position, (int, np.integer)) or self.position < 0:
            raise InvalidRequest(f"media position must be a non-negative int, got {self.position!r}")


def as_token_array(token_ids: Any, request_id: object = None) -> np.ndarray:
    """Validate token ids and return them as a contiguous little-endian int32 array (a copy if needed).

    Refuses (``InvalidRequest``) floats, bools, non-1-D input, ids outside ``[0, 2**31)`` and bytes-like
    objects (numpy reads a ``bytearray`` or ``memoryview`` as its byte values, which are not token ids).
    """
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        raise InvalidRequest(f"token ids must be a sequence of ints, got {type(token_ids).__name__} "
                             "(text must be a str)", request_id)
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    else:
        try:
            import torch  # local: names must not pay torch's import for plain lists

            if isinstance(token_ids, torch.Tensor):
                if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
                    raise InvalidRequest(f"token ids must be integers, got dtype {token_ids.dtype}", request_id)
                token_ids = token_ids.detach().cpu().numpy()
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
        try:
            arr = np.asarray(token_ids)
        except (ValueError, TypeError, OverflowError) as e:  # ragged nesting, ints past 64 bits
            raise InvalidRequest(f"token ids must be a flat sequence of ints: {e}", request_id) from None
    if arr.ndim != 1:
        raise InvalidRequest(f"token ids must be 1-D, got shape {arr.shape}", request_id)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequest(f"token ids must be integers, got dtype {arr.dtype}", request_id)
    if arr.dtype == np.bool_ or (isinstance(token_ids, (list, tuple))
                                 and any(isinstance(t, (bool, np.bool_)) for t in token_ids)):
        raise InvalidRequest("token ids must be integers, got bool", request_id)  # [True, 3] becomes [1, 3]
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        raise InvalidRequest(f"token ids must lie in [0, {MAX_TOKEN_ID}]", request_id)
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)


def page_extras(media: Sequence[MediaItem], page_size: int) -> dict[int, Extras]:
    """Group media items by the page of their first placeholder: ``{page: ((digest, offset), ...)}``."""
    out: dict[int, list] = {}
    for item in sorted(media, key=lambda m: (m.position, m.digest)):
        page, offset = divmod(int(item.position), page_size)
        out.setdefault(page, []).append((bytes(item.digest), offset))
    return {p: tuple(v) for p, v in out.items()}


def _check_salt_length(size: int) -> None:
    if size > MAX_SALT_BYTES:
        raise InvalidRequest(f"salt of {size} bytes or more exceeds the bound of {MAX_SALT_BYTES} bytes")


def _encode_extras(extras: Extras) -> bytes:
    return b"".join(len(d).to_bytes(2, "little") + d + off.to_bytes(4, "little") for d, off in extras)


class Namer:
    """Computes roots and chained page names for one fingerprint. Stateless after construction; thread-safe."""

    def __init__(self, fingerprint: Fingerprint, hash_fn: HashFn | None = None):
        self.fingerprint = fingerprint
        self.page_size = fingerprint.page_size
        self._hash: HashFn = hash_fn or xxhash.xxh64_intdigest
        self._fp_bytes = fingerprint.encode()

    @staticmethod
    def salt_bytes(salt: bytes | str | None) -> bytes:
        """``salt`` as the bytes every page name and store key is salted with (None is no salt); the one check
        of a salt: ``InvalidRequest`` for a type other than bytes or str, a lone surrogate, or more than
        ``MAX_SALT_BYTES`` bytes (a str is refused on its length before it is encoded)."""
        if salt is None:
            return b""
        if isinstance(salt, str):
            _check_salt_length(len(salt))  # its UTF-8 is at least as long: refused before it is encoded
            if not unicode_text(salt):
                raise InvalidRequest("salt is not valid Unicode text (it holds a lone surrogate)")
            out = salt.encode("utf-8")
        elif isinstance(salt, (bytes, bytearray)):
            out = bytes(salt)
        else:
            raise InvalidRequest(f"salt must be bytes or str, got {type(salt).__name__}")
        _check_salt_length(len(out))
        return out

    def root_material(self, salt: bytes | str | None = b"") -> bytes:
        """The exact bytes a chain is rooted in; the prefix index compares these, not only their hash."""
        s = self.salt_bytes(salt)
        return self._fp_bytes + b"\x00salt\x00" + len(s).to_bytes(4, "little") + s

    def root(self, salt: bytes | str | None = b"") -> int:
        return self.root_of(self.root_material(salt))

    def root_of(self, material: bytes) -> int:
        """The chain root named by ``root_material``'s bytes (``root`` without building them again)."""
        return self._hash(material, 0)

    def names(self, token_ids: np.ndarray, root: int, extras: Mapping[int, Extras] | None = None, *,
              first_page: int = 0, parent: int | None = None, num_pages: int | None = None) -> np.ndarray:
        """Names of the full pages of ``token_ids``, as uint64.

        ``token_ids`` must be the output of ``as_token_array``. Pages ``first_page .. first_page+num_pages-1``
        are named (all full pages from ``first_page`` by default), chained from ``parent`` (the name of page
        ``first_page - 1``) or from ``root`` when ``first_page == 0``.
        """
        p = self.page_size
        total_full = len(token_ids) // p
        if num_pages is None:
            num_pages = total_full - first_page
        if first_page < 0 or num_pages < 0 or first_page + num_pages > total_full:
            raise InvalidRequest(f"pages {first_page}..{first_page + num_pages} outside {total_full} full pages")
        if first_page > 0 and parent is None:
            raise InvalidRequest("naming from a page other than 0 needs the parent's name")
        buf = memoryview(token_ids).cast("B")
        step = p * TOKEN_DTYPE.itemsize
        prev = root if first_page == 0 else parent
        h = self._hash
        out = []
        append = out.append
        if not extras:  # the common, text-only case: one hash call per page, nothing else
            for off in range(first_page * step, (first_page + num_pages) * step, step):
                prev = h(buf[off : off + step], prev)
                append(prev)
        else:
            for i in range(first_page, first_page + num_pages):
                chunk = buf[i * step : (i + 1) * step]
                ex = extras.get(i)
                prev = h(chunk if not ex else bytes(chunk) + _encode_extras(ex), prev)
                append(prev)
        return np.fromiter(out, dtype=np.uint64, count=num_pages)
