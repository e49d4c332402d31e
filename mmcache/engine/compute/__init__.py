"""The engine's CPU compute path behind one seam: ``ComputePath`` decides, for one model, what runs (packed
linears, products of few rows on the row or tile kernel, decode and chunk attention on the compiled kernels,
the compiled norms and rotary embedding, whole hits), applies it and names the backend.

Modules: ``config`` (``ComputeConfig``, the speed-only flags), ``settings`` (``ComputeSettings``: the one place
the environment is read), ``path`` (``ComputePath``), ``kernels`` (packed linears, allocator setting), ``native``
(the compiled library from ``csrc/``), ``norms`` and ``rotary`` (layer kernels installed as modules). How it all
runs is in ``INTERNALS.md`` beside this file. Of the engine it uses only
``attention`` (the backend's base name) and ``memory`` (the packing room).
"""

from .config import ComputeConfig, ComputeConfigError
from .path import ComputePath
from .settings import ComputeSettings, NativeConfigError

__all__ = ["ComputeConfig", "ComputeConfigError", "ComputePath", "ComputeSettings", "NativeConfigError"]
