"""Option types shared by the benchmarks' command lines.

Invariant: a count option (requests, runs, repeats, steps, tokens, pages, threads) that is given is at least 1,
so a bad value is refused by argparse (usage, message, exit code 2) before anything is built or measured.
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse ``type``: a whole number of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n
