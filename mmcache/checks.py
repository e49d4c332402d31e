"""Input checks shared by the core, the engine and the adapters.

Invariants: a value passes ``finite_number`` exactly when it is an int or float (Python's or numpy's), not a
bool, and finite as a float; callers then apply their own range. A value passes ``positive_int`` exactly when it is a
Python int, not a bool, and at least 1. A value passes ``unicode_text`` exactly when it is a str that UTF-8 can
encode (no lone surrogate, which JSON's ``\ud800`` escapes produce and tokenizers reject).
"""

from __future__ import annotations

import math

import numpy as np


def finite_number(x) -> bool:
    """Whether ``x`` is a finite int or float (Python or numpy scalar), bools excluded; an int too large for a
    float (10**400) is not."""
    if not isinstance(x, (int, float, np.integer, np.floating)) or isinstance(x, (bool, np.bool_)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def positive_int(x) -> bool:
    """Whether ``x`` is an int of at least 1 (a bool is not a count)."""
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def unicode_text(x) -> bool:
    """Whether ``x`` is a str of Unicode scalar values (UTF-8 encodable)."""
    if not isinstance(x, str):
        return False
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
