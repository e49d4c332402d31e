"""``mmcache bench``: run one benchmark with its options, or every registered one in quick mode.

In quick mode a benchmark that fails is reported (its error in the JSON under its name, a line on stderr)
and the others still run and print; the command then exits 1. The JSON is rewritten after each benchmark, so a
run cut short keeps what it measured."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback

from mmcache.cli import writable, write_json
from mmcache.errors import MmcacheError
from mmcache.launcher.openmp import loaded_runtime

from . import REGISTRY
from .table import render


def register(sub) -> None:
    p = sub.add_parser("bench", help="run benchmarks and print the comparison table",
                       description="mmcache bench [NAME] [--json PATH] [--quick] [NAME's options]. Without NAME, "
                                   "every benchmark runs in quick mode. Benchmarks: " + ", ".join(REGISTRY))
    p.add_argument("--json", metavar="PATH", help="write the result as JSON (or after NAME, not both)")
    p.add_argument("--quick", action="store_true",
                   help="NAME's small configuration (also accepted after NAME; without NAME every benchmark is quick)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="NAME and its options")
    p.set_defaults(func=main)


def bench_parser(name: str, module) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"mmcache bench {name}", description=module.DESCRIPTION)
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")
    p.add_argument("--quick", action="store_true", help="the small configuration `mmcache bench` uses")
    module.add_arguments(p)
    return p


def _with_options_before_name(parser: argparse.ArgumentParser, opts, before, name: str):
    """``opts`` (parsed after NAME) with the options given before it (``before``: `mmcache bench --json PATH
    --quick NAME ...`). ``--json`` on both sides is refused with ``parser``'s error (exit code 2) rather than
    one path silently dropped; ``--quick`` on either side counts."""
    if before.json is not None:  # an empty path too: writable refuses it
        if opts.json is not None:
            parser.error(f"--json given both before {name} ({before.json}) and after it ({opts.json}); give it once")
        opts.json = before.json
    opts.quick = opts.quick or before.quick
    return opts


def main(args) -> int:
    importlib.import_module("torch")  # loads torch's OpenMP library, so the line below can name it
    from mmcache.engine.compute import native

    print(f"[mmcache] OpenMP runtime: {loaded_runtime()} (MMCACHE_OPENMP, see README)", file=sys.stderr)
    print(f"[mmcache] decode attention: {native.status()} (MMCACHE_NATIVE, see README)", file=sys.stderr)
    rest = list(args.rest)
    if rest and rest[0] in REGISTRY:
        return run_one(rest, args)
    if rest and not rest[0].startswith("-"):
        print(f"unknown benchmark {rest[0]!r}; known: {', '.join(REGISTRY)}", file=sys.stderr)
        return 2
    return run_all(rest, args)


def run_one(rest: list[str], args) -> int:
    """``mmcache bench NAME [options]`` (``rest``): NAME with its options, the options given before NAME too."""
    name = rest.pop(0)
    module = importlib.import_module(REGISTRY[name])
    parser = bench_parser(name, module)
    opts = _with_options_before_name(parser, parser.parse_args(rest), args, name)
    if not writable(opts.json, "mmcache bench"):
        return 2
    try:
        result = module.run(opts)
    except MmcacheError as e:  # bad options or a peer that cannot run: a clear line, not a traceback
        print(f"mmcache bench {name}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    write_json(opts.json, result)
    print(render(module.table_rows(result)))
    return 0


def run_all(rest: list[str], args) -> int:
    """``mmcache bench [--json PATH]``: every registered benchmark in quick mode, the JSON rewritten after each."""
    allp = argparse.ArgumentParser(prog="mmcache bench")
    allp.add_argument("--json", metavar="PATH", help="write every result as one JSON object")
    opts = allp.parse_args(([] if args.json is None else ["--json", args.json]) + rest)
    if not writable(opts.json, "mmcache bench"):
        return 2
    results, rows, failed = {}, [], []
    for name, modname in REGISTRY.items():
        results[name], named, failure = run_quick(name, modname)
        rows += named
        if failure is not None:
            failed.append(failure)
        write_json(opts.json, results, say=False)  # after each benchmark: a run cut short keeps what it measured
    write_json(opts.json, results)
    print(render(rows))
    if failed:
        print("mmcache bench: failed: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


def run_quick(name: str, modname: str) -> tuple[dict, list, str | None]:
    """One benchmark quick: (result, rows, None); where it failed (its error, [], what failed)."""
    t0 = time.perf_counter()
    print(f"[{name}] running (quick)...", file=sys.stderr, flush=True)
    try:
        module = importlib.import_module(modname)
        result = module.run(bench_parser(name, module).parse_args(["--quick"]))
        named = module.table_rows(result)
    except Exception as e:  # one benchmark's failure must not lose the others' figures: say it, go on
        if not isinstance(e, MmcacheError):
            traceback.print_exc()
        print(f"[{name}] FAILED after {time.perf_counter() - t0:.1f} s: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        return {"error": f"{type(e).__name__}: {e}"}, [], f"{name} ({type(e).__name__}: {e})"
    print(f"[{name}] done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return result, named, None
