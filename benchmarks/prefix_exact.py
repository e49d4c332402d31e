"""The bit-exactness check of ``mmcache bench prefix``: mmcache with the cache on against the cache off under
the exact schedule (one request at a time, one page per prefill forward), on prompts that hit the cache: every
logits row and output id equal.
"""

from __future__ import annotations

import gc

from . import text_workloads as tw


# bit_exact_check's first prompt is 3 pages and EXACT_EXTRA tokens; its follow-up adds the answer and EXACT_TAIL
EXACT_EXTRA, EXACT_TAIL, EXACT_NEW_TOKENS = 37, 20, 8


def bit_exact_len(page_size: int) -> int:
    """The longest context of ``bit_exact_check``: its follow-up prompt (the first prompt, its answer and the
    new tail) and that prompt's own answer."""
    return 3 * page_size + EXACT_EXTRA + EXACT_NEW_TOKENS + EXACT_TAIL + EXACT_NEW_TOKENS


def bit_exact_check(model_dir: str, dtype: str, page_size: int, space: tw.TokenSpace, seed: int,
                    store_at: str = "teardown") -> dict:
    """Cache on against cache off under the exact schedule (``EngineConfig.exact``: one request at a time, one
    page per prefill forward), on prompts that hit: a full repeat, a shared prefix with a new tail, a prompt
    ending on a page boundary, and a continuation of an earlier answer. Every logits row the engine samples
    from, and every output id, must be equal bit for bit, and the cache-on run must have hit."""
    from mmcache.engine import Engine, EngineConfig, Request, SamplingParams
    from mmcache.engine.inspect import record_logits, rows_equal

    rng = tw.random.Random(f"bit_exact:{seed}")
    a = space.draw(rng, 3 * page_size + EXACT_EXTRA)
    b = a[: 2 * page_size] + space.draw(rng, page_size // 2 + 5)
    c = a[: 3 * page_size]
    tail = space.draw(rng, EXACT_TAIL)
    params = SamplingParams(max_tokens=EXACT_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode in ("on", "off"):
        config = EngineConfig.exact(page_size=page_size, cache_mode=mode, store_at=store_at)
        eng = Engine.from_pretrained(model_dir, dtype=dtype, config=config)
        logits = record_logits(eng)
        outs = [eng.generate([Request(list(p), params, request_id=f"x{i}")])[0] for i, p in enumerate([a, a, b, c])]
        follow = list(a) + list(outs[0].output_ids) + list(tail)
        outs.append(eng.generate([Request(follow, params, request_id="x-follow")])[0])
        for o in outs:
            if o.error is not None:
                raise o.error
        eng.check_invariants()
        runs[mode] = (outs, logits)
        del eng
        gc.collect()
    (on, on_logits), (off, off_logits) = runs["on"], runs["off"]
    tokens_equal = [x.output_ids == y.output_ids for x, y in zip(on, off)]
    logits_equal = [rows_equal(on_logits, off_logits, o.request_id, len(o.output_ids)) for o in on]
    matched = [o.matched_tokens for o in on]
    return {"bit_exact": all(tokens_equal) and all(logits_equal) and sum(matched) > 0,
            "tokens_equal": tokens_equal, "logits_equal": logits_equal, "matched_tokens_on": matched,
            "schedule": "EngineConfig.exact: serial, one page per prefill forward", "store_at": store_at,
            "compared": "every sampled logits row (bitwise) and every output id"}
