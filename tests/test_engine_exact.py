"""The engine computes what the model computes, and caching changes nothing.

* Bit-exact gate: under the exact schedule (``EngineConfig.exact``: one request at a time, one page per
  prefill forward) every logits row of a cache-on run equals the cache-off run's bit for bit, in fp32 and
  bf16, for requests sharing prefixes, over 32 greedy tokens.
* Under the default (continuous, batched) schedule the generated tokens are equal with the cache on and off.
* Engine logits match the model's own forward (transformers sdpa, no cache) per architecture.
* Greedy outputs do not depend on which requests share a batch.
"""

import numpy as np
import pytest
import torch

from mmcache.engine import Engine, EngineConfig, Request, SamplingParams, attention
from mmcache.engine.compute import native
from mmcache.engine.inspect import exact_cfg_runs, record_logits
from mmcache.presets.text import build_model

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
FAMILIES = ["tiny-qwen2", "tiny-llama", "tiny-mistral", "tiny-gemma"]


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


def shared_prefix_prompts(seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    prefix = rng.integers(2, vocab, size=56).tolist()
    prompts = [prefix + rng.integers(2, vocab, size=n).tolist() for n in (20, 9, 30)]
    prompts.append(prefix[:40])  # a prompt that is itself a prefix of the others
    prompts.append(list(prompts[0]))  # an exact repeat
    return prompts


def run_requests(eng, prompts, sampling=GREEDY):
    return eng.generate([Request(p, sampling, request_id=i) for i, p in enumerate(prompts)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_on_logits_equal_cache_off_bit_for_bit_under_exact_schedule(dtype):
    model, tok = build_model("tiny", dtype)
    prompts = shared_prefix_prompts()
    runs = {}
    for mode in ("on", "off"):
        eng = Engine(model, tok, EngineConfig.exact(page_size=16, num_pages=128, cache_mode=mode))
        rec = record_logits(eng)
        runs[mode] = (rec, run_requests(eng, prompts), eng)
    rec_on, out_on, eng_on = runs["on"]
    rec_off, out_off, _ = runs["off"]
    # The cache really was used: every later request matched whole pages of the first.
    assert [o.matched_tokens for o in out_on] == [0, 48, 48, 32, 64]
    assert [o.matched_tokens for o in out_off] == [0] * 5
    assert eng_on.metrics()["main"]["hit_pages"] == 3 + 3 + 2 + 4
    for i in range(len(prompts)):
        assert len(rec_on[i]) == len(rec_off[i]) == 32
        for step, (a, b) in enumerate(zip(rec_on[i], rec_off[i])):
            assert torch.equal(a, b), f"request {i} step {step}: max diff {(a - b).abs().max()}"
        assert out_on[i].output_ids == out_off[i].output_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cfg_with_a_shared_negative_prompt_is_bit_exact_under_exact_schedule(dtype):
    """Both branches' logits (and so the guided tokens) equal cache-off's while the negative prompt's pages hit."""
    model, tok = build_model("tiny", dtype)
    rng = np.random.default_rng(5)
    negative = rng.integers(2, 512, size=50).tolist()
    positives = [rng.integers(2, 512, size=n).tolist() for n in (21, 37, 21)]
    sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = exact_cfg_runs(model, tok, positives, negative, sampling, 3.0, page_size=16, num_pages=128)
    (rec_on, out_on), (rec_off, out_off) = runs["on"], runs["off"]
    assert [o.negative_matched_tokens for o in out_on] == [0, 48, 48]
    assert [o.negative_matched_tokens for o in out_off] == [0, 0, 0]
    for i in range(len(positives)):
        assert len(rec_on[i]) == len(rec_off[i]) == 2 * 16  # a logits row per branch per token
        assert all(torch.equal(a, b) for a, b in zip(rec_on[i], rec_off[i])), i
        assert out_on[i].output_ids == out_off[i].output_ids


def test_default_schedule_tokens_equal_with_cache_on_and_off():
    model, tok = build_model("tiny", "float32")
    prompts = shared_prefix_prompts(seed=1)
    cfg = dict(page_size=16, num_pages=256, prefill_chunk_tokens=32, max_tokens_per_step=96)
    outs = {}
    for mode in ("on", "off"):
        eng = Engine(model, tok, EngineConfig(cache_mode=mode, **cfg))
        first = run_requests(eng, prompts[:2])  # populates the cache
        second = run_requests(eng, prompts)  # a batch that hits it
        outs[mode] = (first, second)
        eng.check_invariants()
    assert [o.matched_tokens for o in outs["on"][1]] == [64, 64, 48, 32, 64]
    for a, b in zip(outs["on"][0] + outs["on"][1], outs["off"][0] + outs["off"][1]):
        assert a.output_ids == b.output_ids


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-5), ("bfloat16", 3e-2)])
def test_engine_logits_match_the_models_own_forward(name, dtype, tol, monkeypatch, decode_path):
    """Chunked, batched, paged prefill and decode give the logits of a plain sdpa forward over the sequence,
    within 2e-5 (fp32) or 3e-2 (bf16) of the largest logit, with decodes on the compiled kernel and on ATen.

    tiny-mistral has a 48-token sliding window and prompts of up to 86 tokens, so the window is exercised.
    The others decode requests that share cached pages together, so on ATen's path the shared-pages (cascade)
    path is exercised too.
    """
    cascades, kernel_calls = [], []
    real = attention._over_shared_pages
    monkeypatch.setattr(attention, "_over_shared_pages", lambda *a: cascades.append(1) or real(*a))
    real_kernel = native.decode_attention
    monkeypatch.setattr(native, "decode_attention", lambda *a: kernel_calls.append(1) or real_kernel(*a))
    ref, _ = build_model(name, dtype)
    model, tok = build_model(name, dtype)
    eng = Engine(model, tok, EngineConfig(page_size=16, num_pages=128, prefill_chunk_tokens=32,
                                          max_tokens_per_step=64))
    rec = record_logits(eng)
    prompts = shared_prefix_prompts(seed=2)[:3] + [[7, 8, 9, 10, 11]]
    outs = run_requests(eng, prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    prompts.append(prompts[0][:70])
    outs += eng.generate([Request(prompts[-1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                  request_id=4)])
    assert outs[-1].matched_tokens == 64  # the last one read cached pages
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        seq = torch.tensor(prompt + out.output_ids)[None]
        with torch.no_grad():
            want = ref(seq).logits[0].float()[len(prompt) - 1: len(prompt) - 1 + len(out.output_ids)]
        got = torch.stack(rec[i])
        assert got.shape == want.shape
        # Tolerance relative to the largest logit: bf16 carries 8 bits of mantissa through every layer.
        torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=0)
    if decode_path == "aten":
        assert not kernel_calls and (len(cascades) > 0) == (name != "tiny-mistral")  # a window: no cascade
    else:
        assert kernel_calls and not cascades


def test_greedy_outputs_do_not_depend_on_batch_company():
    model, tok = build_model("tiny-llama", "float32")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (5, 40, 17, 70, 33)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cfg = EngineConfig(page_size=16, num_pages=256, cache_mode="off", prefill_chunk_tokens=32, max_tokens_per_step=80)
    eng = Engine(model, tok, cfg)
    alone = [eng.generate([p], sp)[0].output_ids for p in prompts]
    together = [o.output_ids for o in eng.generate(prompts, sp)]
    reversed_batch = [o.output_ids for o in eng.generate(prompts[::-1], sp)][::-1]
    assert alone == together == reversed_batch
    assert len({tuple(x) for x in alone}) == len(prompts)  # the model is not degenerate
