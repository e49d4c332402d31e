"""Connections under limits: a read deadline for each request's headers and body, and a cap on open connections.

uvicorn times out a connection only while it idles between requests (``timeout_keep_alive``). A client that
sends half a request and waits would hold its connection, and its file descriptor, forever; enough of them
exhaust the process's descriptors and the server stops answering, with no key needed. ``guarded_protocol``
returns uvicorn's httptools protocol with these rules added:

* A request's headers must arrive whole within ``header_timeout_s`` of the connection opening (or of its first
  byte, on a kept-alive connection); a request body may pause at most ``body_timeout_s`` between two of its
  chunks. Past either, the connection is closed: a handler reading that body sees the client gone, holds
  nothing, and submits nothing. The deadline is a total for the headers (a byte every few seconds does not
  extend it) and an idle bound for the body (a large body sent slowly but steadily is not cut).
* At most ``max_connections`` connections are open at once. One more is answered at once with a 503 OpenAI
  error object (``too_many_connections``, with ``Retry-After``) and closed, before any of its bytes are read,
  so the descriptors held stay within the cap plus those being refused.

What a reverse proxy in front would add: limits per client address (connections and request rate), which this
server does not keep because it sees every client behind a proxy as one address.
"""

from __future__ import annotations

import json
import resource
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..checks import positive_int
from .config import ServerConfigError

# descriptors the process needs beside its connections: model files, threads' pipes, the listening socket
_RESERVED_FDS = 256


@dataclass(frozen=True)
class ConnectionLimits:
    """The read deadlines of a request's headers and body, the cap on open connections, and the Retry-After of
    the 503 that a connection beyond the cap gets."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 4096
    retry_after_s: int = 1

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 86400:
                raise ServerConfigError(f"{name} must be a number of seconds in (0, 86400), got {value!r}")
        if not positive_int(self.max_connections):
            raise ServerConfigError(f"max_connections must be a positive int, got {self.max_connections!r}")


def raise_fd_limit(max_connections: int) -> int:
    """Raise the soft limit on open descriptors towards what ``max_connections`` needs (at most the hard
    limit); returns the connection cap that fits under the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + _RESERVED_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft - _RESERVED_FDS))


def refusal_bytes(retry_after_s: int) -> bytes:
    """The whole 503 response of a connection beyond the cap."""
    body = json.dumps({"error": {"message": "too many open connections; retry later",
                                 "type": "service_unavailable", "param": None,
                                 "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            f"retry-after: {retry_after_s}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


def guarded_protocol(limits: ConnectionLimits, on_refused=None, on_timeout=None) -> type:
    """uvicorn's httptools protocol under ``limits`` (module docstring); ``on_refused()`` and
    ``on_timeout(phase)`` ("header" or "body"), when given, are called on the event loop to count them."""
    refusal = refusal_bytes(limits.retry_after_s)

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self.connections.discard(self)
                transport.write(refusal)
                transport.close()
                if on_refused is not None:
                    on_refused()
                return
            self._arm(limits.header_timeout_s, "header")

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.transport.is_closing():
                return  # refused, or timed out: nothing more is read
            super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:  # a kept-alive connection's next request: its headers' deadline starts
                self._arm(limits.header_timeout_s, "header")

        def on_headers_complete(self) -> None:
            self._arm(limits.body_timeout_s, "body")
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._arm(limits.body_timeout_s, "body")
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _arm(self, seconds: float, phase: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired, phase)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, phase: str) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()
                if on_timeout is not None:
                    on_timeout(phase)

    return GuardedHttpToolsProtocol
