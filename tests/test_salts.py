"""Per-call salts through one diffusion wrapper (encoders/diffusion.py), and the one salt bound of the core.

* Through one ``CachedWanPipeline`` or ``CachedSD3Pipeline`` instance, a second salt's first request costs exactly
  what the first salt's first request cost (encoder computes, position-bias computes, tokenizations) and shares
  no store key with it: prompt embeddings, the negative prompt and the position biases. The same salt again is
  all hits. The wrapper's adapters (and their fingerprints) are not built again for another salt.
* ``cache_salt=None`` is the wrapper's own salt; ``__call__`` takes ``cache_salt`` as ``prepare`` does.
* An over-long salt (over ``MAX_SALT_BYTES`` bytes), a salt that is neither str nor bytes, or a str with a lone
  surrogate is refused with ``InvalidRequest`` before anything is tokenized, encoded or held; so is a bad salt
  given to the wrapper itself. The page namer (``AllocationManager.admit``) refuses the same salts, holding no
  page: the bound is checked in one place, ``Namer.salt_bytes``.
"""

import pytest
import torch

from encoders.diffusion import CachedSD3Pipeline, CachedWanPipeline
from encoders.text_encoders import ForwardCounter, T5EncoderAdapter, T5Recipe, TokenizationMemo
from mmcache.errors import InvalidRequest
from mmcache.names import MAX_SALT_BYTES
from mmcache.store import EncoderOutputStore

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest

PROMPT, NEG = "a red fox in snow", "blurry, static"
WAN_ARGS = dict(max_sequence_length=32, guidance_scale=5.0)
SD3_ARGS = dict(max_sequence_length=32, guidance_scale=5.0)
BAD_SALTS = ["s" * (MAX_SALT_BYTES + 1), b"s" * (MAX_SALT_BYTES + 1), 7, ["tenant"], "tenant-\ud800"]


def counts(wrapper) -> dict:
    """Every count a salt could leak through: per kind of store entry, and each adapter's tokenization memo."""
    m = wrapper.store.metrics
    out = {f"{kind}.{name}": getattr(m.kind(kind), name) for kind in ("output", "position_bias")
           for name in ("computes", "hits", "bypasses")}
    for i, adapter in enumerate(wrapper.adapters):
        out[f"memo{i}.hits"], out[f"memo{i}.misses"] = adapter.memo.hits, adapter.memo.misses
    return out


def request(wrapper, salt, args) -> tuple[dict, set]:
    """One request's count deltas and the store keys it added."""
    before, keys = counts(wrapper), set(wrapper.store.keys())
    with wrapper.prepare(PROMPT, NEG, cache_salt=salt, **args):
        pass
    after = counts(wrapper)
    return {k: after[k] - before[k] for k in after}, set(wrapper.store.keys()) - keys


@pytest.mark.parametrize("kind", ["wan", "sd3"])
def test_two_salts_share_no_entry_and_no_hit_through_one_wrapper(kind, request_fixture):
    pipe, cls, args = request_fixture(kind)
    wrapper = cls(pipe, EncoderOutputStore(1 << 26))
    adapters = wrapper.adapters
    first, keys_a = request(wrapper, "tenant-a", args)
    assert first["output.computes"] == (2 if kind == "wan" else 6) and first["output.hits"] == 0  # prompt, negative
    assert first["position_bias.computes"] > 0  # the T5-family biases went through the store
    other, keys_b = request(wrapper, b"tenant-b", args)
    assert other == first  # no hit of the other salt's: the same computes, tokenizations and misses
    assert keys_b and not keys_a & keys_b and len(keys_b) == len(keys_a)
    again, keys_again = request(wrapper, "tenant-a", args)
    assert not keys_again
    assert again["output.computes"] == again["position_bias.computes"] == 0
    assert again["output.hits"] == first["output.computes"] + first["output.hits"]
    assert all(again[k] == 0 for k in again if k.endswith(".misses"))
    assert wrapper.adapters == adapters  # one wrapper, one fingerprint per encoder, for every tenant
    wrapper.store.check_invariants()


@pytest.fixture
def request_fixture(wan, sd3):
    return lambda kind: (wan, CachedWanPipeline, WAN_ARGS) if kind == "wan" else (sd3, CachedSD3Pipeline, SD3_ARGS)


def test_a_call_without_cache_salt_takes_the_wrappers_salt(wan):
    store = EncoderOutputStore(1 << 26)
    wrapper = CachedWanPipeline(wan, store, salt="tenant-a")
    _, keys = request(wrapper, None, WAN_ARGS)
    same, none_added = request(wrapper, "tenant-a", WAN_ARGS)
    assert keys and not none_added and same["output.computes"] == 0
    _, unsalted = request(wrapper, b"", WAN_ARGS)  # an empty salt is a salt of its own, not the wrapper's
    assert unsalted and not unsalted & keys
    out = wrapper("a lighthouse at dusk", NEG, cache_salt="tenant-b", height=16, width=16, num_frames=5,
                  num_inference_steps=1, output_type="latent", **WAN_ARGS)
    assert out.frames is not None
    assert store.metrics.kind("output").computes == 3 * 2  # a, "" and b: a prompt and the negative each
    assert all(store.held(k) == 0 for k in store.keys())  # __call__ released what it held


@pytest.mark.parametrize("salt", BAD_SALTS, ids=["long-str", "long-bytes", "int", "list", "surrogate"])
def test_a_bad_salt_is_refused_before_anything_is_encoded_or_held(wan, salt):
    store = EncoderOutputStore(1 << 26)
    wrapper = CachedWanPipeline(wan, store)
    memo = wrapper.text.memo
    with ForwardCounter(wan.text_encoder) as forwards:
        for call in (wrapper.prepare, wrapper):
            with pytest.raises(InvalidRequest, match="salt"):
                call(PROMPT, NEG, cache_salt=salt, **WAN_ARGS)
    assert forwards.total == 0 and len(store) == 0 and store.metrics.lookups == 0
    assert memo.hits == memo.misses == 0 and len(memo) == 0
    with pytest.raises(InvalidRequest, match="salt"):
        CachedWanPipeline(wan, store, salt=salt)


def test_the_tokenization_memo_is_salted(wan):
    memo = TokenizationMemo(wan.tokenizer)
    first = memo(PROMPT, 32, "tenant-a")
    assert memo(PROMPT, 32, "tenant-b") is not first and memo.hits == 0 and memo.misses == 2
    assert memo(PROMPT, 32, b"tenant-a") is first and memo.hits == 1
    with pytest.raises(InvalidRequest, match="salt"):
        memo(PROMPT, 32, "s" * (MAX_SALT_BYTES + 1))


def test_an_adapter_refuses_a_bad_salt_before_it_tokenizes(wan):
    adapter = T5EncoderAdapter(wan.tokenizer, wan.text_encoder, T5Recipe(attention_mask=True, trim_to_length=True))
    store = EncoderOutputStore(1 << 26)
    with ForwardCounter(wan.text_encoder) as forwards:
        with pytest.raises(InvalidRequest, match="bound of 256 bytes"):
            adapter.encode(PROMPT, 32, store, salt=b"s" * (MAX_SALT_BYTES + 1))
    assert forwards.total == 0 and len(store) == 0 and adapter.memo.misses == 0
    with adapter.encode(PROMPT, 32, store, salt=b"s" * MAX_SALT_BYTES) as lease:
        assert not lease.hit and torch.isfinite(lease.outputs["hidden"]).all()


def test_the_page_namer_takes_the_same_bound_and_a_refused_request_holds_no_page():
    from mmcache import AllocationManager, CacheConfig, Fingerprint

    mgr = AllocationManager(CacheConfig(num_pages=8, page_size=4), Fingerprint.for_tests(page_size=4))
    for salt in BAD_SALTS:
        with pytest.raises(InvalidRequest, match="salt"):
            mgr.admit("r", list(range(9)), salt=salt)
        assert mgr.num_requests == 0 and mgr.pool.num_free == 8
    mgr.admit("r", list(range(9)), salt="s" * MAX_SALT_BYTES)  # the bound itself is a salt
    mgr.check_invariants()
