"""Encoder-output store: keys, budget, holding, bypass, single computation under concurrency, validation."""

import copy
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from mmcache import EncoderOutputStore, InvalidRequest, OutputSpec, StoreEntryRejected, media_digest, store_key


def key(i, salt=b"", enc="enc"):
    return store_key(enc, media_digest(str(i).encode()), salt)


def entry(n_floats):
    return {"features": torch.zeros(n_floats)}, {"placeholders": n_floats}


def test_keys_separate_encoders_contents_and_salts():
    keys = {key(1), key(2), key(1, b"tenant"), key(1, enc="other")}
    assert len(keys) == 4 and all(len(k) == 32 for k in keys)
    assert key(1, "tenant") == key(1, b"tenant")
    for bad in ({"salt": "tenant-\ud800"}, {"enc": "encoder-\udfff"}):  # not UTF-8 encodable: typed errors
        with pytest.raises(InvalidRequest):
            key(1, **bad)


def test_store_keys_take_the_namers_salt_bound_and_refuse_keys_of_another_size():
    assert key(1, "t" * 256) != key(1, "t" * 255)
    for salt in ("t" * 257, b"t" * 257, 7):
        with pytest.raises(InvalidRequest, match="salt"):
            key(1, salt)
    store = EncoderOutputStore(1 << 10)
    for bad in (key(1)[:16], key(1) + b"x"):  # a 16-byte key was the old xxh3_128 size
        with pytest.raises(InvalidRequest, match="32-byte"):
            store.acquire(bad)
        assert bad not in store


def test_hit_after_compute_and_lease_holds_until_released():
    store = EncoderOutputStore(1000)
    calls = []
    compute = lambda: (calls.append(1), entry(10))[1]
    with store.get_or_compute(key(1), compute) as first:
        assert not first.hit and store.held(key(1)) == 1
        with store.get_or_compute(key(1), compute) as second:
            assert second.hit and second.outputs["features"] is first.outputs["features"]
            assert store.held(key(1)) == 2
    assert store.held(key(1)) == 0 and len(calls) == 1
    store.get_or_compute(key(2), lambda: entry(10)).release()
    assert store.keys() == [key(1), key(2)]
    store.acquire(key(1)).release()
    assert store.keys() == [key(2), key(1)]  # least recently used first
    m = store.metrics
    assert (m.lookups, m.hits, m.computes, m.inserts, m.bytes) == (4, 2, 2, 2, 80)


def test_budget_lru_held_entries_and_bypass_under_churn():
    store = EncoderOutputStore(400)  # ten entries of 40 bytes
    pinned = store.get_or_compute(key("pinned"), lambda: entry(10))
    for i in range(200):
        with store.get_or_compute(key(i % 23), lambda: entry(10)):
            store.check_invariants()
            assert store.metrics.bytes <= 400
        assert key("pinned") in store, "a held entry was evicted"
    assert store.metrics.evictions > 0
    pinned.release()
    # an entry larger than the budget bypasses, and the caller still gets its outputs
    with store.get_or_compute(key("huge"), lambda: entry(1000)) as big:
        assert big.bypassed and big.outputs["features"].numel() == 1000
    assert key("huge") not in store and store.metrics.bypasses == 1
    store.check_invariants()


def test_bypass_when_held_entries_pin_the_budget():
    store = EncoderOutputStore(80)
    a = store.get_or_compute(key(1), lambda: entry(10))
    b = store.get_or_compute(key(2), lambda: entry(10))
    with store.get_or_compute(key(3), lambda: entry(10)) as c:
        assert c.bypassed and key(1) in store and key(2) in store
    a.release(), b.release()
    with store.get_or_compute(key(3), lambda: entry(10)) as c:
        assert not c.bypassed and key(3) in store
    assert store.metrics.evictions == 1 and key(2) in store  # key(1) was least recently used


def test_lru_order():
    store = EncoderOutputStore(120)
    for i in range(3):
        store.get_or_compute(key(i), lambda: entry(10)).release()
    store.acquire(key(0)).release()  # 0 is now the most recent
    store.get_or_compute(key(3), lambda: entry(10)).release()
    assert key(1) not in store and all(key(i) in store for i in (0, 2, 3))


def test_concurrent_callers_compute_once():
    store = EncoderOutputStore(1000)
    calls, leases = [], []
    gate = threading.Event()

    def slow():
        calls.append(1)
        gate.wait(5)
        return entry(10)

    threads = [threading.Thread(target=lambda: leases.append(store.get_or_compute(key(9), slow))) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    gate.set()
    for t in threads:
        t.join()
    assert len(calls) == 1 and sum(l.hit for l in leases) == 3
    for l in leases:
        l.release()
    assert store.held(key(9)) == 0


def test_failed_compute_stores_nothing_and_the_next_caller_computes():
    store = EncoderOutputStore(1000)
    with pytest.raises(ZeroDivisionError):
        store.get_or_compute(key(1), lambda: 1 / 0)
    assert key(1) not in store and len(store) == 0
    with store.get_or_compute(key(1), lambda: entry(5)) as lease:
        assert not lease.hit


def test_spec_refuses_wrong_shape_dtype_and_names():
    spec = OutputSpec({"features": ((None, 8), torch.float32)})
    store = EncoderOutputStore(10_000)
    store.put(key(1), {"features": torch.zeros(3, 8)}, spec=spec).release()
    for bad in ({"features": torch.zeros(3, 9)}, {"features": torch.zeros(3, 8, dtype=torch.bfloat16)},
                {"features": torch.zeros(8)}, {"other": torch.zeros(3, 8)}, {"features": [1.0]}):
        with pytest.raises(StoreEntryRejected):
            store.put(key(2), bad, spec=spec)
    assert key(2) not in store
    with pytest.raises(StoreEntryRejected):
        store.put(key(3), {})
    with pytest.raises(InvalidRequest):
        store.put(b"short", {"features": torch.zeros(1)})
    with pytest.raises(InvalidRequest):
        EncoderOutputStore(-1)
    store.check_invariants()


def test_views_into_larger_storage_are_compacted_so_the_budget_is_honest():
    store = EncoderOutputStore(100_000)
    big = torch.arange(512 * 256, dtype=torch.float32).view(512, 256)
    with store.put(key(1), {"features": big[:10]}) as lease:
        kept = lease.outputs["features"]
        assert torch.equal(kept, big[:10])
        assert kept.untyped_storage().nbytes() == 10 * 256 * 4 == store.metrics.bytes
    # A tensor over a slice of a numpy array reports only the slice as its storage, yet keeps the whole array
    # alive: the store keeps a copy of its own, so 40 bytes of budget hold 40 bytes, not 40 MB.
    array = np.zeros(10_000_000, dtype=np.float32)
    with store.put(key(2), {"features": torch.from_numpy(array[:10])}) as lease:
        assert store.metrics.bytes == 10 * 256 * 4 + 40
        array[:10] = 1  # and the caller's memory stays the caller's
        assert not lease.outputs["features"].any()
        assert not np.shares_memory(lease.outputs["features"].numpy(), array)
    whole = torch.zeros(4, 4)
    with store.put(key(3), {"features": whole}) as lease:
        whole += 1
        assert not lease.outputs["features"].any()


def test_malformed_keys_specs_meta_and_compute_results_are_refused_and_store_nothing():
    store = EncoderOutputStore(10_000)
    ran = []

    def compute():
        ran.append(1)
        return entry(4)

    with pytest.raises(InvalidRequest):  # refused before the (expensive) compute runs
        store.get_or_compute(b"short", compute)
    with pytest.raises(InvalidRequest, match="OutputSpec"):  # a bad spec too (it ran compute, then refused)
        store.get_or_compute(key(2), compute, spec={"features": ((None,), torch.float32)})
    assert ran == [] and store.metrics.computes == 0
    for bad in (None, 7, ""):
        with pytest.raises(InvalidRequest):
            store_key(bad, media_digest(b"x"))
    for bad in ({"features": ((8,), "float32")}, {"features": ((8.0,), torch.float32)}, {"features": (8, torch.float32)},
                {3: ((8,), torch.float32)}, [("features", ((8,), torch.float32))]):
        with pytest.raises(InvalidRequest):
            OutputSpec(bad)
    with pytest.raises(StoreEntryRejected):
        store.put(key(1), {"features": torch.zeros(2)}, meta=[("placeholders", 2)])
    for result in (None, {"features": torch.zeros(2)}, (entry(2), {}, {})):
        with pytest.raises(StoreEntryRejected, match="compute must return"):
            store.get_or_compute(key(2), lambda result=result: result)
    spec = OutputSpec({"features": ((None,), torch.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype API
        nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    for outputs, with_spec in (({1: torch.zeros(2), "features": torch.zeros(2)}, True),  # sorted() raised TypeError
                               ({"features": torch.zeros(4).to_sparse()}, False),  # NotImplementedError
                               ({"features": nested}, True), ({"features": nested}, False)):  # RuntimeError
        with pytest.raises(StoreEntryRejected):
            store.put(key(3), outputs, spec=spec if with_spec else None)
    # meta holds plain values: a tensor or array there would live outside the budget
    for meta in ({"grid": torch.zeros(1000)}, {"grid": np.zeros(3)}, {"rows": [1, {"deep": torch.zeros(1)}]},
                 {1: "not a str key"}, {"obj": object()}):
        with pytest.raises(StoreEntryRejected, match="plain values"):
            store.put(key(3), {"features": torch.zeros(2)}, meta=meta)
    with pytest.raises(InvalidRequest, match="OutputSpec"):  # AttributeError before
        store.put(key(3), {"features": torch.zeros(2)}, spec={"features": ((None,), torch.float32)})
    for bad in ([1], None, b"short"):  # unhashable keys raised TypeError
        with pytest.raises(InvalidRequest):
            store.acquire(bad)
        assert bad not in store and store.held(bad) == 0
    assert len(store) == 0 and not store._computing and store.metrics.lookups == 3  # refused keys count none
    with store.put(key(5), {"features": torch.zeros(2)}, meta={"n": np.int64(2), "grid": [1, 2, (3,)], "t": b"\x00",
                                                                "x": {"a": None, "b": 0.5, "c": True}}) as lease:
        assert lease.meta["grid"] == (1, 2, (3,))  # frozen: lists become tuples, dicts read-only mappings
        with pytest.raises(TypeError):
            lease.meta["x"]["a"] = 1
    grid = [2, 2]
    with store.put(key(6), {"features": torch.zeros(2)}, meta={"grid": grid}) as lease:
        grid.append(7)  # the caller's list stays the caller's
        assert lease.meta["grid"] == (2, 2) and store.acquire(key(6)).meta["grid"] == (2, 2)
    with store.get_or_compute(key(2), compute) as lease:  # the next caller computes
        assert not lease.hit and ran == [1]
    # the same 16 bytes in a bytearray name the same entry (it raised TypeError: unhashable)
    with store.get_or_compute(bytearray(key(2)), compute) as lease:
        assert lease.hit and ran == [1] and store.held(bytearray(key(2))) == 1 and bytearray(key(2)) in store
    with store.put(bytearray(key(4)), {"features": torch.zeros(2)}) as lease:
        assert not lease.bypassed and key(4) in store and lease.key == key(4)
    store.check_invariants()


def test_waiters_on_a_computation_that_bypassed_take_its_outputs_not_a_run_each():
    store = EncoderOutputStore(budget_bytes=0)  # nothing fits: every output bypasses
    runs, leases, start = [], [], threading.Barrier(6)

    def compute():
        runs.append(1)
        time.sleep(0.3)  # long enough for every other caller to be waiting on this computation
        return {"features": torch.arange(4.0)}, {"n": 4}

    def call():
        start.wait()
        leases.append(store.get_or_compute(key(9), compute))

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(runs) == 1 and len(leases) == 6 and all(lease.bypassed for lease in leases)
    assert all(torch.equal(lease.outputs["features"], torch.arange(4.0)) and lease.meta == {"n": 4}
               for lease in leases)
    assert store.metrics.bypasses == 6 and store.metrics.computes == 1 and not store._computing
    store.check_invariants()


def test_a_lease_cannot_repoint_the_entry_and_a_copy_releases_nothing_more():
    store = EncoderOutputStore(1000)
    first = store.put(key(1), *entry(4))
    with pytest.raises(TypeError):  # read-only views: later hits would get the other tensor, unbudgeted
        first.outputs["features"] = torch.zeros(10_000)
    with pytest.raises(TypeError):
        first.meta["placeholders"] = 99
    second = store.acquire(key(1))
    copied = copy.copy(first)
    first.release()
    copied.release()  # released twice the one hold, and dropped second's: the entry could be evicted while held
    first.release()
    assert store.held(key(1)) == 1
    with store.put(key(2), {"features": torch.zeros(250)}) as big:  # the whole budget: key(1) is held ...
        assert big.bypassed  # ... so it bypasses (key(1) was evicted while second held it)
    assert key(1) in store and torch.equal(second.outputs["features"], torch.zeros(4))
    second.release()
    assert store.held(key(1)) == 0 and store.acquire(key(1)).meta["placeholders"] == 4
    store.check_invariants()


def test_metrics_count_each_kind_of_entry_apart():
    store = EncoderOutputStore(400)  # ten entries of 40 bytes
    store.get_or_compute(key("bias"), lambda: entry(10), kind="position_bias").release()
    for i in range(12):  # outputs push the unheld bias out first (least recently used), then each other
        store.get_or_compute(key(i), lambda: entry(10)).release()
    store.acquire(key(11)).release()
    assert store.acquire(key("bias"), kind="position_bias") is None
    out, bias = store.metrics.kinds["output"], store.metrics.kinds["position_bias"]
    assert (out.lookups, out.hits, out.computes, out.inserts, out.entries, out.bytes) == (13, 1, 12, 12, 10, 400)
    assert (bias.lookups, bias.computes, bias.evictions, bias.evicted_bytes, bias.entries, bias.bytes) == \
        (2, 1, 1, 40, 0, 0)
    assert out.evictions == 2 and store.metrics.evictions == 3 and store.metrics.entries == 10
    assert bias.peak_bytes == 40 and store.metrics.peak_bytes == 400
    d = store.metrics.as_dict()
    assert d["kinds"]["output"]["computes"] == 12 and "kinds" not in d["kinds"]["output"]
    assert store.metrics.kind("never").computes == 0
    store.check_invariants()


def test_a_held_entry_too_big_bypasses_under_its_own_kind_and_bad_kinds_are_refused():
    store = EncoderOutputStore(40)
    held = store.get_or_compute(key(1), lambda: entry(10))
    lease = store.get_or_compute(key(2), lambda: entry(10), kind="position_bias")
    assert lease.bypassed and store.metrics.kinds["position_bias"].bypasses == 1
    assert store.metrics.kinds["output"].bypasses == 0
    held.release()
    for bad in ("", None, 3):
        with pytest.raises(InvalidRequest):
            store.get_or_compute(key(3), lambda: entry(1), kind=bad)
        with pytest.raises(InvalidRequest):
            store.acquire(key(3), kind=bad)
        with pytest.raises(InvalidRequest):
            store.put(key(3), *entry(1), kind=bad)
    assert len(store) == 1
    store.check_invariants()
