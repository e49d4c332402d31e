"""How much memory this process may still take: the system's available memory, or less where the process runs
in a control group with a memory limit (containers).

The engine asks before it makes a copy of the model's weights that it can do without (the packed linears, see
``kernels``): for a 7B-parameter model in bfloat16 that copy is another 14 GB, and on a machine that cannot
hold it the process would be killed later, far from the cause, instead of running on the slower path.

Invariants: ``available_bytes`` never raises; it returns None when nothing can be read (not Linux), and
otherwise the smallest of the figures it could read.
"""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")
# (limit, usage) files: cgroup v2, then v1's memory controller.
_CGROUP_FILES = (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))
_NO_LIMIT = 1 << 60  # v1 reports "no limit" as a number near 2^63


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, ValueError):
        return None
    return int(text) if text.isdigit() else None  # "max" (v2's no limit) and garbage read as nothing


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        lines = meminfo.read_text().splitlines()
    except (OSError, ValueError):
        return None
    for line in lines:
        name, _, rest = line.partition(":")
        parts = rest.split()
        if name == "MemAvailable" and parts and parts[0].isdigit():
            return int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return None


def available_bytes(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int | None:
    """Bytes this process can still allocate without pushing the system (or its control group) into reclaim:
    the smaller of ``MemAvailable`` and the control group's limit minus its usage; None when neither is
    readable."""
    figures = [_meminfo_available(meminfo)]
    for limit_name, usage_name in _CGROUP_FILES:
        limit, usage = _read_int(cgroup / limit_name), _read_int(cgroup / usage_name)
        if limit is not None and usage is not None and limit < _NO_LIMIT:
            figures.append(max(0, limit - usage))
            break
    known = [f for f in figures if f is not None]
    return min(known) if known else None
