"""The store's budget and holding rules under churn: a model-based random test of the store itself, and a
generation stream through the Wan wrapper with a budget far smaller than its working set.

Rules checked: bytes never exceed the budget and equal the entries' sum; held entries are never evicted;
eviction is least recently used among unheld entries; an entry that cannot fit bypasses (the caller still gets
its outputs); a request holds its entries while in flight and nothing after.
"""

from collections import OrderedDict

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from encoders.diffusion import CachedWanPipeline
from mmcache.presets.diffusion import tiny_wan_pipeline
from mmcache.presets.local_tokenizers import parti_prompts, wan_negative_prompt
from encoders.text_encoders import ForwardCounter
from mmcache.store import EncoderOutputStore

BUDGET_FLOATS = 16
KEYS = [bytes([i]) * 32 for i in range(6)]  # store keys are 32 bytes


class StoreMachine(RuleBasedStateMachine):
    """Every operation is mirrored on a plain reference model (an LRU list with hold counts)."""

    def __init__(self):
        super().__init__()
        self.store = EncoderOutputStore(4 * BUDGET_FLOATS)
        self.model: OrderedDict[bytes, list] = OrderedDict()  # key -> [size in bytes, holds]; LRU first
        self.leases: list = []
        self.computes = 0

    def _free(self) -> int:
        return self.store.budget_bytes - sum(size for size, _ in self.model.values())

    def _model_insert(self, key: bytes, size: int) -> bool:
        """The expected outcome of storing ``size`` bytes under a new key: True if stored, False if bypassed."""
        unheld = [k for k, (_, holds) in self.model.items() if holds == 0]
        if size > self.store.budget_bytes or self._free() + sum(self.model[k][0] for k in unheld) < size:
            return False
        for k in unheld:
            if self._free() >= size:
                break
            del self.model[k]
        self.model[key] = [size, 1]
        return True

    def _model_hold(self, key: bytes) -> None:
        self.model[key][1] += 1
        self.model.move_to_end(key)

    @rule(k=st.sampled_from(KEYS), floats=st.integers(1, BUDGET_FLOATS + 4))
    def put(self, k, floats):
        lease = self.store.put(k, {"x": torch.full((floats,), float(floats))})
        if k in self.model:
            assert lease.hit
            self._model_hold(k)
        else:
            assert lease.bypassed == (not self._model_insert(k, 4 * floats))
            assert torch.equal(lease.outputs["x"], torch.full((floats,), float(floats)))
        self.leases.append(lease)

    @rule(k=st.sampled_from(KEYS), floats=st.integers(1, BUDGET_FLOATS + 4))
    def get_or_compute(self, k, floats):
        def compute():
            self.computes += 1
            return {"x": torch.full((floats,), float(floats))}, {}

        before = self.computes
        lease = self.store.get_or_compute(k, compute)
        if k in self.model:
            assert lease.hit and self.computes == before
            self._model_hold(k)
        else:
            assert self.computes == before + 1
            assert lease.bypassed == (not self._model_insert(k, 4 * floats))
        self.leases.append(lease)

    @rule(k=st.sampled_from(KEYS))
    def acquire(self, k):
        lease = self.store.acquire(k)
        assert (lease is not None) == (k in self.model)
        if lease is not None:
            self._model_hold(k)
            self.leases.append(lease)

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        lease = self.leases.pop(i % len(self.leases))
        lease.release()
        lease.release()  # a second release is a no-op, never a double decrement
        if not lease.bypassed:
            self.model[lease.key][1] -= 1

    @invariant()
    def agrees_with_the_model(self):
        self.store.check_invariants()
        assert {k for k in KEYS if k in self.store} == set(self.model)
        for k, (size, holds) in self.model.items():
            assert self.store.held(k) == holds
        assert self.store.metrics.bytes == sum(size for size, _ in self.model.values()) <= self.store.budget_bytes


TestStoreChurn = StoreMachine.TestCase


@pytest.fixture(scope="module")
def wan():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_wan_pipeline()
    torch.set_num_threads(before)


def test_a_generation_stream_under_a_tight_budget(wan):
    neg = wan_negative_prompt()
    pool = parti_prompts()[200:208]
    stream = [pool[i] for i in (0, 1, 2, 0, 3, 4, 5, 0, 1, 6, 7, 0, 2, 3)]
    off = CachedWanPipeline(wan, None)
    neg_bytes = off.text.tokenize(neg, 64).length * wan.text_encoder.config.d_model * 4
    store = EncoderOutputStore(neg_bytes + 2500)  # the negative plus about one positive
    on = CachedWanPipeline(wan, store)
    computed, forward = [], on.text.forward
    on.text.forward = lambda tokens, selector: computed.append(tokens.token_bytes()) or forward(tokens, selector)
    with ForwardCounter(wan.text_encoder) as fc:
        for prompt in stream:
            with on.prepare(prompt, neg, max_sequence_length=64) as call, \
                    off.prepare(prompt, neg, max_sequence_length=64) as ref:
                assert not any(lease.bypassed for lease in call.leases)
                assert all(store.held(lease.key) == 1 for lease in call.leases)
                for name in ("prompt_embeds", "negative_prompt_embeds"):
                    assert torch.equal(call.kwargs[name], ref.kwargs[name])
                neg_key = call.leases[-1].key
            store.check_invariants()
            assert store.held(neg_key) == 0
    assert store.metrics.evictions > 0 and store.metrics.computes == len(computed)
    assert fc.total == len(computed) + 2 * len(stream)  # the store-off wrapper encodes everything
    # The negative is touched by every request, so least-recently-used eviction never drops it.
    assert computed.count(off.text.tokenize(neg, 64).token_bytes()) == 1 and neg_key in store
    assert len(computed) > len(set(stream)) + 1  # positives were evicted and encoded again


def test_a_budget_pinned_by_requests_in_flight_bypasses_and_still_answers(wan):
    neg = wan_negative_prompt()
    store = EncoderOutputStore(20_000)
    on, off = CachedWanPipeline(wan, store), CachedWanPipeline(wan, None)
    prompts = parti_prompts()[300:306]
    in_flight = [on.prepare(p, neg, max_sequence_length=64) for p in prompts]
    bypassed = [lease.bypassed for call in in_flight for lease in call.leases]
    assert any(bypassed) and not all(bypassed)
    store.check_invariants()
    for call, prompt in zip(in_flight, prompts):
        with off.prepare(prompt, neg, max_sequence_length=64) as ref:
            assert torch.equal(call.kwargs["prompt_embeds"], ref.kwargs["prompt_embeds"])
            assert torch.equal(call.kwargs["negative_prompt_embeds"], ref.kwargs["negative_prompt_embeds"])
    for call in in_flight:
        call.release()
    with on.prepare(prompts[-1], neg, max_sequence_length=64) as call:  # room again once released
        assert not any(lease.bypassed for lease in call.leases)
    store.check_invariants()
