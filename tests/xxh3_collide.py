"""Inputs that xxh3 (64 and 128 bits, default secret) cannot tell apart, built in milliseconds for the digest tests.

XXH3 hashes an input longer than 240 bytes stripe by stripe. For each 64-byte stripe and each of its eight
8-byte little-endian words ``v`` (lane ``i``), with ``s`` the secret word at offset ``8 * (n + i)`` (``n`` the
stripe's index in its block of 16 stripes, 1,024 bytes):

    acc[i ^ 1] += v
    acc[i]     += lo32(v ^ s) * hi32(v ^ s)

and the accumulators are scrambled after each block. A word whose low half equals ``lo32(s)`` makes the product
zero, so it only adds ``v`` into ``acc[i ^ 1]``: the high halves of such words in one lane of one block can be
permuted among their stripes and every sum, hence the digest, stays the same. The last 64 bytes of the input are
accumulated once more with another secret offset, so no word is crafted there.

``colliding_pair`` writes such words into a region of bytes hashed at a known offset of the whole input and
returns two versions whose high halves are permuted (reversed within each lane of each block).
"""

from __future__ import annotations

import struct
from typing import Callable

import numpy as np
import xxhash

from mmcache.names import canonical_encoding

# xxhash's public default secret (kSecret), of which the stripe loop reads the first 184 bytes.
K_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64ecce0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
STRIPE, WORD, BLOCK_STRIPES = 64, 8, 16


def secret_low(stripe_in_block: int, lane: int) -> bytes:
    """The low half of the secret word that stripe ``stripe_in_block``'s lane ``lane`` is mixed with."""
    at = WORD * (stripe_in_block + lane)
    return K_SECRET[at:at + 4]


def crafted_groups(offset: int, length: int,
                   usable: Callable[[bytes], bool]) -> dict[tuple[int, int], list[tuple[int, bytes]]]:
    """``(position in the region, secret low half)`` of each word that can be crafted, grouped by (block, lane).

    The region is ``length`` bytes hashed from ``offset`` of the whole input; its stripes are those aligned in
    the whole input, and the last 64 bytes of the region are left alone (they may be the input's last stripe).
    ``usable(low)`` says whether a word may hold that secret low half (a float sample must stay finite).
    """
    groups: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
    first = -offset % STRIPE
    for at in range(first, length - 2 * STRIPE + 1, STRIPE):
        block, n = divmod((offset + at) // STRIPE, BLOCK_STRIPES)
        for lane in range(STRIPE // WORD):
            low = secret_low(n, lane)
            if usable(low):
                groups.setdefault((block, lane), []).append((at + WORD * lane, low))
    return groups


def colliding_pair(base: bytes, offset: int, high: Callable[[int], bytes],
                   usable: Callable[[bytes], bool] = lambda low: True) -> tuple[bytes, bytes]:
    """Two versions of ``base`` (hashed from ``offset`` of the whole input) with equal xxh3 digests of any input
    that holds them at that offset. Each crafted word gets the secret's low half; its high half is ``high(p)``
    (4 bytes, ``p`` the word's position) in the first version and the high half of the mirrored word of its
    group in the second."""
    a, b = bytearray(base), bytearray(base)
    for group in crafted_groups(offset, len(base), usable).values():
        for (at, low), (mirror, _) in zip(group, reversed(group)):
            a[at:at + WORD] = low + high(at)
            b[at:at + WORD] = low + high(mirror)
    return bytes(a), bytes(b)


def xxh3_media_digest(raw: bytes, params: dict | None = None) -> bytes:
    """What ``names.media_digest`` computed before it took BLAKE2b: xxh3_128 over the length, bytes, parameters."""
    h = xxhash.xxh3_128()
    h.update(len(raw).to_bytes(8, "little"))
    h.update(raw)
    h.update(canonical_encoding(dict(params or {})))
    return h.digest()


# ---- files --------------------------------------------------------------------------------------------------
BMP_SIDE = 64
BMP_PIXELS_AT = 120  # 8 (media_digest's length field) + 120: the pixel array starts a stripe of the input


def bmp(pixels: bytes, side: int = BMP_SIDE, pixels_at: int = BMP_PIXELS_AT) -> bytes:
    """A 24-bit bottom-up BMP of ``side`` x ``side`` pixels (rows of ``side * 3`` bytes, no padding needed when
    ``side`` is a multiple of 4), its pixel array at ``pixels_at`` (the gap after the headers is allowed)."""
    row = side * 3
    assert len(pixels) == row * side and row % 4 == 0 and pixels_at >= 54
    header = b"BM" + struct.pack("<IHHI", pixels_at + len(pixels), 0, 0, pixels_at)
    info = struct.pack("<IiiHHIIiiII", 40, side, side, 1, 24, 0, len(pixels), 2835, 2835, 0, 0)
    return header + info + bytes(pixels_at - 54) + pixels


def colliding_bmps(digest_offset: int = 8) -> tuple[bytes, bytes]:
    """Two valid 64x64 BMPs, differing in most pixels, with one xxh3 digest when hashed from ``digest_offset``
    (8: after ``media_digest``'s length field)."""
    size = BMP_SIDE * BMP_SIDE * 3
    base = bytes((i * 7) % 256 for i in range(size))
    a, b = colliding_pair(base, digest_offset + BMP_PIXELS_AT, lambda at: bytes([at * 5 // 64 % 256] * 4))
    return bmp(a), bmp(b)


WAV_DATA_AT = 1024  # the samples start a block of the file's digest, as they start one of the waveform's


def float_wav(samples: bytes, rate: int, data_at: int = WAV_DATA_AT) -> bytes:
    """A mono IEEE-float32 WAV (RIFF, ``fmt `` of format 3, ``fact``, a ``JUNK`` pad, ``data``) whose samples
    start at byte ``data_at``."""
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    fact = struct.pack("<I", len(samples) // 4)
    head = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"fact" + struct.pack("<I", 4) + fact
    pad = data_at - 12 - len(head) - 8 - 8
    assert pad >= 0 and pad % 2 == 0
    body = b"WAVE" + head + b"JUNK" + struct.pack("<I", pad) + bytes(pad) + b"data" + struct.pack("<I", len(samples))
    return b"RIFF" + struct.pack("<I", len(body) + len(samples)) + body + samples


def _quiet_float(low: bytes) -> bool:
    """A secret low half that reads as a finite float32 sample in [-1, 1]."""
    x = float(np.frombuffer(low, "<f4")[0])
    return np.isfinite(x) and abs(x) <= 1.0


def colliding_waveforms(samples: int, digest_offset: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Two float32 waveforms in [-1, 1] whose bytes have one xxh3 digest when hashed from ``digest_offset``."""
    t = np.arange(samples, dtype=np.float64)
    base = (0.3 * np.sin(2 * np.pi * 220.0 * t / 24000.0)).astype("<f4").tobytes()

    def high(at: int) -> bytes:  # a louder, slower tone in the crafted samples: mirrored, it differs
        return np.float32(0.6 * np.sin(at / 97.0)).astype("<f4").tobytes()

    a, b = colliding_pair(base, digest_offset, high, _quiet_float)
    return np.frombuffer(a, "<f4").copy(), np.frombuffer(b, "<f4").copy()


def colliding_wavs(samples: int, rate: int) -> tuple[bytes, bytes]:
    """Two valid float32 WAV files whose samples collide both as a file digest (``media_digest`` of the file's
    bytes) and as a waveform digest (the codec's): the samples start a 1,024-byte block in both inputs."""
    a, b = colliding_waveforms(samples)
    return float_wav(a.tobytes(), rate), float_wav(b.tobytes(), rate)
