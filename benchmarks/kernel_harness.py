"""What the kernel micro-benchmarks share: paired repeats in turns, medians of per-repeat ratios, the machine.

Rules every such benchmark follows (this machine's speed moves by more than most differences measured):

* The sides run in every repeat, in turns (``order``: each repeat starts one side later; ``in_turns``
  measures them so), so a slow minute weighs on every side alike.
* A ratio is taken within its repeat and then the median over repeats (``ratio``), never as a ratio of
  medians; each side's own figure is its median (``paired``).
* First calls (allocations, oneDNN's kernel choice) are not timed; ``timed`` gives the mean of ``calls``
  calls after them.
* A decode step is timed only where it decoded alone (``decode_only_step``): a step that also took prompt
  tokens is a prefill's figure, not a decode's.
* The result names the machine it was measured on (``machine``; ``say_machine`` prints it to stderr) and is
  written whole (``write_json``).
* Each script's ``main`` is ``script_main``: a ``--json`` path that cannot be written is refused (exit code 2)
  before anything is built or measured, and a result that says ``skipped`` prints why instead of figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from mmcache.cli import writable, write_json

__all__ = ["decode_only_step", "in_turns", "machine", "order", "paired", "ratio", "say_machine", "script_main",
           "timed", "write_json"]


def order(sides: Sequence[str], repeat: int) -> list[str]:
    """The order of ``sides`` in repeat number ``repeat``: rotated by one per repeat (two sides alternate)."""
    k = repeat % len(sides)
    return [*sides[k:], *sides[:k]]


def timed(fn: Callable, *args, calls: int = 1) -> float:
    """Seconds per call of ``fn(*args)``, the mean over ``calls`` calls in a row."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - t0) / calls


def in_turns(sides: Sequence[str], repeats: int, measure: Callable[[str], float]) -> dict[str, list[float]]:
    """``measure(side)`` of every side in each of ``repeats`` repeats, the sides in ``order``: side -> figures."""
    times: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(repeats):
        for side in order(sides, r):
            times[side].append(measure(side))
    return times


def decode_only_step(engine) -> float | None:
    """Seconds of one ``engine.step()``, or None where the step also took prompt tokens (not decode only)."""
    before = engine.counters["prompt_tokens"]
    t0 = time.perf_counter()
    engine.step()
    took = time.perf_counter() - t0
    return took if engine.counters["prompt_tokens"] == before else None


def ratio(over: Sequence[float], under: Sequence[float]) -> float:
    """The median over repeats of ``over[r] / under[r]``."""
    return statistics.median(a / b for a, b in zip(over, under))


def paired(times: dict[str, Sequence[float]], over: str, under: str) -> dict:
    """``{over}_s`` and ``{under}_s`` (each side's median) and ``{over}_over_{under}`` (``ratio``)."""
    return {f"{over}_s": statistics.median(times[over]), f"{under}_s": statistics.median(times[under]),
            f"{over}_over_{under}": ratio(times[over], times[under])}


def machine(kernels: bool = True) -> dict:
    """Threads torch computes with and the OpenMP runtime loaded; with ``kernels``, also what the compiled
    kernels run on (``native.status``: builds the library where it is not built yet)."""
    import torch

    from mmcache.launcher.openmp import loaded_runtime

    out = {"threads": torch.get_num_threads(), "openmp": loaded_runtime()}
    if kernels:
        from mmcache.engine.compute import native

        out["kernels"] = native.status()
    return out


def say_machine(name: str, kernels: bool = True) -> None:
    """One line on stderr naming the machine ``name`` measures on (``machine``)."""
    m = machine(kernels)
    line = f"[{name}] {m['threads']} threads, OpenMP runtime {m['openmp']}"
    print(line + (f", compiled kernels: {m['kernels']}" if kernels else ""), file=sys.stderr)


def script_main(module: str, doc: str, argv: list[str] | None, add_arguments: Callable[[argparse.ArgumentParser], None],
                measure: Callable[[argparse.Namespace], dict], report: Callable[[argparse.Namespace, dict], None],
                check: Callable[[argparse.Namespace], str | None] = lambda args: None) -> int:
    """``python -m MODULE``: its parser (``add_arguments`` adds the script's own options, this ``--json``), the
    ``--json`` path and ``check(args)`` (a message refuses the options with argparse's error, exit code 2) before
    anything runs, the machine on stderr, ``measure(args)`` written whole to ``--json``, then
    ``report(args, result)`` on stdout, or the reason of a result that says ``skipped``."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args(argv)
    if not writable(args.json, parser.prog):
        return 2
    if (refused := check(args)) is not None:
        parser.error(refused)
    say_machine(parser.prog)
    result = measure(args)
    write_json(args.json, result)
    if "skipped" in result:
        print(result["skipped"])
    else:
        report(args, result)
    return 0
