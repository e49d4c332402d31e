"""Forced collisions: with every name equal, lookups must return exactly what a collision-free namer returns.

Two managers run the same operation sequence, one with xxHash and one whose hash is a constant, so every page
name and every root collides. Verification (ids, extras, parent, exact root material) must make them agree on
every match, page for page.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mmcache import AllocationManager, CacheConfig, Fingerprint, MediaItem, media_digest

P = 4
DIGESTS = [media_digest(bytes([i])) for i in range(3)]


def _collide(data, seed):
    return 0


op = st.tuples(
    st.integers(0, 2),  # base prefix
    st.integers(0, 16),  # cut
    st.lists(st.integers(0, 3), max_size=6),  # suffix
    st.sampled_from([b"", b"t1"]),  # salt
    st.one_of(st.none(), st.tuples(st.integers(0, 2), st.integers(0, 15))),  # media (digest, position)
    st.integers(0, 5),  # generated tokens
)


@settings(max_examples=60, deadline=None)
@given(st.lists(op, min_size=1, max_size=14))
def test_constant_hash_matches_exactly_like_xxhash(ops):
    rng = np.random.default_rng(0)
    bases = [rng.integers(0, 4, size=16) for _ in range(3)]
    fp = Fingerprint.for_tests(P)
    good = AllocationManager(CacheConfig(num_pages=40, page_size=P), fp)
    bad = AllocationManager(CacheConfig(num_pages=40, page_size=P), fp, hash_fn=_collide)
    for rid, (base, cut, suffix, salt, media, gen) in enumerate(ops):
        prompt = np.concatenate([bases[base][:cut], suffix]).astype(np.int64)
        if len(prompt) == 0:
            prompt = np.array([0])
        items = []
        if media is not None and media[1] < len(prompt):
            items = [MediaItem(DIGESTS[media[0]], media[1])]
        results = []
        for mgr in (good, bad):
            res = mgr.admit(rid, prompt, items, salt)
            todo = prompt[res.matched_tokens:]
            mgr.reserve(rid, len(todo) + gen)
            mgr.commit(rid, todo)
            for t in range(gen):
                mgr.commit(rid, [t % 4])
            results.append((res.matched_tokens, mgr.state(rid).page_indices.tolist()))
            mgr.teardown(rid)
            mgr.check_invariants()
        assert results[0] == results[1]
    assert bad.index.size == good.index.size
