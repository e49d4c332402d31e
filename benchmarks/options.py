"""argparse types of the benchmarks' options: a bad value is refused with argparse's error (exit code 2,
``mmcache bench NAME: error: argument --X: ...``) before anything is built or measured.

Every count has an upper bound well above any real use, so that a slip such as ``10**30`` is refused at once
instead of hanging in a loop or failing minutes later inside numpy or torch; a seed lies in the range every
generator the benchmarks seed takes; a real number is finite and in its range.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from mmcache.cli import count

# Tokens in one naming run, prompt or workload: 16M, sixteen times the largest default (core's 1M tokens).
MAX_TOKENS = 1 << 24
# A KV page must fit one forward: the engine's token budget per step (EngineConfig.max_tokens_per_step, 4096).
MAX_PAGE_SIZE = 4096
# Timed repeats or runs of one figure (defaults 1 to 41): a thousand is hours of measuring already.
MAX_REPEATS = 1000
# Requests of one stream or batch (defaults 6 to 64).
MAX_REQUESTS = 10_000
# torch CPU threads: more than any machine here has cores; torch itself fails on counts past a C int.
MAX_THREADS = 1024
# Seeds: EngineConfig.seed takes [0, 2**63); numpy's default_rng takes any int >= 0 and torch's manual_seed
# any below 2**64, so a benchmark may add a request's or a run's offset to a seed of this range.
MAX_SEED = 2**63 - 1


seed = count(MAX_SEED, minimum=0)


def real(minimum: float = -math.inf) -> Callable[[str], float]:
    """An argparse ``type`` for a finite real number of at least ``minimum`` (NaN and infinities refused)."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if x < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum:g}, got {x:g}")
        return x

    return parse


def folder(text: str) -> str:
    """An argparse ``type`` for a folder to write into: an existing folder, or a path whose nearest existing
    parent is a folder (the benchmark makes the rest). Nothing is made or written here."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path is not a folder")
    path = os.path.abspath(text)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is not a folder" + ("" if path == os.path.abspath(text)
                                                                     else f", so {text} cannot be made"))
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{path} is not writable")
    return text


def fill_sizes(args, full: dict, quick: dict) -> None:
    """Set each size option left unset (None) to its full or, with ``--quick``, its quick value: an option
    given on the command line wins over ``--quick``."""
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
