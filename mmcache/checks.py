"""Input checks shared by the core, the engine and the adapters.

Invariants: a value passes ``finite_number`` exactly when it is an int or float (Python's or numpy's), not a
bool, and finite; callers then apply their own range. A value passes ``positive_int`` exactly when it is a
Python int, not a bool, and at least 1.
"""

from __future__ import annotations

import math

import numpy as np


def finite_number(x) -> bool:
    """Whether ``x`` is a finite int or float (Python or numpy scalar), bools excluded."""
    return (isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))
            and math.isfinite(x))


def positive_int(x) -> bool:
    """Whether ``x`` is an int of at least 1 (a bool is not a count)."""
    return isinstance(x, int) and not isinstance(x, bool) and x > 0
