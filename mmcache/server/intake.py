"""Reading a request, the same way for every route: key, body, JSON, fields, model, salt; waiting for a result
unless the client goes away (``unless_disconnected``, ``ClientGone``: the one disconnect watch); and a queue's
refusal as a 503 (``busy``).

Rules: a request is checked in this order: key (401), body size (413, the rest of an oversized body drained so
the client reads the answer), JSON (400, ``invalid_json``), fields (400, naming the field), model (404),
``cache_salt`` length (400). Nothing is held by a request that fails these checks.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from pydantic import ValidationError
from pydantic_core import from_json

from ..errors import InvalidRequest
from .errors import APIError, bad_request, model_not_found, overloaded, too_large, unauthorized
from .engine_host import QueueFull
from .tenants import Tenant, Tenants
from .job_queue import JobCancelled


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class Intake:
    """The checks shared by every route, over the server's ``config`` and ``tenants``."""

    def __init__(self, config, tenants: Tenants):
        self.config = config
        self.tenants = tenants

    def tenant(self, request: Request) -> Tenant:
        tenant = self.tenants.authenticate(request.headers.get("authorization"))
        if tenant is None:
            raise unauthorized("missing or wrong API key: send Authorization: Bearer KEY")
        return tenant

    async def body(self, request: Request, model, served: str, model_required: bool = True):
        """The body validated as the pydantic ``model``, for the model named ``served`` (a request naming no
        model is for it unless ``model_required``)."""
        raw = await bounded_body(request, self.config.max_body_bytes)
        req = parse_body(raw, model)
        if (req.model is not None or model_required) and req.model != served:
            raise model_not_found(req.model, served)
        return req

    async def read(self, request: Request, model, served: str, model_required: bool = True):
        """The checks in their order (module docstring): the tenant, the body validated as ``model`` (for the
        model named ``served``, as ``body``) and the salt of its store entries."""
        tenant = self.tenant(request)
        req = await self.body(request, model, served, model_required)
        return tenant, req, self.salt(tenant, req.cache_salt)

    def salt(self, tenant: Tenant, cache_salt: str | None) -> bytes:
        if cache_salt is not None and len(cache_salt) > self.config.max_cache_salt:
            raise bad_request(f"cache_salt is longer than {self.config.max_cache_salt} characters", "cache_salt")
        return self.tenants.salt(tenant, cache_salt)

    def busy(self, refusal: QueueFull) -> APIError:
        """A full queue's refusal (the host's or a pipeline's) as a 503 with the server's Retry-After."""
        return overloaded(f"the server is busy: {refusal}; retry later", self.config.retry_after_s)

    async def run_job(self, request: Request, submit):
        """The result of the job ``submit()`` queues (on a ``job_queue.GenerationQueue``), or None when the client
        went away first (the job is then cancelled). ``QueueFull`` is a 503, a refusal by the pipeline
        (``InvalidRequest``) a 400, a queue closing under the job a 503."""
        try:
            job = submit()
        except QueueFull as e:
            raise self.busy(e) from None
        try:
            return await unless_disconnected(request, asyncio.wrap_future(job.future))
        except ClientGone:
            job.cancel()
            return None
        except InvalidRequest as e:
            raise bad_request(str(e)) from None
        except JobCancelled:
            raise overloaded("the server is stopping; retry later", self.config.retry_after_s) from None
        except asyncio.CancelledError:
            job.cancel()
            raise


def parse_body(raw: bytes, model):
    """``raw`` (a UTF-8 JSON object; a leading byte-order mark is ignored) validated as the pydantic ``model``.
    Pydantic parses the bytes itself, in one pass and with no dict in between: on a body carrying images as
    data URLs that is several times faster than ``json.loads`` then ``model_validate``. Bad JSON, or JSON that
    is not an object, is 400 ``invalid_json``; a bad field is 400 naming it."""
    try:
        return model.model_validate_json(raw.removeprefix(_UTF8_BOM))
    except ValidationError as e:
        errors = e.errors(include_url=False)
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        raise bad_request(f"the body is not valid JSON: {first['msg']}", None, "invalid_json") from None
    if first.get("type") == "model_type" and not first.get("loc"):
        raise bad_request("the body must be a JSON object", None, "invalid_json") from None
    raise from_validation(errors) from None


def parse_json_object(raw: bytes) -> dict:
    """``raw`` (a UTF-8 JSON object; a leading byte-order mark is ignored) as a dict, for routes that check
    their fields by hand. Read by pydantic's parser, as ``parse_body`` reads: it bounds the nesting depth, so
    deep nesting is 400 ``invalid_json`` like any bad JSON (never a ``RecursionError``), and so is JSON that is
    not an object."""
    try:
        data = from_json(raw.removeprefix(_UTF8_BOM))
    except ValueError as e:
        raise bad_request(f"the body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", None, "invalid_json")
    return data


_UTF8_BOM = b"\xef\xbb\xbf"


def from_validation(errors) -> APIError:
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return bad_request(f"{param or 'request'}: {first.get('msg', 'invalid value')}", param)


async def bounded_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 once it passes ``limit`` bytes (what is left is read and dropped, so the client
    reads the 413 instead of a reset connection)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        await drain(request, limit)
        raise too_large(f"request body of {declared} bytes is beyond the limit of {limit}")
    chunks, size, more = [], 0, True
    while more:  # the raw messages, not request.stream(): a drain must know whether more is coming
        message = await request.receive()
        if message["type"] != "http.request":
            raise bad_request("the client disconnected before sending the whole body")
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            if more:
                await drain(request, limit)
            raise too_large(f"request body beyond the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def drain(request: Request, limit: int) -> None:
    """Read (and drop) what is left of an oversized body, up to a few times the limit, so the client reads
    our 413 instead of a reset connection."""
    seen = 0
    while seen <= 4 * limit:
        message = await request.receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def unless_disconnected(request: Request, awaitable):
    """The result of ``awaitable``, or ``ClientGone`` when the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return

