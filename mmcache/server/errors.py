"""OpenAI error objects and the HTTP status of every failure the server answers.

Every error response has the body ``{"error": {"message", "type", "param", "code"}}``. Statuses: 400 for a
malformed request or bad media, 401 for a missing or wrong API key, 404 for an unknown model or route, 413 for
a body or image beyond the limits, 503 with ``Retry-After`` when the waiting queue is full or the replica holding a request is gone, 500 when the model
itself failed. ``from_engine_error`` maps the typed errors a request can end with onto these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import AllocationFailed, GroupFailed, InvalidRequest, MediaDecodeError, MmcacheError

INVALID_REQUEST = "invalid_request_error"


@dataclass
class APIError(Exception):
    """An error response: ``status``, the OpenAI error fields and extra headers."""

    status: int
    message: str
    type: str = INVALID_REQUEST
    param: str | None = None
    code: str | None = None
    headers: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__init__(self.message)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(400, message, INVALID_REQUEST, param, code)


def too_large(message: str, param: str | None = None) -> APIError:
    return APIError(413, message, INVALID_REQUEST, param, "request_too_large")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key")


def model_not_found(model: str, served: str) -> APIError:
    return APIError(404, f"the model {model!r} does not exist; this server serves {served!r}", INVALID_REQUEST,
                    "model", "model_not_found")


def route_not_found(path: str) -> APIError:
    return APIError(404, f"no route {path}", INVALID_REQUEST, None, "not_found")


def overloaded(message: str, retry_after_s: int) -> APIError:
    return APIError(503, message, "service_unavailable", None, "queue_full", {"Retry-After": str(retry_after_s)})


def internal(message: str) -> APIError:
    return APIError(500, message, "internal_server_error", None, "internal_error")


def beyond_limits(err: MediaDecodeError) -> bool:
    """Whether a media error is a size limit (bytes or pixels) rather than bad content: ``encoders.media``
    words every size refusal with "exceed"."""
    return "exceed" in str(err.reason)


class ReplicaLost(MmcacheError):
    """The engine replica that held a request went away (it died, or stopped answering) before the request
    ended: answered 503 with ``Retry-After``, as a retry goes to a living replica."""


class CarriedError(MmcacheError):
    """An engine error carried to another process as the response it maps to (``carry``): the error types a
    request can end with are not all picklable, and the response is what the receiving handler needs. ``param``
    is left for the receiver to fill where the mapped response names one."""

    def __init__(self, status: int, message: str, type: str, code: str | None, headers: dict, names_param: bool):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code
        self.headers, self.names_param = dict(headers), names_param

    def __reduce__(self):
        return CarriedError, (self.status, self.message, self.type, self.code, self.headers, self.names_param)


_PARAM = "\x00param"


def carry(err: BaseException | None) -> CarriedError:
    """``err`` as the response ``from_engine_error`` gives it, in a form that pickles."""
    api = from_engine_error(err, _PARAM)
    return CarriedError(api.status, api.message, api.type, api.code, api.headers, api.param == _PARAM)


def from_engine_error(err: BaseException | None, param: str | None = None) -> APIError:
    """The response for a request the engine ended with ``err``."""
    if isinstance(err, CarriedError):
        return APIError(err.status, err.message, err.type, param if err.names_param else None, err.code,
                        dict(err.headers))
    if isinstance(err, ReplicaLost):
        return APIError(503, f"the engine replica serving this request is gone: {err}", "service_unavailable", None,
                        "replica_unavailable", {"Retry-After": "1"})
    if isinstance(err, MediaDecodeError):
        if beyond_limits(err):
            return too_large(f"image beyond the limits: {err}", param)
        return bad_request(f"bad image: {err}", param, "invalid_image")
    if isinstance(err, GroupFailed):
        return APIError(503, f"the tensor-parallel group failed: {err}", "service_unavailable", None,
                        "tensor_parallel_group_failed", {"Retry-After": "5"})
    if isinstance(err, AllocationFailed):
        return APIError(503, f"not enough KV pages: {err}", "service_unavailable", None, "out_of_pages",
                        {"Retry-After": "1"})
    if isinstance(err, InvalidRequest):
        return bad_request(str(err), param)
    if isinstance(err, MmcacheError):
        return internal(f"{type(err).__name__}: {err}")
    return internal(f"the request failed: {type(err).__name__ if err else 'unknown error'}: {err}")
