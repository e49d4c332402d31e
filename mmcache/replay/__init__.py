"""Trace replay and shadow measurement: price the cache on real traffic before a model runs.

A workload (the Mooncake conversation trace, ``mooncake``; or synthetic agent sessions, ``sessions``) is
replayed through the core's ``AllocationManager`` over metadata-only pools, one per data-parallel replica
(``simulate``), with a cost model for how long each request holds its pages (``costmodel``) and replica
choice by the core's ``ReplicaRouter`` or at random. ``report`` measures realized matched-page share against
the ceiling of an unlimited pool (``ceiling``), the in-flight forfeit of storing at teardown, evictions,
queueing, stalls caused by cached data (must be 0), duplicate media and replica dilution; ``cli`` is the
``mmcache replay`` command and ``plot`` draws the pool-size sweep.

Modules: ``tokens`` (deterministic token streams), ``workload`` (the request and workload protocol),
``mooncake``, ``sessions``, ``costmodel``, ``simulate``, ``ceiling``, ``report``, ``plot``, ``cli``.
"""

from .ceiling import ceiling_matches
from .costmodel import CostModel
from .mooncake import MooncakeTrace
from .report import build_record, replay, run_sweep, sweep_configs
from .sessions import AgentSessions, SessionParams, SessionParamsError, load_params
from .simulate import ReplayConfig, RunLog, simulate

__all__ = ["AgentSessions", "CostModel", "MooncakeTrace", "ReplayConfig", "RunLog", "SessionParams",
           "SessionParamsError", "build_record", "ceiling_matches", "load_params", "replay", "run_sweep",
           "simulate", "sweep_configs"]
