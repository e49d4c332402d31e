"""Looking inside a running engine, for tests, benchmarks and debugging; nothing here changes what it computes.

``record_logits(engine)`` returns a dict that fills, per request id and in step order, with a copy of every
logits row the engine samples from (one row per branch per sampled position: a CFG request contributes a row
for each of its two labels). It wraps the runner of that engine instance only; rows are read in the order
the engine assigns them to the forward's works. ``rows_equal(a, b, request_id, count)`` compares two such
recordings of one request: both hold ``count`` rows and each pair is equal bit for bit (``torch.equal``).
``exact_runs(model, tokenizer, prompts, params, **config)`` serves the same prompts (request ids 0, 1, ...) on a
cache-on and a cache-off engine of one model under the exact schedule (``EngineConfig.exact``), recording both.
"""

from __future__ import annotations

import torch

from .config import EngineConfig
from .engine import Engine
from .request import Request


def record_logits(engine: Engine) -> dict:
    rows: dict = {}
    run = engine.runner.run

    def recording(works):
        logits = run(works)
        row = 0
        for w in works:
            if w.wants_logits:
                rows.setdefault(w.live.request_id, []).append(logits[row].detach().clone())
                row += 1
        return logits

    engine.runner.run = recording
    return rows


def rows_equal(a: dict, b: dict, request_id, count: int) -> bool:
    ra, rb = a.get(request_id, []), b.get(request_id, [])
    return len(ra) == len(rb) == count and all(torch.equal(x, y) for x, y in zip(ra, rb))


def exact_runs(model, tokenizer, prompts: list, params, **config) -> dict:
    """``{"on": (rows, outputs, engine), "off": ...}``: ``prompts`` served with ``params`` on two engines of
    ``model`` (cache on, then off) under ``EngineConfig.exact(**config)``, each engine's logits recorded
    (``record_logits``) and its outputs in request order."""
    runs = {}
    for mode in ("on", "off"):
        engine = Engine(model, tokenizer, EngineConfig.exact(cache_mode=mode, **config))
        rows = record_logits(engine)
        outs = engine.generate([Request(p, params, request_id=i) for i, p in enumerate(prompts)])
        runs[mode] = (rows, outs, engine)
    return runs


def exact_cfg_runs(model, tokenizer, positives: list, negative: list, params, guidance_scale: float,
                   **config) -> dict:
    """``exact_runs`` for CFG requests: each of ``positives`` with the one ``negative`` prompt, one request at a
    time; ``{"on": (rows, outputs), "off": ...}`` (a rows entry holds both branches' logits, in turn)."""
    runs = {}
    for mode in ("on", "off"):
        engine = Engine(model, tokenizer, EngineConfig.exact(cache_mode=mode, **config))
        rows = record_logits(engine)
        outs = [engine.generate([Request(p, params, request_id=i, negative_prompt=negative,
                                         guidance_scale=guidance_scale)])[0] for i, p in enumerate(positives)]
        runs[mode] = (rows, outs)
    return runs
