"""Typed errors of mmcache.

Every error a caller can provoke with bad input is one of these, never a bare ``assert``. Each carries the
fields a host needs to act on it (which request, how many pages short, which media item), and raising one
leaves the state that raised it unchanged.
"""

from __future__ import annotations


class MmcacheError(Exception):
    """Base class of every error mmcache raises on purpose."""


def without_frames(err: BaseException) -> BaseException:
    """``err`` itself, with the traceback of it and of every exception in its cause and context chains dropped.

    An error kept in a result (a request's output) would otherwise keep the failed call's frames alive, and
    through their locals whatever they held (the engine and its KV pool, a batch's activations, a request's
    images), in a reference cycle only the cyclic collector frees. Where the frames matter for diagnosis, format
    them first (``ForwardError.cause_traceback``)."""
    stack, seen = [err], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        stack += [e.__cause__, e.__context__]
    return err


class InvalidRequest(MmcacheError, ValueError):
    """A request's input is malformed: empty prompt, ids of the wrong dtype or shape, lengths out of range."""

    def __init__(self, message: str, request_id: object = None):
        super().__init__(message if request_id is None else f"request {request_id!r}: {message}")
        self.request_id = request_id


class UnknownRequest(MmcacheError, KeyError):
    """An operation named a request the manager does not hold (never admitted, or already torn down)."""

    def __init__(self, request_id: object, operation: str = ""):
        super().__init__(f"unknown request {request_id!r}" + (f" in {operation}" if operation else ""))
        self.request_id = request_id
        self.operation = operation

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class DuplicateRequest(MmcacheError, ValueError):
    """A request id was admitted while a request with that id is still held."""

    def __init__(self, request_id: object):
        super().__init__(f"request {request_id!r} is already admitted")
        self.request_id = request_id


class RequestStateError(MmcacheError, RuntimeError):
    """The operation is not valid in the request's current state (for example commit while suspended)."""

    def __init__(self, message: str, request_id: object = None):
        super().__init__(message if request_id is None else f"request {request_id!r}: {message}")
        self.request_id = request_id


class AllocationFailed(MmcacheError, RuntimeError):
    """No pages left for a live request after every cached page that could go was evicted.

    ``pages_short`` is how many more pages the allocation needed; the host holds, preempts or offloads a
    request and retries. The request's state is unchanged by the failed call.
    """

    def __init__(self, request_id: object, pages_needed: int, pages_short: int):
        super().__init__(
            f"request {request_id!r} needs {pages_needed} page(s), {pages_short} short after evicting every "
            f"evictable cached page"
        )
        self.request_id = request_id
        self.pages_needed = pages_needed
        self.pages_short = pages_short


class MediaDecodeError(MmcacheError, ValueError):
    """A media item (image, audio) could not be decoded: corrupt, truncated, unsupported or oversized."""

    def __init__(self, item: object, reason: str):
        super().__init__(f"media item {item!r}: {reason}")
        self.item = item
        self.reason = reason


class StoreEntryRejected(MmcacheError, ValueError):
    """Tensors offered to the encoder-output store do not match what the encoder declared it produces."""

    def __init__(self, key_hex: str, reason: str):
        super().__init__(f"store entry {key_hex}: {reason}")
        self.key_hex = key_hex
        self.reason = reason


class TraceFormatError(MmcacheError, ValueError):
    """A trace file line could not be parsed; ``line`` is 1-based."""

    def __init__(self, path: str, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


class GroupFailed(MmcacheError, RuntimeError):
    """A tensor-parallel group could not complete a step together: a rank died, stopped answering within the
    group's timeout, or answered what no rank may (``mmcache.agreement``). The group cannot go on; its requests
    fail with this error and a server answers 503 and exits (a supervisor starts the group again)."""
