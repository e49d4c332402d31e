"""The compute path's environment, read in one place: ``ComputeSettings.from_env``.

Variables (all optional; empty counts as unset):

* ``MMCACHE_NATIVE``: ``auto`` (use the compiled kernels where they build, else ATen), ``off`` (always ATen),
  ``require`` (a kernel that cannot be built is an error).
* ``MMCACHE_TILE_UNIT``: ``auto`` or ``off`` (keep the AMX tile unit out of every kernel, as on a CPU
  without it).
* ``MMCACHE_CACHE_DIR``: where the compiled library is kept (else ``$XDG_CACHE_HOME/mmcache``, else
  ``~/.cache/mmcache``).
* ``CC``: the C compiler (else ``cc``, else ``gcc``).

Invariant: nothing else in the compute path reads ``os.environ``; a caller (a test, a host with its own
configuration) may build ``ComputeSettings`` itself and hand it to ``native.library`` or ``ComputePath``.
A bad value raises ``NativeConfigError`` naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...errors import MmcacheError

ENV_CHOICE = "MMCACHE_NATIVE"
ENV_CACHE = "MMCACHE_CACHE_DIR"
ENV_TILES = "MMCACHE_TILE_UNIT"
NATIVE_CHOICES = ("auto", "off", "require")
TILE_CHOICES = ("auto", "off")


class NativeConfigError(MmcacheError, ValueError):
    """``MMCACHE_NATIVE`` or ``MMCACHE_TILE_UNIT`` (or the matching ``ComputeSettings`` field) holds a value
    it does not take."""


@dataclass(frozen=True)
class ComputeSettings:
    """Where and how the compiled kernels are built and loaded (see the module docstring for the variables)."""

    native: str = "auto"  # MMCACHE_NATIVE
    tile_unit: bool = True  # MMCACHE_TILE_UNIT != off
    cache_dir: Path | None = None  # MMCACHE_CACHE_DIR; None: the per-user default (``default_cache_dir``)
    compiler: str | None = None  # CC; None: cc, else gcc

    def __post_init__(self):
        if self.native not in NATIVE_CHOICES:
            raise NativeConfigError(f"{ENV_CHOICE}={self.native!r}: expected one of {', '.join(NATIVE_CHOICES)}")
        if not isinstance(self.tile_unit, bool):
            raise NativeConfigError(f"tile_unit must be a bool, got {self.tile_unit!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ComputeSettings:
        """The settings the environment (``os.environ`` by default) asks for."""
        env = os.environ if environ is None else environ
        native, tiles = _word(env, ENV_CHOICE), _word(env, ENV_TILES)
        if native not in NATIVE_CHOICES:
            raise NativeConfigError(f"{ENV_CHOICE}={env[ENV_CHOICE]!r}: expected one of {', '.join(NATIVE_CHOICES)}")
        if tiles not in TILE_CHOICES:
            raise NativeConfigError(f"{ENV_TILES}={env[ENV_TILES]!r}: expected auto or off")
        cache = env.get(ENV_CACHE) or None
        return cls(native=native, tile_unit=tiles == "auto",
                   cache_dir=Path(cache) if cache else default_cache_dir(env), compiler=env.get("CC") or None)

    @property
    def library_dir(self) -> Path:
        """Where ``native.build`` keeps libraries."""
        return self.cache_dir or default_cache_dir(os.environ)


def _word(env: Mapping[str, str], name: str) -> str:
    return env.get(name, "auto").strip().lower() or "auto"


def default_cache_dir(env: Mapping[str, str]) -> Path:
    """``$XDG_CACHE_HOME/mmcache``, else ``~/.cache/mmcache``."""
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mmcache"
