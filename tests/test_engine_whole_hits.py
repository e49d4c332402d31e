"""Whole hits (``EngineConfig.whole_hits``): a prompt held whole in the cache computes only its last token again.

* Where the engine takes it (``Engine.whole_hits``: a bfloat16 model whose forward gives each row the same bits
  in any company; see ``CausalLMAdapter.whole_hit_blocker``), a repeated prompt of whole pages is matched to its
  end, its first token costs a forward of one row, and every logits row equals the cache-off run's under the
  exact schedule bit for bit (both branches of a CFG request too).
* Elsewhere (float32, ATen attention, settings off) the engine says why and leaves the last page to compute.
* The engine takes them wherever the CPU has AVX-512 BF16, and the tests assert so there: only a CPU without it
  skips them.
* A forward that fails on a whole hit returns every page; the pages stay in the index for the next request.
"""

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from mmcache.engine import ComputeConfig, ComputeConfigError, Engine, EngineConfig, Request, SamplingParams
from mmcache.engine.compute import native
from mmcache.engine.inspect import exact_cfg_runs, exact_runs, rows_equal
from mmcache.presets.text import build_model
from skips import Machine

PAGE = 16
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(autouse=True, params=["default", native.PRODUCTS_VECTOR])
def products(request, monkeypatch, native_kernel):
    """Each test on the kernels this CPU gives an engine, then with the tile unit switched off
    (``MMCACHE_TILE_UNIT=off``): products and prefill chunks on the vector unit's ways, as on a CPU with AVX-512
    BF16 and no tile unit (AMD Zen 4); skipped where the library has no vector way. Whole hits need the compiled
    library, so it is required here (``native_kernel``) whatever ``MMCACHE_NATIVE`` says."""
    if request.param == "default":
        yield request.param
        return
    if not native.vector_products(native_kernel):
        pytest.skip("no AVX-512 BF16 here: the vector way does not run")
    monkeypatch.setenv(native.ENV_TILES, "off")
    native.reset()
    try:
        lib = native.library()
        assert native.product_way(lib) == native.PRODUCTS_VECTOR and not lib.tiles
        yield request.param
    finally:
        native.reset()  # the next test loads the library as its environment says


def qwen2(dtype: str = "bfloat16") -> Qwen2ForCausalLM:
    """A two-layer Qwen2 with head size 64 (what the chunk kernel takes on the tile unit), seeded weights."""
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                      tie_word_embeddings=True, use_sliding_window=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(getattr(torch, dtype)).eval()


def taken_where_the_cpu_allows(model) -> Engine:
    """An engine over the bfloat16 ``model`` that takes whole hits, which it must wherever the CPU has AVX-512
    BF16 (every product, the chunk attention and the activation then run on a row-exact way): there an engine
    that stopped taking them fails here rather than reading as a skip. Elsewhere the test skips, naming why."""
    probe = Engine(model, None, EngineConfig.exact(page_size=PAGE, num_pages=64))
    if Machine.here().bf16:
        assert probe.whole_hits, f"whole hits not taken on a CPU with AVX-512 BF16: {probe.whole_hits_skipped}"
    elif not probe.whole_hits:
        pytest.skip(f"no AVX-512 BF16 here: whole hits are not exact on this machine ({probe.whole_hits_skipped})")
    return probe


def expected_forward_tokens(prompts, matched, tokens_each):
    """Tokens of every forward: the unmatched prompt (one row for a whole hit), then a decode per later token."""
    return sum(len(p) - m + (m == len(p)) + tokens_each - 1 for p, m in zip(prompts, matched))


def test_whole_hits_equal_the_exact_schedule_bit_for_bit():
    model = qwen2()
    taken_where_the_cpu_allows(model)
    rng = np.random.default_rng(0)
    a = rng.integers(2, 512, size=4 * PAGE).tolist()
    prompts = [a, list(a), a[:3 * PAGE], a[:3 * PAGE] + rng.integers(2, 512, size=20).tolist(), a + [7]]
    runs = exact_runs(model, None, prompts, GREEDY, page_size=PAGE, num_pages=128)
    rows_on, out_on, eng_on = runs["on"]
    rows_off, out_off, eng_off = runs["off"]
    matched = [o.matched_tokens for o in out_on]
    assert matched == [0, 64, 48, 48, 64]  # the repeat and the prefix whole; the others up to their last page
    way = native.product_way(native.library())
    assert f"+native-{'tile' if way == native.PRODUCTS_TILES else 'vector'}-rows" in eng_on.backend
    for i in range(len(prompts)):
        assert rows_equal(rows_on, rows_off, i, 32), f"request {i}"
        assert out_on[i].output_ids == out_off[i].output_ids
    assert eng_on.counters["forward_tokens"] == expected_forward_tokens(prompts, matched, 32)
    assert eng_off.counters["forward_tokens"] == expected_forward_tokens(prompts, [0] * 5, 32)
    eng_on.check_invariants()


def test_cfg_branches_whole_hit_bit_for_bit():
    model = qwen2()
    taken_where_the_cpu_allows(model)
    rng = np.random.default_rng(3)
    negative = rng.integers(2, 512, size=3 * PAGE).tolist()
    positives = [rng.integers(2, 512, size=2 * PAGE).tolist() for _ in range(2)]
    positives.append(list(positives[0]))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = exact_cfg_runs(model, None, positives, negative, params, 2.5, page_size=PAGE, num_pages=128)
    (rec_on, out_on), (rec_off, out_off) = runs["on"], runs["off"]
    assert [o.negative_matched_tokens for o in out_on] == [0, 48, 48]
    assert [o.matched_tokens for o in out_on] == [0, 0, 32]
    for i in range(3):
        assert rows_equal(rec_on, rec_off, i, 2 * 12), f"request {i}"
        assert out_on[i].output_ids == out_off[i].output_ids


def test_default_schedule_whole_hits_give_the_cache_off_tokens():
    model = qwen2()
    taken_where_the_cpu_allows(model)
    rng = np.random.default_rng(4)
    a = rng.integers(2, 512, size=5 * PAGE).tolist()
    prompts = [a, list(a), a[:2 * PAGE], list(a)]  # the repeats wait for a's pages, then match them whole
    outs = {}
    for mode in ("on", "off"):
        eng = Engine(model, None, EngineConfig(page_size=PAGE, num_pages=128, cache_mode=mode))
        outs[mode] = eng.generate([Request(p, GREEDY, request_id=i) for i, p in enumerate(prompts)])
        eng.check_invariants()
    assert [o.matched_tokens for o in outs["on"]] == [0, 80, 32, 80]
    assert [o.output_ids for o in outs["on"]] == [o.output_ids for o in outs["off"]]


def test_a_failed_forward_on_a_whole_hit_returns_every_page():
    model = qwen2()
    eng = taken_where_the_cpu_allows(model)
    prompt = np.random.default_rng(5).integers(2, 512, size=2 * PAGE).tolist()
    first = eng.generate([Request(prompt, GREEDY)])[0]
    run = eng.runner.run

    def failing(works):
        if any(not w.write for w in works):
            raise RuntimeError("injected")
        return run(works)

    eng.runner.run = failing
    failed = eng.generate([Request(prompt, GREEDY)])[0]
    assert failed.finish_reason == "error" and failed.output_ids == []
    eng.check_invariants()
    main = eng.managers["main"]
    assert main.pool.num_free == main.pool.num_pages - main.index.size  # only the index holds pages
    eng.runner.run = run
    again = eng.generate([Request(prompt, GREEDY)])[0]
    assert again.matched_tokens == len(prompt) and again.output_ids == first.output_ids
    eng.check_invariants()


def test_where_rows_are_not_independent_the_last_page_is_computed_again():
    f32 = Engine(qwen2("float32"), None, EngineConfig.exact(page_size=PAGE, num_pages=64))
    assert not f32.whole_hits and isinstance(f32.whole_hits_skipped, str) and f32.whole_hits_skipped
    tiny, _ = build_model("tiny", "bfloat16")  # head size 16: attention on ATen's kernels
    eng = Engine(tiny, None, EngineConfig.exact(page_size=PAGE, num_pages=64))
    assert not eng.whole_hits and eng.whole_hits_skipped
    prompt = list(range(2, 2 + 3 * PAGE))
    outs = eng.generate([Request(prompt, GREEDY), Request(prompt, GREEDY)])
    assert [o.matched_tokens for o in outs] == [0, 2 * PAGE]
    asked_off = Engine(qwen2(), None, EngineConfig(page_size=PAGE, num_pages=64,
                                                   compute=ComputeConfig(whole_hits=False)))
    cache_off = Engine(qwen2(), None, EngineConfig(page_size=PAGE, num_pages=64, cache_mode="off"))
    for e in (asked_off, cache_off):
        assert not e.whole_hits and e.whole_hits_skipped is None  # not asked for: nothing to explain
    with pytest.raises(ComputeConfigError, match="whole_hits"):
        EngineConfig(compute=ComputeConfig(whole_hits="yes"))
