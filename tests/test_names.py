"""Names: fingerprint roots, salts, chained page names, extras placement, media digests, id validation."""

import numpy as np
import pytest
import torch

from mmcache import Fingerprint, InvalidRequest, MediaItem, Namer, as_token_array, canonical_encoding, media_digest
from mmcache.names import MAX_SALT_BYTES, content_hasher, page_extras

FP = Fingerprint(model_digest="m", kv_dtype="bfloat16", attention_backend="paged-sdpa", page_size=4)


def test_canonical_encoding_ignores_dict_order_and_sequence_kind():
    a = {"size": 336, "mode": "bicubic", "mean": (0.5, 0.5, 0.5)}
    b = {"mean": [0.5, 0.5, 0.5], "mode": "bicubic", "size": np.int64(336)}
    assert canonical_encoding(a) == canonical_encoding(b)
    assert media_digest(b"img", a) == media_digest(b"img", b)


def test_media_digest_depends_on_bytes_and_every_parameter():
    base = media_digest(b"abc", {"size": 336, "mode": "bicubic"})
    assert len(base) == 32  # BLAKE2b-256
    assert media_digest(b"abd", {"size": 336, "mode": "bicubic"}) != base
    assert media_digest(b"abc", {"size": 224, "mode": "bicubic"}) != base
    assert media_digest(b"abc", {"size": 336, "mode": "bilinear"}) != base
    assert media_digest(b"abc", {"size": 336}) != base
    # the length prefix keeps bytes from sliding into the parameters
    assert media_digest(b"ab", {"c": 1}) != media_digest(b"abc", {"": 1})


@pytest.mark.parametrize("bad", [{"x": float("nan")}, {"x": object()}, {1: 2}])
def test_media_digest_refuses_parameters_without_canonical_form(bad):
    with pytest.raises(InvalidRequest):
        media_digest(b"x", bad)


def test_fingerprint_fields_change_the_root():
    roots = {Namer(FP).root()}
    for change in [dict(model_digest="m2"), dict(kv_dtype="float32"), dict(attention_backend="other"),
                   dict(page_size=8), dict(tp_size=2), dict(tp_size=2, tp_rank=1), dict(head_slice=(0, 1)),
                   dict(namer_version=99)]:
        fields = {**FP.__dict__, **change}
        roots.add(Namer(Fingerprint(**fields)).root())
    assert len(roots) == 9


def test_salt_is_folded_into_the_root():
    n = Namer(FP)
    assert n.root() == n.root(b"") == n.root(None)
    assert n.root("tenant-a") == n.root(b"tenant-a") != n.root("tenant-b") != n.root()
    assert n.root_of(n.root_material("tenant-a")) == n.root("tenant-a")  # the manager names from the material
    ids = as_token_array(np.arange(8))
    assert not set(n.names(ids, n.root("a")).tolist()) & set(n.names(ids, n.root("b")).tolist())
    with pytest.raises(InvalidRequest, match="salt"):  # used to raise UnicodeEncodeError and lose the call
        n.root("tenant-\ud800")


def test_a_salt_is_bounded_in_bytes_in_one_place():
    n = Namer(FP)
    longest = "s" * MAX_SALT_BYTES
    assert Namer.salt_bytes(longest) == longest.encode() and n.root(longest) != n.root(longest[:-1])
    too_long = ["s" * (MAX_SALT_BYTES + 1), b"s" * (MAX_SALT_BYTES + 1), bytearray(MAX_SALT_BYTES + 1),
                "\u00e9" * (MAX_SALT_BYTES // 2 + 1),  # within the bound in characters, over it in UTF-8 bytes
                "s" * 10**7]  # refused on its length, before it is encoded
    for salt in too_long:
        with pytest.raises(InvalidRequest, match="bound of 256 bytes"):
            Namer.salt_bytes(salt)
        with pytest.raises(InvalidRequest, match="salt"):
            n.root_material(salt)
    for salt in (1, 1.5, ["a"], memoryview(b"a"), object()):
        with pytest.raises(InvalidRequest, match="salt must be bytes or str"):
            Namer.salt_bytes(salt)


def test_media_digests_are_blake2b_256_with_their_own_domain():
    import hashlib

    raw, params = b"image bytes", {"size": 336}
    want = hashlib.blake2b(digest_size=32, person=b"mmcache-media")
    for part in (len(raw).to_bytes(8, "little"), raw, canonical_encoding(params)):
        want.update(part)
    assert media_digest(raw, params) == want.digest()
    assert content_hasher(b"a").digest() != content_hasher(b"b").digest()  # domains never share a digest


def test_names_chain_over_the_whole_prefix():
    n = Namer(FP)
    a = as_token_array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    b = a.copy()
    b[1] = 99  # differs in page 0 only
    na, nb = n.names(a, n.root()), n.names(b, n.root())
    assert len(na) == 3  # full pages only
    assert (na != nb).all(), "a change in page 0 must change every later name"
    c = a.copy()
    c[9] = 0  # page 2
    nc = n.names(c, n.root())
    assert na[0] == nc[0] and na[1] == nc[1] and na[2] != nc[2]
    # naming from the middle continues the same chain
    tail = n.names(a, n.root(), first_page=1, parent=int(na[0]))
    assert tail.tolist() == na[1:].tolist()


def test_extras_change_the_page_of_the_first_placeholder_and_everything_after():
    n = Namer(FP)
    ids = as_token_array([5] * 16)
    d1, d2 = media_digest(b"one"), media_digest(b"two")
    e1 = page_extras([MediaItem(d1, 6)], 4)
    e2 = page_extras([MediaItem(d2, 6)], 4)
    assert e1 == {1: ((d1, 2),)}
    plain, n1, n2 = (n.names(ids, n.root(), e) for e in (None, e1, e2))
    assert plain[0] == n1[0] == n2[0]
    assert len({plain[1], n1[1], n2[1]}) == 3 and (n1[1:] != n2[1:]).all()
    # the offset inside the page matters too
    n3 = n.names(ids, n.root(), page_extras([MediaItem(d1, 7)], 4))
    assert n3[1] != n1[1]


@pytest.mark.parametrize("bad", [[1.5, 2.0], [[1, 2]], [-1], [2**31], np.array([True, False]), [3, True], (False, 4),
                                 b"ab", bytearray(b"ab"), memoryview(b"ab"), [np.True_, 3], [[1], [2, 3]], [2**70],
                                 torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([True])])
def test_token_ids_are_validated(bad):
    with pytest.raises(InvalidRequest):
        as_token_array(bad)


def test_fingerprint_validation():
    with pytest.raises(InvalidRequest):
        Fingerprint(model_digest="m", kv_dtype="x", attention_backend="y", page_size=0)
    with pytest.raises(InvalidRequest):
        Fingerprint(model_digest="m", kv_dtype="x", attention_backend="y", page_size=4, tp_rank=2, tp_size=2)


@pytest.mark.parametrize("digest,position", [(b"short", 0), (b"", 0), ("a" * 32, 0), (b"d" * 16, 0), (b"d" * 31, 0),
                                             (b"d" * 33, 0), (b"d" * 64, 0), (b"d" * 32, -1), (b"d" * 32, 1.5),
                                             (b"d" * 32, True)])
def test_media_items_take_full_length_digests_only_and_good_positions(digest, position):
    # Nothing verifies a media item against stored data, so a short digest could let two images share pages;
    # 16 bytes (a caller's own 128-bit digest) were accepted, a birthday search of 2**64.
    with pytest.raises(InvalidRequest, match="digest must be 32 bytes" if position == 0 else "position"):
        MediaItem(digest, position)
    assert MediaItem(media_digest(b"x"), 3).position == 3 and MediaItem(bytearray(32), 0)


def test_a_16_byte_digest_is_refused_with_its_length():
    with pytest.raises(InvalidRequest, match=r"media digest must be 32 bytes \(BLAKE2b-256.*got 16 bytes"):
        MediaItem(media_digest(b"x")[:16], 0)


@pytest.mark.parametrize("page_size", [0, -4, True, 4.0])
def test_fingerprint_refuses_a_page_size_that_is_not_a_positive_int(page_size):
    with pytest.raises(InvalidRequest):
        Fingerprint(model_digest="m", kv_dtype="x", attention_backend="y", page_size=page_size)
