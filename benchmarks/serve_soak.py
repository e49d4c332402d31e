"""The soak of ``mmcache bench serve --soak N``: N mixed requests against one server, then nothing held.

The server has ``TENANTS`` API keys (one tenant each), small limits (a body of at most ``BODY_LIMIT`` bytes, an
image of at most ``IMAGE_LIMIT``) and a waiting queue two short of the concurrency, so requests arriving in a
burst meet a full queue (503). Each request is drawn from a seeded generator as one of:

* ``chat``: a streamed chat to its end (0 to 2 small images, an earlier turn or not, a ``cache_salt`` or not,
  greedy or seeded sampling, any tenant); ``chat_once``: the same, not streamed;
* ``cut``: a streamed chat the client closes after k content chunks (k = 0: as soon as it is accepted);
* ``abandon``: a streamed chat the client gives up on after a random few milliseconds, often before any byte
  of the response (while its images are encoded or its prompt computed);
* ``completion``: ``/v1/completions`` with a text prompt;
* ``malformed``: one of ``malformed_cases``, each with the status it must get (400, 401 or 404);
* ``oversized``: a body or an image beyond the limits (413);
* ``hostile``: one of ``hostile_cases``, work a small request would make the server do, each refused before
  the work (a prompt's text beyond what the model's context holds, stop strings beyond their bound, an image
  whose pixels expand far beyond its bytes, JSON nested past any sane depth, a sampling field out of range:
  400 or 413), or a connection that sends half a request header or half a body, which the server must close
  (``closed``) within its read deadlines (``HEADER_TIMEOUT_S``).

Every request has an expected outcome; a 503 is accepted for any. At most ``--soak-concurrency`` requests are
in flight and the whole soak stops at ``--time-limit`` (what is still running is cancelled, which closes its
connection). Afterwards, once the server has no request waiting or running: no request, KV page or store
lease is held and ``check_invariants`` passes, else ``LeftHeld``; the counts by kind, case and outcome, the
statuses and any unexpected outcome are returned.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from mmcache.errors import MmcacheError

from . import loadgen
from .hostile import bomb_png

TENANTS = ("soak-key-a", "soak-key-b", "soak-key-c")
SALTS = (None, "blue", "green")
BODY_LIMIT = 1 << 20
IMAGE_LIMIT = 64 << 10
KINDS = {"chat": 0.3, "chat_once": 0.1, "cut": 0.2, "abandon": 0.05, "completion": 0.05, "malformed": 0.17,
         "oversized": 0.06, "hostile": 0.07}
HEADER_TIMEOUT_S = 2.0  # the soak server's read deadlines (headers, and pauses within a body)
CLOSED_WITHIN_S = 30.0  # a half-sent request's connection must be closed by the server within this
MAX_ABANDON_S = 0.03  # an abandoned request is given up after a uniform draw from 0 to this
BUSY = "503"  # accepted for every request: the waiting queue was full
SMALL_IMAGES = 6


class LeftHeld(MmcacheError, AssertionError):
    """After a part of the benchmark the server still held something, or an invariant was broken."""


@dataclass
class Planned:
    kind: str
    case: str
    expect: frozenset  # outcome labels: "ok", "cut", or an HTTP status as a string
    api_key: str | None
    path: str = "/chat/completions"
    body: object = None  # a dict (sent as JSON) or raw bytes
    cut_after: int | None = None
    abandon_after: float | None = None  # seconds after which the client gives up, whatever it has received
    half_sent: bytes | None = None  # the start of a request sent on a raw connection, never finished
    stream: bool = True
    result: str | None = None
    detail: dict = field(default_factory=dict)


# ---- the requests ----------------------------------------------------------------------------------------
def small_images(n: int, seed: int) -> list[bytes]:
    """``n`` distinct small PNGs: seeded crops of the photos of ``datasets/images``, scaled to 32-64 pixels."""
    from PIL import Image

    from .vlm import DATA, IMAGES

    rng = np.random.default_rng(seed)
    photos = [Image.open(DATA / "images" / name).convert("RGB") for name in IMAGES]
    out: list[bytes] = []
    while len(out) < n:
        photo = photos[len(out) % len(photos)]
        w, h = photo.size
        x, y = int(rng.integers(0, w // 2)), int(rng.integers(0, h // 2))
        side = int(rng.integers(32, 65))
        buf = io.BytesIO()
        photo.crop((x, y, x + w // 2, y + h // 2)).resize((side, side)).save(buf, format="PNG")
        if buf.getvalue() not in out:
            out.append(buf.getvalue())
    return out


def noise_png(side: int, seed: int) -> bytes:
    """A valid PNG of random pixels (it does not compress: about 3 bytes per pixel)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _url(image: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}}


def malformed_cases(model: str) -> list[tuple[str, int, str | None, object]]:
    """``(case, status, api key or None for none, body)``: requests the server must refuse."""
    key = TENANTS[0]
    ok = lambda **c: {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **c}
    text_url = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"hi").decode()}}
    return [
        ("bad_json", 400, key, b'{"model": "x", "messages": [}'),
        ("messages_not_a_list", 400, key, ok(messages="Hi")),
        ("no_messages", 400, key, ok(messages=[])),
        ("unknown_role", 400, key, ok(messages=[{"role": "robot", "content": "Hi"}])),
        ("unknown_part", 400, key, ok(messages=[{"role": "user", "content": [{"type": "video", "video": "x"}]}])),
        ("http_image", 400, key, ok(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]}])),
        ("bad_base64", 400, key, ok(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@not base64@@@"}}]}])),
        ("not_an_image", 400, key, ok(messages=[{"role": "user", "content": [text_url]}])),
        ("negative_temperature", 400, key, ok(temperature=-1)),
        ("zero_max_tokens", 400, key, ok(max_tokens=0)),
        ("n_above_1", 400, key, ok(n=2)),
        ("unknown_model", 404, key, ok(model=model + "-nope")),
        ("wrong_key", 401, "not-a-key", ok()),
        ("no_key", 401, None, ok()),
    ]


def oversized_cases(model: str, seed: int) -> list[tuple[str, int, str | None, object]]:
    big_image = noise_png(160, seed)  # about 77 KB: over IMAGE_LIMIT, well under BODY_LIMIT once in base64
    assert IMAGE_LIMIT < len(big_image) and 2 * len(big_image) < BODY_LIMIT
    return [
        ("big_body", 413, TENANTS[1], {"model": model, "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "word " * (BODY_LIMIT // 5 + 64)}]}),
        ("big_image", 413, TENANTS[1], {"model": model, "max_tokens": 2, "messages": [
            {"role": "user", "content": [_url(big_image), {"type": "text", "text": "What is it?"}]}]}),
    ]


def hostile_cases(model: str) -> list[tuple[str, int | str, str | None, object]]:
    """``(case, status or "closed", api key, body or the bytes of a half-sent request)``."""
    key = TENANTS[2]
    ok = lambda **c: {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **c}
    long_text = "a kite " * (BODY_LIMIT // 8)  # within the body limit, beyond what the context can hold
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nAuthorization: Bearer {key}\r\n"
    return [
        ("long_chat_text", 400, key, ok(messages=[{"role": "user", "content": long_text}])),
        ("long_stop_strings", 400, key, ok(stop=["x" * 8000] * 8)),
        ("image_bomb", 413, key, ok(messages=[{"role": "user", "content": [_url(bomb_png())]}])),
        ("nested_json", 400, key, b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        ("huge_temperature", 400, key, ok(temperature=1e308)),
        ("half_header", "closed", None, b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Le"),
        ("half_body", "closed", key, (head + "Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n"
                                      '{"model": ').encode()),
    ]


def plan(n: int, model: str, seed: int) -> list[Planned]:
    """``n`` requests drawn from ``seed``: the same list every time."""
    from .vlm import questions

    rng = np.random.default_rng(seed)
    images, qs = small_images(SMALL_IMAGES, seed), questions()
    refusals = {"malformed": malformed_cases(model), "oversized": oversized_cases(model, seed),
                "hostile": hostile_cases(model)}
    kinds, weights = list(KINDS), np.array(list(KINDS.values()))
    out = []
    for i in range(n):
        kind = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
        if kind in refusals:
            out.append(_planned_refusal(rng, kind, refusals[kind]))
        else:
            out.append(_planned_request(rng, kind, model, images, qs))
    return out


def _planned_refusal(rng, kind: str, cases: list) -> Planned:
    """One of ``cases`` (malformed, oversized or hostile), drawn: the server must refuse it with its status, or
    close a half-sent request's connection."""
    case, status, key, body = cases[int(rng.integers(len(cases)))]
    if status == "closed":
        return Planned(kind, case, frozenset({"closed"}), key, half_sent=body)
    return Planned(kind, case, frozenset({str(status), BUSY}), key, body=body)


def _planned_request(rng, kind: str, model: str, images: list[bytes], qs: list[str]) -> Planned:
    """A well-formed request of ``kind``, a drawn tenant and salt: a completion or a chat."""
    key = TENANTS[int(rng.integers(len(TENANTS)))]
    salt = SALTS[int(rng.integers(len(SALTS)))]
    extra = {} if salt is None else {"cache_salt": salt}
    if kind == "completion":
        body = {"model": model, "prompt": qs[int(rng.integers(len(qs)))], "max_tokens": int(rng.integers(1, 5)),
                "temperature": 0.0, **extra}
        return Planned(kind, "text", frozenset({"ok", BUSY}), key, "/completions", body, stream=False)
    messages = _chat_messages(rng, images, qs)
    sampling = ({"temperature": 0.0} if rng.random() < 0.5 else
                {"temperature": 0.8, "seed": int(rng.integers(1 << 31))})
    body = {"model": model, "messages": messages, **sampling, "extra_body": dict(extra)}  # vLLM's extensions
    return _planned_chat(rng, kind, key, body, messages)


def _planned_chat(rng, kind: str, key: str, body: dict, messages: list[dict]) -> Planned:
    """A chat of ``kind``: cut after drawn chunks, abandoned after a drawn wait, or run to its end."""
    if kind == "cut":
        k = int(rng.integers(0, 4))
        body.update(max_tokens=8)
        body["extra_body"]["ignore_eos"] = True  # k < 8: the client closes it before it ends
        # "ok" too: tokens that make no text (special ones) send no chunk, so k chunks may never come
        return Planned(kind, f"after_{k}", frozenset({"cut", "ok", BUSY}), key, body=body, cut_after=k)
    if kind == "abandon":
        body.update(max_tokens=8)
        wait = float(rng.uniform(0.0, MAX_ABANDON_S))
        return Planned(kind, "streamed", frozenset({"abandoned", "ok", BUSY}), key, body=body, abandon_after=wait)
    body["max_tokens"] = int(rng.integers(1, 7))
    return Planned(kind, f"{sum(_n_images(m) for m in messages)}_images", frozenset({"ok", BUSY}), key,
                   body=body, stream=kind == "chat")


def _n_images(message: dict) -> int:
    content = message.get("content")
    return 0 if isinstance(content, str) else sum(p.get("type") == "image_url" for p in content)


def _chat_messages(rng, images: list[bytes], qs: list[str]) -> list[dict]:
    parts = [_url(images[int(rng.integers(len(images)))]) for _ in range(int(rng.integers(0, 3)))]
    messages = [{"role": "system", "content": "You are a careful visual assistant."}] if rng.random() < 0.5 else []
    if rng.random() < 0.4:  # an earlier turn: its answer as text, as a client sends it back
        messages += [{"role": "user", "content": parts + [{"type": "text", "text": qs[int(rng.integers(len(qs)))]}]},
                     {"role": "assistant", "content": "A photo."}]
        parts = []
    messages.append({"role": "user", "content": parts + [{"type": "text", "text": qs[int(rng.integers(len(qs)))]}]})
    return messages


# ---- sending ---------------------------------------------------------------------------------------------
async def send(p: Planned, base_url: str, clients: dict, raw) -> None:
    """Send one planned request and set ``p.result`` to its outcome label."""
    if p.half_sent is not None:
        p.result = await _half_send(p.half_sent, base_url)
        return
    if p.kind in ("malformed", "oversized", "hostile", "completion"):
        await _send_raw(p, base_url, raw)
        return
    record = loadgen.Record(0, 0, p.api_key or "", time.perf_counter())
    api = clients[p.api_key]
    if p.abandon_after is not None:
        try:  # cancelled mid-request (in prefill, say): the connection closes under the server
            await asyncio.wait_for(loadgen.stream_chat(api, p.body, record), p.abandon_after)
        except asyncio.TimeoutError:
            p.result = "abandoned"
            return
    elif p.stream:
        await loadgen.stream_chat(api, p.body, record, p.cut_after)
    else:
        await loadgen.complete_chat(api, p.body, record)
    p.result = str(record.status) if record.outcome == "error" else record.outcome
    p.detail = {"error": record.error, "output_tokens": record.output_tokens}
    if record.outcome == "ok" and not record.output_tokens:
        p.result = "empty"  # a finished answer must have at least one token


async def _send_raw(p: Planned, base_url: str, raw) -> None:
    headers = {} if p.api_key is None else {"Authorization": f"Bearer {p.api_key}"}
    content = p.body if isinstance(p.body, bytes) else json.dumps(p.body).encode()
    headers["Content-Type"] = "application/json"
    reply = await raw.post(base_url + p.path, content=content, headers=headers)
    p.result = "ok" if reply.status_code == 200 else str(reply.status_code)
    if reply.status_code != 200:
        try:
            error = reply.json()["error"]
            p.detail = {"type": error["type"], "code": error.get("code")}
        except (ValueError, KeyError, TypeError):
            p.detail = {"type": None, "body": reply.text[:200]}
            p.result += " (not an OpenAI error object)"


async def _half_send(data: bytes, base_url: str) -> str:
    """Send ``data`` on a new connection and wait: ``closed`` once the server closes it (within
    ``CLOSED_WITHIN_S``), else ``held``."""
    host, port = base_url.removeprefix("http://").split("/", 1)[0].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    try:
        writer.write(data)
        await writer.drain()
        try:
            await asyncio.wait_for(reader.read(), CLOSED_WITHIN_S)  # b"" or what it sent, then EOF
        except ConnectionError:
            pass
        except asyncio.TimeoutError:
            return "held"
        return "closed"
    finally:
        writer.close()


async def drive(planned: list[Planned], base_url: str, concurrency: int, time_limit_s: float,
                progress=None) -> None:
    """Send every planned request, at most ``concurrency`` at a time, within ``time_limit_s`` (what is still
    running then is cancelled: ``timeout``); ``progress(done, total)`` after each request."""
    import httpx2
    import openai

    clients = {key: openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120.0)
               for key in TENANTS}
    slots = asyncio.Semaphore(concurrency)
    done = 0
    async with httpx2.AsyncClient(timeout=120.0) as raw:
        async def one(p: Planned) -> None:
            nonlocal done
            async with slots:
                await send(p, base_url, clients, raw)
            done += 1
            if progress is not None:
                progress(done, len(planned))

        tasks = [asyncio.ensure_future(one(p)) for p in planned]
        _, pending = await asyncio.wait(tasks, timeout=time_limit_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for p, task in zip(planned, tasks):
            if task.cancelled():
                p.result = "timeout"
            elif task.exception() is not None:
                p.result = f"client error: {type(task.exception()).__name__}"
                p.detail = {"error": str(task.exception())[:200]}
    for api in clients.values():
        await api.close()


# ---- afterwards ------------------------------------------------------------------------------------------
def wait_idle(host, timeout_s: float) -> bool:
    """Wait (at most ``timeout_s``) until the host has no request waiting or running and the engine none
    unfinished: aborts of closed streams are applied by the step thread a moment after the client left."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if host.waiting == 0 and host.running == 0 and not host.engine.has_unfinished():
            return True
        time.sleep(0.02)
    return False


def held_after(host) -> dict:
    """What the server's engine still holds, read with its steps paused: requests admitted to a manager,
    pages owned by anything but the prefix index, store leases open, and requests holding leases."""
    front, core = host.engine, host.core
    with host.hold():
        front.check_invariants()
        requests = sum(m.num_requests for m in core.managers.values())
        pages = sum(d["num_pages"] - d["free_pages"] - d["cached_pages"]
                    for label, d in core.metrics().items() if label != "engine")
        store = getattr(front, "store", None)
        leases = 0 if store is None else sum(store.held(k) for k in store.keys())
        holding = front.metrics().get("encoder", {}).get("requests_holding", 0)
    return {"requests": requests, "pages": pages, "store_leases": leases, "requests_holding_leases": holding}


def summarise(planned: list[Planned]) -> dict:
    by_kind: dict = {}
    by_case: dict = {}
    for p in planned:
        by_kind.setdefault(p.kind, Counter())[p.result] += 1
        by_case.setdefault(f"{p.kind}/{p.case}", Counter())[p.result] += 1
    unexpected = [p for p in planned if p.result not in p.expect]
    return {
        "requests": len(planned),
        "outcomes": dict(Counter(p.result for p in planned)),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "by_case": {k: dict(v) for k, v in sorted(by_case.items())},
        "unexpected": len(unexpected),
        "unexpected_examples": [{"kind": p.kind, "case": p.case, "got": p.result, "expected": sorted(p.expect),
                                 **p.detail} for p in unexpected[:10]],
    }


def _say_tenths(done: int, total: int) -> None:
    """A line on stderr at each tenth of a soak of 100 requests or more."""
    if total >= 100 and done * 10 // total != (done - 1) * 10 // total:
        print(f"[serve] soak: {done}/{total} requests done", file=sys.stderr, flush=True)


def soak(args, progress=_say_tenths) -> dict:
    """Run ``args.soak`` requests (see the module docstring) on a fresh server of ``args.soak_preset``."""
    from .serve import default_dtype, server_config

    concurrency = args.soak_concurrency
    preset = argparse.Namespace(**{**vars(args), "preset": args.soak_preset, "dtype": default_dtype(args.soak_preset)})
    config = server_config(preset, api_keys=TENANTS, max_body_bytes=BODY_LIMIT, max_image_bytes=IMAGE_LIMIT,
                           max_waiting=max(1, concurrency - 2), header_timeout_s=HEADER_TIMEOUT_S,
                           body_timeout_s=HEADER_TIMEOUT_S)
    planned = plan(args.soak, config.model_name, args.seed)
    from mmcache.presets import serve

    t0 = time.perf_counter()
    with serve(config) as srv:
        asyncio.run(drive(planned, srv.base_url, concurrency, args.time_limit, progress))
        seconds = time.perf_counter() - t0
        idle = wait_idle(srv.host, 30.0)
        try:
            held, invariants = held_after(srv.host), "ok"
        except AssertionError as e:
            held, invariants = None, f"broken: {e}"
        store = srv.host.engine.metrics().get("encoder")
    out = summarise(planned)
    out.update(seconds=seconds, idle_after=idle, held_after=held, invariants=invariants, tenants=len(TENANTS),
               preset=config.preset, concurrency=concurrency, max_waiting=config.max_waiting,
               body_limit=BODY_LIMIT, image_limit=IMAGE_LIMIT, store=store)
    if invariants != "ok" or not idle or any(held.values()):
        raise LeftHeld(f"after the soak: idle {idle}, held {held}, invariants {invariants}; counts "
                         f"{out['outcomes']}")
    return out
