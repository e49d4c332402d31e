"""vLLM's own OpenAI server as engines of ``mmcache bench serve``: at its defaults, tuned, and the short sweep that
finds the tuned value (``--tune-peer``).

Rules:

* ``vllm_cpu`` runs vLLM at the defaults of its CPU OpenAI server: 2,048 batched tokens a step and 128 sequences
  (``EngineArgs.get_batch_defaults`` on the CPU platform, usage context ``OPENAI_API_SERVER``, vLLM 0.32), chunked
  prefill on (the model's default there) with no long-prefill threshold. The two numbers are passed, equal to what
  vLLM 0.32 picks when they are left out (a vLLM whose defaults moved needs them moved too: the JSON records the
  version beside them). The step budget vLLM logs ("Chunked prefill is enabled with max_num_batched_tokens=N") is
  read back into the JSON; vLLM logs each value once per process, so the line may be missing at 2,048, the value
  its config class starts from.
* ``vllm_cpu_tuned`` is the same server with ``--peer-batched-tokens B`` batched tokens a step (chunked prefill on,
  as by default, so a prompt longer than B is prefilled over several steps beside the decodes).
* What must match mmcache for fairness is set on both, never tuned: block size (``block_size_for`` the page
  size), dtype, max model length, prefix caching on, eager mode, ``cached_tokens`` in usage.
* ``sweep_peer`` serves any model folder: the text workloads' and, for ``vlm_chat``, the VLM preset exported as a
  folder that mmcache's servers load too (vLLM's peer environment needs ``peers/torchvision_python_only.py``
  once: its LLaVA code imports torchvision). vLLM's CPU attention takes no head size of 16, so the tiny presets
  (quick mode's) do not run on it: the full run's ``bench-llava`` and ``small`` do.
* The tuning sweep runs one text workload (the first of ``--workloads``) at ``--rates`` (default ``TUNE_RATES``,
  near vLLM's line on multi_turn) for each B of ``--tune-peer``, under the SLOs of the cache-off server unloaded,
  with neither the ladder's foot nor rates near the line; the best B has the highest goodput, then the highest
  mean attainment, then is the smallest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from . import serve_sweep as sweep

VLLM_CPU_MAX_NUM_SEQS = 128
VLLM_CPU_MAX_BATCHED_TOKENS = 2048
MAX_BATCHED_TOKENS = 1 << 16
TUNE_RATES = "0.5,1"
PEER_ENGINES = ("vllm_cpu", "vllm_cpu_tuned")
_CHUNKED_LOG = re.compile(r"Chunked prefill is enabled with max_num_batched_tokens=(\d+)")


@dataclass(frozen=True)
class PeerConfig:
    """One vLLM configuration: the engine name it is reported under and its step budget."""

    engine: str
    max_num_batched_tokens: int = VLLM_CPU_MAX_BATCHED_TOKENS
    max_num_seqs: int = VLLM_CPU_MAX_NUM_SEQS


def batched_tokens(text: str) -> int:
    """An argparse ``type``: a step budget vLLM takes, at least its 128 sequences and at most MAX_BATCHED_TOKENS."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not VLLM_CPU_MAX_NUM_SEQS <= value <= MAX_BATCHED_TOKENS:
        raise argparse.ArgumentTypeError(f"batched tokens must lie in [{VLLM_CPU_MAX_NUM_SEQS}, {MAX_BATCHED_TOKENS}]"
                                         f" (vLLM wants at least max_num_seqs), got {text!r}")
    return value


def batched_tokens_list(text: str) -> list[int]:
    """An argparse ``type``: comma-separated distinct step budgets (``batched_tokens`` each)."""
    values = [batched_tokens(part.strip()) for part in text.split(",")]
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"give distinct values, got {text!r}")
    return values


def peer_configs(args) -> list[PeerConfig]:
    """The vLLM configurations a run with ``--peers`` measures: the defaults, and tuned where B is given."""
    out = [PeerConfig("vllm_cpu")]
    if args.peer_batched_tokens is not None:
        out.append(PeerConfig("vllm_cpu_tuned", args.peer_batched_tokens))
    return out


def chunked_prefill_tokens(log_text: str) -> int | None:
    """The step budget vLLM says it runs with, from its log (None when the line is absent)."""
    found = _CHUNKED_LOG.findall(log_text)
    return int(found[-1]) if found else None


def sweep_peer(args, config: PeerConfig, folder, model_name: str, dtype: str, works: list, slo: dict, per: dict,
               seed: int, tmp: str, extra_rates: bool = True, images_per_prompt: int = 1, after=None) -> dict:
    """``works`` on vLLM's server over ``folder`` with ``config``, each into ``per[name]`` (SLOs from ``slo``,
    measured there first where missing); what the server ran with. A VLM folder takes ``images_per_prompt``
    images a request; ``after(base_url, engine, model_name)`` runs on the server once ``works`` are done."""
    from .peers.vllm_server import VllmOpenAIServer, block_size_for
    from .serve_open_loop import measure

    spec = json.loads((Path(folder) / "config.json").read_text())
    text = spec.get("text_config", spec)
    max_len = min(int(text.get("max_position_embeddings", 8192)), 8192)
    block = block_size_for(args.page_size)
    log = os.path.join(tmp, f"{config.engine}-{config.max_num_batched_tokens}-{seed}.log")
    with VllmOpenAIServer(str(folder), model_name, log, dtype, block, max_len, config.max_num_seqs,
                          config.max_num_batched_tokens, images_per_prompt=images_per_prompt) as srv:
        version = srv.version()
        sweep.progress(f"{config.engine} {version} ready in {srv.ready_s:.1f} s (block {block}, "
                       f"{config.max_num_batched_tokens} batched tokens)")
        target = sweep.Target(config.engine, srv.base_url, model_name)
        for work in works:
            per[work.name] = measure(target, work, args, slo, seed, extra_rates)
        if after is not None:
            after(srv.base_url, config.engine, model_name)
        command = " ".join(srv.cmd[1:])
    return {"version": version, "ready_s": srv.ready_s, "block_size": block, "max_model_len": max_len,
            "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "logged_batched_tokens": chunked_prefill_tokens(Path(log).read_text(errors="replace")),
            "defaults": config.engine == "vllm_cpu", "command": command, "images_per_prompt": images_per_prompt,
            "kv_cache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
            "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}


def best_batched_tokens(by: list[dict]) -> int:
    """The tuning sweep's choice among ``by`` (``max_num_batched_tokens``, ``goodput_rps``, ``attainment`` per
    rate): the highest goodput (none counting as 0), then the highest mean attainment, then the smallest B."""
    def key(entry):
        seen = [a for a in entry["attainment"] if a is not None]
        return (entry["goodput_rps"] or 0.0, statistics.mean(seen) if seen else 0.0, -entry["max_num_batched_tokens"])

    return max(by, key=key)["max_num_batched_tokens"]


def tune(args) -> dict:
    """The ``--tune-peer`` sweep (module docstring): per B the attainment at each rate and the goodput."""
    import tempfile

    from mmcache.presets import serve

    from . import serve_open_loop as ol
    from .serve_workloads import TEXT_WORKLOADS

    name = next(w for w in args.workloads if w in TEXT_WORKLOADS)
    slo: dict = {}
    with tempfile.TemporaryDirectory(prefix="mmcache-tune-") as tmp:
        folder, space = ol.text_folder(args, tmp)
        work = ol.text_workloads(args, space, args.seed, [name])[name]
        with serve(ol.text_server_config(args, folder, "off")) as srv:
            slo[name] = asyncio.run(sweep.unloaded(ol.mmcache_target(srv, "mmcache_nocache"), work, args.seed,
                                                   args.time_limit))
        by = []
        for b in args.tune_peer:
            per: dict = {}
            server = sweep_peer(args, PeerConfig("vllm_cpu_tuned", b), folder, args.text_preset, args.text_dtype,
                                [work], slo, per, args.seed, tmp, extra_rates=False)
            by.append({"max_num_batched_tokens": b, "goodput_rps": per[name]["goodput_rps"],
                       "attainment": [r["attainment"] for r in per[name]["rates"]], "rates": per[name]["rates"],
                       "server": server})
    return {"workload": name, "unit": work.unit, "rates": args.rates, "slo": slo[name], "by_batched_tokens": by,
            "best_batched_tokens": best_batched_tokens(by),
            "rule": "highest goodput, then highest mean attainment, then the smallest; pass it to the comparison "
                    "as --peer-batched-tokens"}


def tune_rows(result: dict) -> list:
    """The tuning sweep's rows: goodput per B, and the B chosen."""
    from .table import Row

    t = result["tune_peer"]
    rows = [Row("serve", f"vLLM tuning, {t['workload']}: goodput with {e['max_num_batched_tokens']} batched tokens "
                         f"(attainment {', '.join('-' if a is None else f'{a:.2f}' for a in e['attainment'])})",
                e["goodput_rps"] or 0.0, t["unit"], higher_is_better=True) for e in t["by_batched_tokens"]]
    rows.append(Row("serve", "vLLM tuning: batched tokens chosen", float(t["best_batched_tokens"]), "",
                    target="--peer-batched-tokens"))
    return rows
