"""Prefix caching: mmcache against itself with the cache off and against peer engines, on text workloads.

    mmcache bench prefix --json PATH [--peers] [--preset NAME] [--dtype D] [--quick] [workload options]

One run exports the preset once as a Hugging Face folder (``mmcache export-model``) and gives that folder and
dtype to every engine: mmcache with the cache on, mmcache with the cache off, transformers' continuous batching
with block sharing, and, with ``--peers`` and ``VLLM_PEER_PYTHON`` set, vLLM's CPU build with prefix caching
(one process, started once, fed each workload when its turn comes). ``--quick`` runs the ``small`` preset with
small workloads and no peers (``--peers`` adds them). Workloads are in ``text_workloads``; every engine plays
them through ``peers.protocol.play``, so prompts, order and timing are the same for all.

What it measures, each beside its own code: bit-exactness, cache on against cache off under the exact schedule
(``prefix_exact``); the probe and the workloads' figures and their pairs (``prefix_figures``), from rounds the
engines play in turns under one step budget (``prefix_turns``); the table's rows (``prefix_table``). This module
holds the run: its options and workload sizes (``Shape``), the workloads, the checks made before a model is
exported, and the JSON.

Invariant: every workload draws its own tokens, so the only cache hits are the ones the workload's shape intends.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from mmcache.engine.compute import native
from mmcache.engine.models import DTYPES
from mmcache.errors import MmcacheError
from mmcache.launcher.openmp import loaded_runtime
from mmcache.presets.text import PRESETS

from . import text_workloads as tw
from .options import MAX_PAGE_SIZE, MAX_REPEATS, MAX_TOKENS, count, folder, seed
from .peers import vllm_cpu
from .peers.protocol import Workload
from .prefix_exact import bit_exact_check, bit_exact_len
from .prefix_figures import WORKLOADS, ProbeMethod, paired_probe, paired_workloads
from .prefix_table import table_rows  # noqa: F401 (the benchmark's table, as benchmarks/__init__ asks of each)
from .prefix_turns import (TURN_ORDER, TURN_SETTLE_S, WARMUP_NEW_TOKENS, WARMUP_SHORT_LENS, EngineResult,
                           MmcacheRunner, Player, StepBudget, in_process_player, play_interleaved, progress,
                           session_len, vllm_player)

DESCRIPTION = ("prefix caching: probe, vLLM prefix-caching, SGLang shared-prefix and multi-turn shapes, against "
               "cache off and peer engines")

ENGINES = ("mmcache", "mmcache_nocache", "transformers_cb", "vllm_cpu")
MAX_COUNT = 1024  # prompts, repeats of a prompt, groups, prompts per group, conversations, user turns (FULL: 2-9)


class ExportFailed(MmcacheError, RuntimeError):
    """``mmcache export-model`` could not write the preset into the work folder (it said why on stderr)."""


# The fields of Shape that count things rather than tokens; every other field is a length within the context.
COUNT_SUFFIXES = ("_repeats", "_num_prompts", "_repeat_count", "_num_groups", "_prompts_per_group",
                  "_conversations", "_max_user_turns")


@dataclass(frozen=True)
class Shape:
    """The workload sizes of one run; ``FULL`` and ``QUICK`` are scaled to a 2-core CPU (the tools' defaults
    are in each field's comment)."""

    probe_repeats: int
    probe_len: int  # the probe's prompt (2048)
    probe_shared: int  # the probe's shared prefix (1920); the JSON key stays "shared1920_s"
    vpc_prefix_len: int  # vLLM benchmark_prefix_caching --prefix-len
    vpc_input_range: tuple[int, int]  # --input-length-range (vLLM default 128:256)
    vpc_num_prompts: int  # --num-prompts
    vpc_repeat_count: int  # --repeat-count (vLLM default 100)
    vpc_output_len: int  # --output-len (vLLM default 10)
    gsp_num_groups: int  # SGLang 64
    gsp_prompts_per_group: int  # SGLang 16
    gsp_system_prompt_len: int  # SGLang 2048
    gsp_question_len: int  # SGLang 128
    gsp_output_len: int  # SGLang 256
    mt_conversations: int  # vLLM multi-turn configuration: 24
    mt_max_user_turns: int  # configuration: 6-9 user turns (12-18 messages)
    mt_max_answer_tokens: int  # configuration: answers of 80-120 tokens (a cap at or above 120 keeps them)
    workload_repeats: int = 1  # each workload played this many times, on fresh tokens, engines taking turns

    def __post_init__(self):
        if self.probe_repeats < 1 or self.workload_repeats < 1:
            raise tw.WorkloadShapeError(f"probe_repeats and workload_repeats must be at least 1, got "
                                        f"{self.probe_repeats} and {self.workload_repeats}")

    def check_sizes(self, context: int) -> None:
        """Refuses sizes no run should take, before a token is drawn: a length beyond the model's ``context``,
        a repeat count above ``MAX_REPEATS``, another count above ``MAX_COUNT``, or a workload repeat sending
        more than ``MAX_TOKENS`` prompt tokens. (The workloads check their own lower bounds.)"""
        for name in Shape.__dataclass_fields__:
            values = getattr(self, name)
            for v in values if isinstance(values, tuple) else (values,):
                cap = size_cap(name) or context
                if v > cap:
                    raise tw.WorkloadShapeError(f"{name} {v} is above its maximum {cap}"
                                                + (" (the model's context)" if cap == context else ""))
        sent = {"vllm_prefix_caching": self.vpc_num_prompts * self.vpc_repeat_count * self.vpc_input_range[1],
                "generated_shared_prefix": self.gsp_num_groups * self.gsp_prompts_per_group
                * (self.gsp_system_prompt_len + self.gsp_question_len)}
        for name, tokens in sent.items():
            if tokens > MAX_TOKENS:
                raise tw.WorkloadShapeError(f"{name} would send {tokens} prompt tokens, above {MAX_TOKENS}")


def size_cap(name: str) -> int | None:
    """The largest value of ``Shape`` field ``name``: ``MAX_REPEATS`` for a repeat count, ``MAX_COUNT`` for
    another count; None for a length, bounded by the model's context."""
    if name in ("probe_repeats", "workload_repeats"):
        return MAX_REPEATS
    return MAX_COUNT if name.endswith(COUNT_SUFFIXES) else None


def _size_help(name: str) -> str:
    def show(v):
        return f"{v[0]}:{v[1]}" if isinstance(v, tuple) else str(v)

    cap = size_cap(name)
    return (f"default {show(getattr(FULL, name))}, quick {show(getattr(QUICK, name))}; "
            + (f"at most {cap}" if cap else "within the model's context"))


# The workloads are repeated for the same reason as the probe: one play of a workload per engine puts each
# engine in its own minute, and one engine's slow minute has moved a TTFT or ITL ratio from 0.78 to 1.51 within
# an hour (RESULTS.md, "Workloads"); the paired median of three is what the table reports.


# Nine probe repeats: a repeat's engines run within a minute of each other, but this machine's speed moves
# by up to 2x between minutes, so the paired median needs several repeats (RESULTS.md, run 5). Quick mode plays
# three, the fewest whose median is not a mean (a repeat of its two engines is six cold 2048-token prefills and
# two hits, about 7 s on the small preset); its workloads two (a repeat adds about 30 s to `mmcache bench`), so
# their paired figures say they are a mean of 2 (``paired_note``).
FULL = Shape(probe_repeats=9, probe_len=2048, probe_shared=1920,
             vpc_prefix_len=1024, vpc_input_range=(1152, 1280), vpc_num_prompts=4, vpc_repeat_count=3,
             vpc_output_len=10,
             gsp_num_groups=2, gsp_prompts_per_group=4, gsp_system_prompt_len=2048, gsp_question_len=128,
             gsp_output_len=32,
             mt_conversations=4, mt_max_user_turns=3, mt_max_answer_tokens=120, workload_repeats=3)
QUICK = replace(FULL, probe_repeats=3, workload_repeats=2, vpc_prefix_len=512, vpc_input_range=(640, 768),
                vpc_num_prompts=3, vpc_repeat_count=2, gsp_prompts_per_group=3, gsp_system_prompt_len=1024,
                gsp_output_len=16,
                mt_conversations=2, mt_max_user_turns=2, mt_max_answer_tokens=16)  # what differs from FULL


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=list(PRESETS),
                   help="embedded model preset (default qwen2.5-0.5b; small with --quick)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--page-size", type=count(MAX_PAGE_SIZE), default=128)
    p.add_argument("--store-at", choices=("prefill", "teardown"), default="prefill",
                   help="when mmcache publishes a prompt's full pages: as prefill fills them (as vLLM and "
                        "transformers do, so requests of one batch can share) or when the request ends")
    p.add_argument("--peers", action="store_true",
                   help="add vLLM's CPU build (needs VLLM_PEER_PYTHON); in quick mode also transformers")
    p.add_argument("--vllm-eager", action="store_true", help="start vLLM without torch.compile (seconds, not ~95 s)")
    p.add_argument("--engines", help=f"comma-separated subset of {','.join(ENGINES)} (default: by mode and --peers)")
    p.add_argument("--workloads", help=f"comma-separated subset of {','.join(WORKLOADS)}; the probe always runs, "
                                       "so an empty list runs the probe alone")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--workdir", type=folder,
                   help="keep the exported model and peer logs here, a folder or one that can be made (default: a "
                        "temporary folder)")
    s = p.add_argument_group("workload sizes (default: the full shape, or the quick one with --quick)")
    for f in Shape.__dataclass_fields__.values():
        kind = str if f.name == "vpc_input_range" else int
        s.add_argument("--" + f.name.replace("_", "-"), type=kind, metavar="N" if kind is int else "MIN:MAX",
                       help=_size_help(f.name))


def shape_from_args(args) -> Shape:
    shape = QUICK if args.quick else FULL
    changes = {}
    for name in Shape.__dataclass_fields__:
        v = getattr(args, name, None)
        if v is None:
            continue
        if name == "vpc_input_range":
            try:
                lo, hi = (int(x) for x in v.split(":"))
            except ValueError as e:
                raise tw.WorkloadShapeError(f"--vpc-input-range wants MIN:MAX, got {v!r}") from e
            v = (lo, hi)
        changes[name] = v
    return replace(shape, **changes)


def engines_from_args(args) -> list[str]:
    """The engines to run: ``--engines`` when given, else mmcache and cache off, plus transformers_cb in full
    mode, plus the peers with ``--peers`` (vllm_cpu, and transformers_cb in quick mode). An option this list
    would leave without effect is refused (``WorkloadShapeError``): ``--peers`` with an ``--engines`` that
    leaves out a peer it adds, ``--vllm-eager`` without vllm_cpu."""
    peers = ["transformers_cb", "vllm_cpu"] if args.quick else ["vllm_cpu"]
    if args.engines is not None:
        names = [e.strip() for e in args.engines.split(",") if e.strip()]
        unknown = set(names) - set(ENGINES)
        if unknown:
            raise tw.WorkloadShapeError(f"unknown engines {sorted(unknown)}; known: {ENGINES}")
        if not names:
            raise tw.WorkloadShapeError(f"--engines {args.engines!r} names no engine; known: {ENGINES}")
        left_out = [e for e in peers if e not in names]
        if args.peers and left_out:
            raise tw.WorkloadShapeError(
                f"--peers adds {' and '.join(peers)}{' in quick mode' if args.quick else ''}, which --engines "
                f"{args.engines!r} leaves out ({', '.join(left_out)}): add them there, or drop --peers")
    else:
        names = ["mmcache", "mmcache_nocache"]
        if args.peers or not args.quick:
            names.append("transformers_cb")
        if args.peers:
            names.append("vllm_cpu")
    if args.vllm_eager and "vllm_cpu" not in names:
        raise tw.WorkloadShapeError("--vllm-eager sets how vLLM starts, but this run has no vllm_cpu: add --peers "
                                    "or name it in --engines")
    return names


def workload_repeats(shape: Shape, space: tw.TokenSpace, seed: int, names: list[str]) -> list[list[Workload]]:
    """``shape.workload_repeats`` sets of the named workloads; repeat ``r`` draws its tokens from seed
    ``seed * 1000 + r``, so no repeat hits another's cache."""
    return [build_workloads(shape, space, seed * 1000 + r, names) for r in range(shape.workload_repeats)]


def build_workloads(shape: Shape, space: tw.TokenSpace, seed: int, names: list[str]) -> list[Workload]:
    out = []
    if "vllm_prefix_caching" in names:
        out.append(tw.vllm_prefix_caching(space, seed, shape.vpc_prefix_len, shape.vpc_input_range,
                                          shape.vpc_num_prompts, shape.vpc_repeat_count, shape.vpc_output_len))
    if "generated_shared_prefix" in names:
        out.append(tw.generated_shared_prefix(space, seed, shape.gsp_num_groups, shape.gsp_prompts_per_group,
                                              shape.gsp_system_prompt_len, shape.gsp_question_len,
                                              shape.gsp_output_len))
    if "multi_turn" in names:
        out.append(tw.multi_turn(tw.MultiTurnShape.load(), space, seed, shape.mt_conversations,
                                 shape.mt_max_user_turns, shape.mt_max_answer_tokens))
    return out


def token_space(model_dir: str) -> tw.TokenSpace:
    """Ids every engine accepts: below the model's and the tokenizer's vocabulary, clear of special tokens."""
    config = json.loads(Path(model_dir, "config.json").read_text())
    vocab = int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    tok = json.loads(Path(model_dir, "tokenizer.json").read_text())
    vocab = min(vocab, len(tok["model"]["vocab"]) + len(tok.get("added_tokens", [])))
    special = sorted(t["id"] for t in tok.get("added_tokens", []))
    low = 1 + max([i for i in special if i < vocab // 2], default=-1)
    high = min([vocab] + [i for i in special if i >= vocab // 2])
    return tw.TokenSpace(low, high)


def _workload_params(repeats: list[list[Workload]]) -> dict:
    """Each workload's generation parameters: the first repeat's, and, where repeats drew different lengths
    (multi-turn draws them from distributions), every repeat's under ``by_repeat``."""
    out = {}
    for i, w in enumerate(repeats[0]):
        each = [ws[i].params for ws in repeats]
        out[w.name] = dict(w.params, by_repeat=each) if any(p != w.params for p in each) else w.params
    return out


def check_context(workloads: list[Workload], shape: Shape, page_size: int, context: int,
                  sessions: bool = True) -> None:
    """Refuses a run whose requests would not fit the model's ``context`` (prompt and output tokens; a session's
    turn holds the whole conversation before it): the warm-up and probe prompts, the bit-exact check's prompts,
    every request of ``workloads``, and, with ``sessions``, every multi-turn conversation. Sessions are left out
    on stand-in tokens: their later lengths are drawn after tokens, so they differ on the real token space."""
    need = {"the probe and warm-up": max((shape.probe_len,) + WARMUP_SHORT_LENS) + WARMUP_NEW_TOKENS,
            "the bit-exact check": bit_exact_len(page_size)}
    for w in workloads:
        single = [len(r.tokens) + r.max_tokens for rnd in w.rounds for r in rnd if not r.session]
        need[w.name] = max(single + [session_len(w) if sessions else 0])
    over = [f"{name} needs {n}" for name, n in need.items() if n > context]
    if over:
        raise tw.WorkloadShapeError(f"longer than the model's context of {context} tokens: {'; '.join(over)}")


def export_model(preset: str, dtype: str, out_dir: str) -> None:
    from mmcache.cli import main as cli

    rc = cli(["export-model", preset, out_dir, "--dtype", dtype])
    if rc:
        raise ExportFailed(f"mmcache export-model {preset} {out_dir} failed with exit code {rc}")


def run(args) -> dict:
    shape = shape_from_args(args)
    engines = engines_from_args(args)
    if "vllm_cpu" in engines:
        vllm_cpu.interpreter()  # fail now, not after the other engines ran
    names = workload_names(args.workloads)
    preset = args.preset or ("small" if args.quick else "qwen2.5-0.5b")
    context = PRESETS[preset].config["max_position_embeddings"]
    check_before_export(shape, names, args, context)
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mmcache-prefix-") as tmp:
        inputs = prepare(preset, shape, names, context, args, args.workdir or tmp)
        progress("bit-exact check (exact schedule, cache on vs off)")
        exact = bit_exact_check(inputs.model_dir, args.dtype, args.page_size, inputs.space, args.seed, args.store_at)
        progress(f"bit_exact: {exact['bit_exact']}")
        results = play_engines(engines, inputs, args)
    return run_result(exact, results, preset, inputs, args, load_start, t_start)


def workload_names(chosen: str | None) -> list[str]:
    """The workloads ``--workloads`` names (every one of ``WORKLOADS`` when it is not given), each known."""
    chosen = ",".join(WORKLOADS) if chosen is None else chosen
    names = [w.strip() for w in chosen.split(",") if w.strip()]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        raise tw.WorkloadShapeError(f"unknown workloads {sorted(unknown)}; known: {WORKLOADS}")
    return names


def check_before_export(shape: Shape, names: list[str], args, context: int) -> None:
    """Every shape error now, before a model is exported or an engine loaded."""
    # Sizes against their maxima and the preset's context, then the probe and the workloads built once on a
    # stand-in token space (the real one needs the exported vocabulary); multi-turn conversations are measured
    # on the real one, before loading.
    shape.check_sizes(context)
    tw.probe(tw.TokenSpace(1, 2), 0, shape.probe_len, shape.probe_shared)
    check_context(build_workloads(shape, tw.TokenSpace(1, 2), args.seed, names), shape, args.page_size, context,
                  sessions=False)


@dataclass(frozen=True)
class RunInputs:
    """What every engine of a run is given: model, folder, tokens, workloads, pages, step budget."""

    model_dir: str
    workdir: str
    space: tw.TokenSpace
    shape: Shape
    repeats: list[list[Workload]]
    num_pages: int
    budget: StepBudget

    def every(self) -> list[Workload]:
        """Every repeat of every workload, in the order drawn."""
        return [w for ws in self.repeats for w in ws]


def prepare(preset: str, shape: Shape, names: list[str], context: int, args, workdir: str) -> RunInputs:
    """The preset exported into ``workdir`` (unless there) and the workloads drawn on its tokens, checked."""
    model_dir = os.path.join(workdir, f"model-{preset}-{args.dtype}")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        progress(f"exporting {preset} ({args.dtype}) to {model_dir}")
        export_model(preset, args.dtype, model_dir)
    space = token_space(model_dir)
    repeats = workload_repeats(shape, space, args.seed, names)
    every = [w for ws in repeats for w in ws]
    check_context(every, shape, args.page_size, context)
    num_pages = _pages_needed(every, shape, args.page_size)
    return RunInputs(model_dir, workdir, space, shape, repeats, num_pages, StepBudget.of_mmcache())


def play_engines(engines: list[str], inputs: RunInputs, args) -> dict[str, EngineResult]:
    """Every engine loaded in turn, then ``play_interleaved``; all closed after, also on a failure."""
    players: list[Player] = []
    try:
        for name in engines:
            progress(f"{name}: loading")
            players.append(load_player(name, inputs, args))
        return play_interleaved(players, inputs.space, inputs.shape, inputs.repeats, args.seed)
    finally:
        for p in players:
            p.close()
        del players
        gc.collect()


def load_player(name: str, inputs: RunInputs, args) -> Player:
    """Engine ``name`` loaded on the exported model under the run's step budget, its load time on record."""
    budget = inputs.budget
    if name == "vllm_cpu":
        return vllm_player(inputs.model_dir, inputs.space, inputs.shape, inputs.every(), args.seed, args,
                           inputs.workdir, budget)
    t0 = time.perf_counter()
    method = ProbeMethod()
    if name == "transformers_cb":
        from .peers.transformers_cb import TransformersCB

        runner = TransformersCB(inputs.model_dir, args.dtype, page_size=args.page_size, num_blocks=inputs.num_pages,
                                max_batch_tokens=budget.max_tokens_per_step,
                                max_requests_per_batch=budget.max_num_seqs)
        method = ProbeMethod(max_tokens=2)
    else:
        runner = MmcacheRunner(inputs.model_dir, args.dtype, "on" if name == "mmcache" else "off",
                               args.page_size, inputs.num_pages, store_at=args.store_at, **asdict(budget))
    return in_process_player(name, runner, time.perf_counter() - t0, method)


def run_result(exact: dict, results: dict, preset: str, inputs: RunInputs, args, load_start: tuple,
               t_start: float) -> dict:
    """The run's JSON: bit-exactness, each engine's figures and agreement, the pairs, run and machine."""
    reference = results.get("mmcache_nocache")
    engines_out = {}
    for name, r in results.items():
        d = {"probe": r.probe, **r.workloads, "meta": r.meta}
        if reference is not None and name != "mmcache_nocache":
            same = [r.outputs[k] == v for k, v in reference.outputs.items() if k in r.outputs]
            d["agree_with_nocache"] = sum(same) / len(same) if same else None
        engines_out[name] = d
    return {"bit_exact": exact["bit_exact"], "bit_exact_check": exact, "engines": engines_out,
            "probe_paired": paired_probe(engines_out), "workloads_paired": paired_workloads(engines_out),
            "preset": preset, "dtype": args.dtype, "page_size": args.page_size, "store_at": args.store_at,
            "step_budget": asdict(inputs.budget), "turn_settle_s": TURN_SETTLE_S, "turn_order": TURN_ORDER,
            "quick": bool(args.quick),
            "shape": asdict(inputs.shape),
            "workloads": _workload_params(inputs.repeats), "token_space": asdict(inputs.space),
            "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                        "platform": platform.platform(), "python": platform.python_version(),
                        "openmp": loaded_runtime(), "decode_attention": native.status()},
            "versions": _versions(), "wall_s": time.perf_counter() - t_start}


def _pages_needed(workloads: list[Workload], shape: Shape, page_size: int) -> int:
    """Pages for every token the run writes, so no engine evicts: each engine gets the same, ample pool."""
    tokens = shape.probe_repeats * (3 * shape.probe_len + (shape.probe_len - shape.probe_shared) + 4) + 4096
    for w in workloads:
        tokens += sum(len(r.tokens) + r.max_tokens for rnd in w.rounds for r in rnd) + session_len(w)
    return -(-tokens // page_size) + 64


def _versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


