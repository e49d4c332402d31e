"""A prefill chunk's attention: the compiled chunk kernel against the engine's ATen path, alternating within one
process.

    python -m benchmarks.chunk_kernel --json chunk_kernel.json      # about 10 s
    python -m benchmarks.chunk_kernel --engine 12 --json chunk_e2e.json   # whole requests, about 3 min
    python -m benchmarks.chunk_kernel --against HEAD~1 --json ab.json    # this tree's kernel against a revision's

Two cases on the Qwen2.5-0.5B shape (14 query heads over 2 KV heads, head size 64, bfloat16):

* ``hit``: a hit's last page, 128 tokens over the 1,920 cached before it. ATen's path is two flash calls (every
  query over the cached keys, then causally over the chunk's own) merged by their log-sum-exps.
* ``cold``: a cold 2,048-token prompt, one causal flash call with grouped query heads.

The kernel runs the way this CPU gives it (``way`` in the JSON): its products on the tile unit (AMX) or, on CPUs
without tiles, on the vector unit (AVX-512 BF16). Both sides return the chunk's output in the engine's layout
(tokens, heads, d) in bfloat16. Each round times ``--calls`` calls of one side, then of the other (the first
side alternates from round to round); the figures are the medians over rounds of the time per call, and the
median of the per-round ratios.

``--against REV`` times this checkout's kernel against the same kernel built from the sources at git revision
``REV`` instead of against ATen, in one process on the same inputs (``against_over_kernel``: above 1 when this
checkout's is faster; ``same_bits``: whether both returned identical outputs). This machine's speed moves by up
to 1.7x between minutes, so two invocations of the benchmark, one per revision, cannot resolve a change of a
few percent; alternating both libraries call by call can. The revision's library must carry every kernel
function of this tree's (``native.load``): revisions from the activation kernel on (c09c93b) do; an older one is
refused with the function it lacks.

``--engine N`` measures whole requests instead: one engine (``--preset``, bfloat16, page 128), N pairs; in each
pair, each side in turn (alternating which goes first) serves a fresh 2,048-token prompt cold and then again (a
hit on 1,920 tokens), one output token each. The ATen side is the same engine with ``native.supports_chunk``
answering no (a measuring device only, restored afterwards); with ``--against REV``, the other side is the same
engine with the revision's library as its attention kernels (decode and chunk; the norms and the rotary
embedding stay on this tree's). Reported: medians per side and the medians of the
per-pair ratios.
"""

from __future__ import annotations

import argparse
import sys

from mmcache.cli import positive_int

from .kernel_harness import order, paired, ratio, script_main, timed

CASES = {"hit": (1920, 128), "cold": (0, 2048)}  # (cached tokens, chunk tokens)


def _sides(lib, cached: int, tokens: int, kv_heads: int, group: int, dim: int, seed: int) -> dict:
    import torch
    import torch.nn.functional as F

    from mmcache.engine import attention
    from mmcache.engine.compute import native

    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    q = torch.randn(heads, tokens, dim, generator=g).bfloat16()  # (heads, tokens, d), as the engine's queries
    kp = torch.randn(kv_heads, cached, dim, generator=g).bfloat16() if cached else None
    vp = torch.randn(kv_heads, cached, dim, generator=g).bfloat16() if cached else None
    kn = torch.randn(kv_heads, tokens, dim, generator=g).bfloat16()
    vn = torch.randn(kv_heads, tokens, dim, generator=g).bfloat16()
    scale = dim ** -0.5
    if not native.supports_chunk(lib, q.reshape(kv_heads, -1, dim), kn, vn, kp, vp):
        return {}

    def kernel():
        o, _ = native.chunk_attention(lib, q.reshape(kv_heads, -1, dim), kp, vp, kn, vn, scale)
        return o.view(heads, tokens, dim).transpose(0, 1).to(torch.bfloat16)

    def aten():
        if kp is not None:
            return attention._over_prefix(q, kp, vp, kn, vn, scale)
        o = F.scaled_dot_product_attention(q[None], kn[None], vn[None], is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    return {"kernel": kernel, "aten": aten}


_CSRC, _OLD_CSRC = "mmcache/engine/compute/csrc", "mmcache/engine/csrc"  # where the sources lie, and lay before


def library_at(rev: str):
    """The compiled kernels built from the sources at git revision ``rev`` of this checkout (``--against``)."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from mmcache.engine.compute import native

    root = Path(native.__file__).resolve().parents[3]
    where = Path(tempfile.mkdtemp(prefix="mmcache-kernels-"))
    try:
        sources = []
        for f in native.SOURCES + native.HEADERS:
            rel = f.resolve().relative_to(root).as_posix()
            for where_then in (rel, rel.replace(_CSRC, _OLD_CSRC)):  # the sources moved with the compute package
                got = subprocess.run(["git", "-C", str(root), "show", f"{rev}:{where_then}"], capture_output=True)
                if got.returncode == 0:
                    break
            if got.returncode != 0:
                raise SystemExit(f"--against {rev}: cannot read {rel} there: {got.stderr.decode().strip()}")
            (where / f.name).write_bytes(got.stdout)
            sources += [where / f.name] if f in native.SOURCES else []
        try:  # a loaded library outlives its file
            return native.load(native.build(directory=where, sources=tuple(sources)))
        except (native.NativeKernelUnavailable, OSError, AttributeError) as exc:
            raise SystemExit(f"--against {rev}: its kernels do not build or load here: {exc}") from exc
    finally:
        shutil.rmtree(where, ignore_errors=True)


def measure(case: str, kv_heads: int, group: int, dim: int, rounds: int, calls: int, seed: int = 0,
            against: tuple | None = None) -> dict:
    """One case, the kernel against ATen's path, or with ``against = (rev, library)`` against that library's
    kernel on the same inputs."""
    import torch

    from mmcache.engine.compute import native

    cached, tokens = CASES[case]
    lib = native.library()
    sides = _sides(lib, cached, tokens, kv_heads, group, dim, seed) if lib is not None else {}
    if not sides:
        return {"skipped": f"the chunk kernel does not run here ({native.status()}, d {dim})"}
    other = "aten"
    if against is not None:
        other = "against"
        theirs = _sides(against[1], cached, tokens, kv_heads, group, dim, seed)
        if not theirs:
            return {"skipped": f"the chunk kernel at {against[0]} does not take d {dim} here"}
        sides = {"kernel": sides["kernel"], "against": theirs["kernel"]}
    mine, base = sides["kernel"](), sides[other]()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        for name in order(("kernel", other), r):
            times[name].append(timed(sides[name], calls=calls))
    out = {"shape": {"cached": cached, "tokens": tokens, "kv_heads": kv_heads, "query_heads_per_kv_head": group,
                     "head_dim": dim},
           "way": native.chunk_way(lib, dim), "threads": torch.get_num_threads(), "rounds": rounds,
           "calls_per_round": calls, **paired(times, other, "kernel"),
           "max_abs_difference": float((mine.float() - base.float()).abs().max()), "per_round_s": times}
    if against is not None:
        out.update(against=against[0], same_bits=bool(torch.equal(mine, base)))
    return out


def measure_engine(pairs: int, preset: str, seed: int = 0, against: tuple | None = None) -> dict:
    """Whole requests on the kernel against ATen's path, or with ``against = (rev, library)`` against that
    library's attention kernels (decode and chunk; the norms and rotary embedding stay this tree's)."""
    import numpy as np

    from mmcache.engine import EngineConfig, SamplingParams
    from mmcache.presets import engine_from_preset
    from mmcache.engine.compute import native

    eng = engine_from_preset(preset, dtype="bfloat16", config=EngineConfig(page_size=128))
    if not any(part.startswith("native-chunk") for part in eng.backend.split("+")):
        return {"skipped": f"the chunk kernel does not run here ({native.status()})"}
    rng = np.random.default_rng(seed)
    sampling = SamplingParams(max_tokens=1)

    def serve(prompt) -> float:
        return timed(eng.generate, [prompt], sampling)

    def prompt() -> list[int]:
        return [int(x) for x in rng.integers(0, eng.adapter.vocab_size, 2048)]

    serve(prompt())  # warm-up
    other = "aten" if against is None else "against"
    times = _engine_pairs(eng, pairs, against, serve, prompt)
    out = {"preset": preset, "pairs": pairs, "way": native.chunk_way(native.library(), eng.adapter.head_dim),
           "per_pair_s": times}
    if against is not None:
        out["against"] = against[0]
    for kind in ("cold", "hit"):
        out[kind] = paired({side: t[kind] for side, t in times.items()}, other, "kernel")
    out["same_vs_cold"] = {side: ratio(t["cold"], t["hit"]) for side, t in times.items()}
    return out


def _engine_pairs(eng, pairs: int, against: tuple | None, serve, prompt) -> dict:
    """``pairs`` pairs, each side in turn serving a fresh prompt cold, then again: side -> kind -> seconds."""
    from mmcache.engine.compute import native

    real, mine = native.supports_chunk, eng.runner.decode_kernel
    other = "aten" if against is None else "against"
    times = {side: {"cold": [], "hit": []} for side in ("kernel", other)}
    try:
        for r in range(pairs):
            for side in order(("kernel", other), r):
                if against is None:
                    native.supports_chunk = real if side == "kernel" else (lambda *a, **kw: False)
                else:
                    eng.runner.decode_kernel = mine if side == "kernel" else against[1]
                p = prompt()
                times[side]["cold"].append(serve(p))
                times[side]["hit"].append(serve(p))
    finally:
        native.supports_chunk, eng.runner.decode_kernel = real, mine
    return times


def main(argv=None) -> int:
    return script_main("benchmarks.chunk_kernel", __doc__, argv, _arguments, _measure, _report)


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", nargs="+", choices=tuple(CASES), default=list(CASES))
    p.add_argument("--kv-heads", type=positive_int, default=2)
    p.add_argument("--group", type=positive_int, default=7, help="query heads per KV head")
    p.add_argument("--dim", type=positive_int, default=64,
                   help="head size: 32 to 128 on the vector way, 32 and 64 on the tile unit")
    p.add_argument("--rounds", type=positive_int, default=11)
    p.add_argument("--calls", type=positive_int, default=3, help="calls per side per round")
    p.add_argument("--against", metavar="REV", help="time against the kernel at this git revision instead of ATen")
    p.add_argument("--engine", type=positive_int, metavar="PAIRS", help="time whole requests instead (see above)")
    p.add_argument("--preset", default="qwen2.5-0.5b", help="the model preset of --engine")


def _measure(args: argparse.Namespace) -> dict:
    against = (args.against, library_at(args.against)) if args.against else None
    if args.engine:
        return measure_engine(args.engine, args.preset, against=against)
    return {case: measure(case, args.kv_heads, args.group, args.dim, args.rounds, args.calls, against=against)
            for case in args.cases}


def _report(args: argparse.Namespace, result: dict) -> None:
    if args.engine:
        _report_engine(result)
        return
    for case, r in result.items():
        if "skipped" in r:
            print(f"{case}: {r['skipped']}")
            continue
        s = r["shape"]
        other, name = ("against", f"at {r['against']}") if "against" in r else ("aten", "ATen")
        bits = f", same bits: {'yes' if r['same_bits'] else 'no'}" if "against" in r else ""
        print(f"{case}: {s['tokens']} tokens over {s['cached']} cached, {s['kv_heads']}x{s['query_heads_per_kv_head']} "
              f"heads, d {s['head_dim']}: kernel {1e3 * r['kernel_s']:.3f} ms, {name} {1e3 * r[other + '_s']:.3f} "
              f"ms, {name} / kernel {r[other + '_over_kernel']:.2f} (median of {r['rounds']} alternating "
              f"rounds){bits}")


def _report_engine(result: dict) -> None:
    other, name = ("against", f"at {result['against']}") if "against" in result else ("aten", "ATen")
    for kind in ("cold", "hit"):
        r = result[kind]
        print(f"{kind}: kernel {r['kernel_s']:.3f} s, {name} {r[other + '_s']:.3f} s, {name} / kernel "
              f"{r[other + '_over_kernel']:.3f} (median of {result['pairs']} pairs)")
    s = result["same_vs_cold"]
    print(f"same vs cold: kernel {s['kernel']:.2f}x, {name} {s[other]:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
