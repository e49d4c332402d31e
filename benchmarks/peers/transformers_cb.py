"""transformers' continuous batching with block sharing as a peer of the prefix benchmark.

One ``ContinuousBatchingManager`` (the machinery behind ``model.generate_batch``, created through
``init_continuous_batching`` with ``ContinuousBatchingConfig(allow_block_sharing=True)``) serves a whole run,
so blocks cached by one round can serve the next, as a server would. ``generate_batch`` itself builds and tears
down a manager per call, which would drop the cache between the probe's requests.

How it is timed: every request is added with ``record_timestamps=True``; its record's time to first token is its
first token stamp minus its ``created_time`` (both ``perf_counter``, taken by transformers itself), its
inter-token latencies the gaps between stamps. (The benchmark's probe figure is not that difference but the
round's wall time, as for every engine; see ``prefix.probe_figure``.) transformers reports no per-request hit
length, so the prefix length its scheduler matched is recorded by wrapping this manager's own
``cache.search_prefix_match``; the wrapper returns the value unchanged.

Invariants: the per-step token budget (``max_batch_tokens``) and request cap (``max_requests_per_batch``)
default to mmcache's ``EngineConfig`` defaults, the benchmark's one source of them; requests are greedy with
end-of-sequence disabled, so each produces exactly ``max_tokens`` tokens; a failed request raises
``PeerFailed`` and the round is abandoned.
"""

from __future__ import annotations

import itertools
import time
from typing import Sequence

import torch

from mmcache.engine.config import EngineConfig
from mmcache.errors import MmcacheError

from .protocol import Record


class PeerFailed(MmcacheError, RuntimeError):
    """A peer engine failed a request or stopped; the message says which and why."""


class TransformersCB:
    name = "transformers_cb"

    def __init__(self, model_dir: str, dtype: str, page_size: int = 128, num_blocks: int = 512,
                 max_batch_tokens: int = EngineConfig.max_tokens_per_step,
                 max_requests_per_batch: int = EngineConfig.max_num_seqs, result_timeout_s: float = 600.0):
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                     attn_implementation="sdpa")
        generation = GenerationConfig(do_sample=False, max_new_tokens=1, eos_token_id=-1)
        config = ContinuousBatchingConfig(allow_block_sharing=True, page_size=page_size, num_blocks=num_blocks,
                                          max_batch_tokens=max_batch_tokens,
                                          max_requests_per_batch=max_requests_per_batch)
        self.settings = {"page_size": page_size, "num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens,
                         "max_requests_per_batch": max_requests_per_batch, "attn_implementation": "sdpa",
                         "allow_block_sharing": True}
        self._timeout = result_timeout_s
        self._ids = itertools.count()
        self._matched: dict[str, int] = {}
        self.manager = model.init_continuous_batching(generation_config=generation,
                                                      continuous_batching_config=config)
        self.manager.start()
        # The generation thread builds the batch processor (and its cache) when it starts; no request is queued
        # yet, so wrapping it before the first add_request sees every lookup.
        cache = self._started_cache()
        self.settings["prefix_sharing_active"] = bool(cache.use_prefix_sharing)
        self._record_matches(cache)

    def _started_cache(self):
        """The batch processor's cache once built (``PeerFailed`` if the thread stops or 120 s pass)."""
        deadline = time.perf_counter() + 120
        while self.manager.batch_processor is None:
            if not self.manager.is_running() or time.perf_counter() > deadline:
                raise PeerFailed("transformers continuous batching did not start")
            time.sleep(0.01)
        return self.manager.batch_processor.cache

    def _record_matches(self, cache) -> None:
        """Records each request's matched prefix length in ``_matched``, the lookup's value unchanged."""
        lookup = cache.search_prefix_match

        def recording_lookup(request_id: str, prompt_ids: list[int]) -> int:
            matched = lookup(request_id, prompt_ids)
            self._matched[request_id] = matched
            return matched

        cache.search_prefix_match = recording_lookup

    def run_round(self, ids: Sequence[str], prompts: Sequence[list[int]], max_tokens: Sequence[int]) -> list[Record]:
        own = {}
        for rid, prompt, n in zip(ids, prompts, max_tokens):
            key = f"{next(self._ids)}:{rid}"
            added = self.manager.add_request(prompt, request_id=key, max_new_tokens=n, record_timestamps=True,
                                             eos_token_id=-1)
            if added is None:
                raise PeerFailed(f"transformers refused request {rid!r}")
            own[key] = rid
        done = {}
        deadline = time.perf_counter() + self._timeout
        while len(done) < len(own):
            out = self.manager.get_result(timeout=1.0)
            if out is None:
                if not self.manager.is_running() or time.perf_counter() > deadline:
                    raise PeerFailed(f"transformers finished {len(done)} of {len(own)} requests before stopping")
                continue
            if out.request_id not in own or not out.is_finished():
                continue
            if out.error is not None:
                raise PeerFailed(f"transformers failed request {own[out.request_id]!r}: {out.error}")
            done[out.request_id] = out
        records = []
        for key, prompt in zip(own, prompts):
            out = done[key]
            stamps = list(out.timestamps or [])
            if len(stamps) != len(out.generated_tokens) or not stamps:
                raise PeerFailed(f"transformers gave {len(stamps)} timestamps for {len(out.generated_tokens)} tokens")
            records.append(Record(own[key], len(prompt), list(out.generated_tokens), out.created_time, stamps[0],
                                  stamps, self._matched.pop(key, 0)))
        return records

    def close(self) -> None:
        self.manager.stop(block=True, timeout=30)
