"""Input checks shared by the core, the engine and the adapters.

Invariant: a value passes ``finite_number`` exactly when it is an int or float (Python's or numpy's), not a
bool, and finite; callers then apply their own range.
"""

from __future__ import annotations

import math

import numpy as np


def finite_number(x) -> bool:
    """Whether ``x`` is a finite int or float (Python or numpy scalar), bools excluded."""
    return (isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))
            and math.isfinite(x))
