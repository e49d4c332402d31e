"""Engines built on one model object share its modules, and may step at once from several threads.

* ``kernels.PackedProjections`` keeps its parts per thread: a thread that another thread interrupts inside
  ``part``, between the check that its tensor's parts are kept and the read of the part, still gets the part
  of its own tensor, and the interrupting thread gets its own. The switch is forced there by the part index's
  ``__index__``: deterministic, and standing for a switch that a free-threaded interpreter may make anywhere.
* Two engines on one model stepping concurrently from two threads, for many steps, each produce exactly the
  logits and tokens they produce alone.
"""

import sys
import time
import threading

import numpy as np
import pytest
import torch
from torch import nn

from mmcache.engine import Engine, EngineConfig, Request, SamplingParams
from mmcache.engine.compute import kernels
from mmcache.engine.inspect import record_logits
from mmcache.presets.text import build_model

pytestmark = [pytest.mark.usefixtures("one_thread"),  # see conftest
              pytest.mark.skipif(not kernels.available(torch.device("cpu"), torch.float32),
                                 reason="oneDNN is not available in this torch build")]


class Interrupting:
    """A part index whose first lookup runs ``intrude`` to completion on another thread: the interleaving of a
    thread switch inside ``PackedProjections.part``, made deterministic (no timing involved)."""

    def __init__(self, index: int, intrude):
        self.index, self.intrude, self.done = index, intrude, False

    def __index__(self) -> int:
        if not self.done:
            self.done = True
            other = threading.Thread(target=self.intrude)
            other.start()
            other.join()
        return self.index


def run_on_thread(fn):
    """``fn()`` run on a thread of its own; returns its result (re-raises its exception)."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_thread_interrupted_inside_part_gets_its_own_tensors_part():
    torch.manual_seed(0)
    group = kernels.PackedProjections([nn.Linear(32, w, bias=True) for w in (32, 16, 16)])
    mine, theirs = torch.randn(3, 32), torch.randn(3, 32)
    want = {id(x): [group.part(i, x).clone() for i in range(3)] for x in (mine, theirs)}
    got_theirs = []

    q = group.part(0, mine)  # this thread keeps k and v of ``mine``
    # Another thread's forward starts (its q) while this thread is inside part(1, mine), after the check.
    k = group.part(Interrupting(1, lambda: got_theirs.append(group.part(0, theirs))), mine)
    assert torch.equal(k, want[id(mine)][1]), "this thread was handed the other thread's k"
    assert group._x is mine  # the other thread kept its parts beside this thread's, not over them
    v = group.part(2, mine)
    got_theirs += run_on_thread(lambda: [group.part(1, theirs), group.part(2, theirs)])

    for name, got, expected in zip("qkv", (q, k, v), want[id(mine)]):
        assert torch.equal(got, expected), f"{name} of this thread's tensor is another tensor's"
    for name, got, expected in zip("qkv", got_theirs, want[id(theirs)]):
        assert torch.equal(got, expected), f"{name} of the other thread's tensor is another tensor's"
    assert group._x is None and group._parts == ()  # nothing kept once every part is out
    assert run_on_thread(lambda: (group._x, group._parts)) == (None, ())


def workload(seed: int, lengths) -> list[Request]:
    """Prompts sharing a prefix (cache hits, prefill chunks beside decodes), greedy, of several lengths."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, 512, size=40).tolist()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [Request(prefix + rng.integers(2, 512, size=n).tolist(), params, request_id=i)
            for i, n in enumerate(lengths)]


def served(engine: Engine, requests: list[Request]):
    """``engine``'s outputs for ``requests`` and every logits row it sampled from (per request, in order)."""
    rows = record_logits(engine)
    outputs = engine.generate(requests)
    return [(o.output_ids, o.finish_reason) for o in outputs], rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_engines_on_one_model_stepping_at_once_compute_what_each_computes_alone(dtype):
    model, tok = build_model("tiny", dtype)
    config = EngineConfig(page_size=8, num_pages=96, max_num_seqs=4, prefill_chunk_tokens=24)
    loads = [workload(1, (3, 17, 9, 30, 1, 12)), workload(2, (21, 5, 14, 2, 26, 8))]
    alone = [served(Engine(model, tok, config), requests) for requests in loads]
    attention = model.get_decoder().layers[0].self_attn
    assert isinstance(attention.q_proj, kernels.PackedProjection)  # the shared group under test is in use

    engines = [Engine(model, tok, config) for _ in loads]  # fresh: the first ones' caches hold these prompts
    results: list = [None, None]
    start = threading.Barrier(2)

    def serve(i: int) -> None:
        start.wait()
        results[i] = served(engines[i], loads[i])

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can: every interleaving is likely
    try:
        threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)

    for i, ((outs, rows), (want_outs, want_rows)) in enumerate(zip(results, alone)):
        assert outs == want_outs, f"engine {i}: tokens differ from its run alone"
        assert engines[i].counters["steps"] > 20
        for rid, want in want_rows.items():
            assert len(rows[rid]) == len(want) == 24
            for step, (a, b) in enumerate(zip(rows[rid], want)):
                assert torch.equal(a, b), f"engine {i} request {rid} step {step}: logits differ from its run alone"
        engines[i].check_invariants()


def test_setting_up_a_model_is_done_by_one_engine_at_a_time(monkeypatch):
    # Engines built at once on one model object from several threads: each step that reads or replaces the
    # model's modules runs under the engine module's set-up lock, so neither both replace the modules nor one
    # names its backend from a model another is half-way through packing.
    from mmcache.engine import adapter as adapter_module
    from mmcache.engine import engine as engine_module
    from mmcache.engine.compute import ComputePath

    seen: list[tuple[str, bool]] = []
    for owner, name in ((adapter_module.CausalLMAdapter, "attach"), (ComputePath, "claim"),
                        (ComputePath, "pack_linears"), (ComputePath, "install_layer_kernels")):
        original = getattr(owner, name)

        def watched(self, *args, _name=name, _original=original, **kwargs):
            seen.append((_name, engine_module._SETTING_UP.locked()))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(owner, name, watched)
    model, tok = build_model("tiny")
    config = EngineConfig(page_size=8, num_pages=32)
    engines = run_on_thread(lambda: [Engine(model, tok, config)]) + [Engine(model, tok, config)]
    assert {name for name, _ in seen} >= {"attach", "claim", "pack_linears"}
    assert all(locked for _, locked in seen), seen
    assert engines[0].fingerprint == engines[1].fingerprint and engines[0].backend == engines[1].backend


def test_engines_built_at_once_on_one_model_agree_and_compute_as_one_built_alone():
    model, tok = build_model("tiny")
    alone_model, _ = build_model("tiny")
    config = EngineConfig(page_size=8, num_pages=32)
    start = threading.Barrier(3)

    def build():
        start.wait()
        return Engine(model, tok, config)

    built: list = []
    threads = [threading.Thread(target=lambda: built.append(build())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    alone = Engine(alone_model, tok, config)
    assert len(built) == 3 and len({(e.backend, e.fingerprint) for e in built + [alone]}) == 1
    requests = workload(3, (5, 19))
    want = [o.output_ids for o in alone.generate(requests)]
    for engine in built:
        assert [o.output_ids for o in engine.generate(requests)] == want
        engine.check_invariants()


def test_the_native_library_is_built_and_loaded_once_by_threads_wanting_it_at_once(monkeypatch):
    from mmcache.engine.compute import native

    builds = []

    def slow_build(**_):
        builds.append(threading.get_ident())
        time.sleep(0.3)  # a compiler run: another thread arriving now must wait for this build, not start its own
        raise native.NativeKernelUnavailable("test build")

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "build", slow_build)
    monkeypatch.setenv("MMCACHE_NATIVE", "auto")
    start = threading.Barrier(3)

    def want():
        start.wait()
        return native.library()

    results = []
    threads = [threading.Thread(target=lambda: results.append(want())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [None, None, None] and len(builds) == 1
    assert native._state == {"why": "test build", "lib": None}


def test_reset_waits_for_a_build_in_progress(monkeypatch):
    # reset() cleared the state without the lock, so a library() reading it after its build could meet an
    # empty dict (KeyError); reset now takes the lock and so waits for the build.
    from mmcache.engine.compute import native

    building, finish = threading.Event(), threading.Event()

    def slow_build(**_):
        building.set()
        finish.wait(5)
        raise native.NativeKernelUnavailable("test build")

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "build", slow_build)
    monkeypatch.setenv("MMCACHE_NATIVE", "auto")
    results = []
    builder = threading.Thread(target=lambda: results.append(native.library()))
    builder.start()
    building.wait(5)
    resetter = threading.Thread(target=native.reset)
    resetter.start()
    resetter.join(0.2)
    assert resetter.is_alive()  # held off while the build runs
    finish.set()
    builder.join()
    resetter.join()
    assert results == [None] and native._state == {}
