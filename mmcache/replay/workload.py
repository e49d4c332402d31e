"""What the replay simulator consumes: request specs that materialise their tokens, and a workload that says
when each request arrives.

* A ``RequestSpec`` knows its lengths up front and produces its prompt ids, its output ids and its media
  items on demand, deterministically: asking twice gives equal arrays. A spec that is a turn of a chat may
  name its chat in ``session`` (the turns of one session extend one another's prompts). The replay keeps
  only what a live or waiting request needs, so a trace's tokens are never all in memory at once.
* A ``Workload`` gives the initial arrivals, and for a closed-loop workload (agent sessions) the arrivals a
  finished request causes. Both are pure functions of the workload's parameters and their arguments, so one
  workload object can be replayed many times.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from ..names import MediaItem

Arrival = tuple[float, "RequestSpec"]  # (arrival time in seconds, request)

MAX_SEQUENCE_TOKENS = 2**24
"""The most tokens one replayed sequence (a request's prompt plus output; a whole agent session) may hold. Its
ids are built in memory (64 MiB at this size), so a trace line or parameter asking for more is refused when
read rather than exhausting memory; real context windows are far below it."""


class RequestSpec(Protocol):
    request_id: int
    prompt_len: int
    output_len: int

    def prompt_ids(self) -> np.ndarray: ...

    def output_ids(self) -> np.ndarray: ...

    def media(self) -> Sequence[MediaItem]: ...


class Workload(Protocol):
    description: str

    def initial(self) -> list[Arrival]:
        """Arrivals known before anything runs, in arrival order."""
        ...

    def follow_ups(self, spec: RequestSpec, time_s: float, served: bool) -> list[Arrival]:
        """Arrivals caused by ``spec`` ending at ``time_s`` (``served`` is False when it was rejected)."""
        ...
