"""What each hostile request of issue 50 costs a server: ``python -m benchmarks.hostile [--tree DIR] [--cases
c1,c2] [--json OUT] [--quick] [--cap S]``.

The same script measures any source tree (``--tree``: the code before a fix in a ``git worktree``, or the working
tree), so both sides are measured by one client, side by side:

* Each case gets a fresh server: ``<this python> -m mmcache.cli serve`` with the tree as its working directory
  and ``PYTHONPATH``, given only options both old and new trees know (``--preset``, ``--diffusion``, ``--tts``,
  ``--host``, ``--port``), on ``127.0.0.1`` and a free port. Nothing here connects anywhere else.
* While a case runs, a prober sends ``GET /health`` every 20 ms on its own connection; the case's ``stall_ms`` is
  its longest answer (the event loop's longest stall). ``cpu_s`` is the server process's CPU time during the case
  (``/proc/PID/stat``), ``peak_mb`` its peak resident memory (``VmHWM``, reset before the case where the kernel
  allows) less its resident memory before, ``fds`` its open descriptors after.
* Every wait is bounded by ``--cap`` seconds; a request still unanswered then is recorded as ``held > CAP s``,
  and the cap is its figure. A server is stopped with SIGTERM, then killed after ``STOP_S``.
* ``--quick`` shrinks every size, so a test runs a case in seconds.

Not in ``mmcache bench``'s registry: that command runs every registered benchmark in its default run, and these
cases start servers of five presets and hold them for minutes.
"""

from __future__ import annotations

import argparse
import base64
import functools
import io
import json
import os
import random
import resource
import signal
import socket
import string
import subprocess
import sys
import tempfile
import threading
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import numpy as np

from mmcache.cli import writable, write_json

HOST = "127.0.0.1"
PROBE_EVERY_S = 0.02
START_CAP_S = 300.0  # loading a tiny preset takes seconds; five sessions share this machine's cores
STOP_S = 15.0
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Sizes:
    """How large each hostile request is (the issue's figures, or ``QUICK``'s)."""

    prompt_chars: int = 4 * 2**20
    streams: int = 4
    stop_strings: int = 8
    stop_chars: int = 8000
    allowed_stop_chars: int = 256  # the longest stop string the hardened server takes
    stream_tokens: int = 256
    bombs: int = 16
    bomb_side: int = 7071
    half_connections: int = 2000
    half_wait_s: float = 12.0
    ref_text_chars: int = 256 * 1024
    abandon_after_s: float = 2.0
    image_prompt_chars: int = 4 * 2**20
    videos: int = 8
    video_prompt_chars: int = 2**20
    nesting: int = 100_000


FULL = Sizes()
QUICK = Sizes(prompt_chars=256 * 1024, streams=2, stop_strings=2, stop_chars=2000, stream_tokens=16, bombs=2,
              bomb_side=1000, half_connections=100, half_wait_s=1.0, ref_text_chars=16 * 1024,
              image_prompt_chars=256 * 1024, videos=2, video_prompt_chars=64 * 1024)


# ---- the server's process ----------------------------------------------------------------------------------
@dataclass
class Server:
    url: str
    port: int
    pid: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextmanager
def server(tree: Path, options: list[str], python: str = sys.executable):
    """A fresh ``mmcache serve OPTIONS`` of ``tree`` on loopback, answering ``/health``, stopped on leaving."""
    port = free_port()
    command = [python, "-m", "mmcache.cli", "serve", *options, "--host", HOST, "--port", str(port)]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            srv = Server(f"http://{HOST}:{port}", port, proc.pid)
            _wait_healthy(srv, proc, log)
            yield srv
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:  # a worker still busy: the figure is taken, the process goes
                proc.kill()
                proc.wait()


def _wait_healthy(srv: Server, proc: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + START_CAP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"the server exited with {proc.returncode} before answering /health:\n{tail}")
        try:
            if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not answer /health within {START_CAP_S:g} s")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of ``pid`` so far, every thread together."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def memory_kb(pid: int, key: str) -> int:
    """``key`` (``VmRSS``, ``VmHWM``) of ``/proc/PID/status`` in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peak(pid: int) -> bool:
    """Resets ``VmHWM`` to the current resident memory (Linux 4.0+); False where the kernel refuses."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Prober:
    """``with Prober(url, cap_s) as p:`` GET /health every 20 ms on one connection of its own; ``p.longest_s``
    is the slowest answer (or wait, where none came within ``cap_s``), ``p.failed`` the probes not answered 200."""

    def __init__(self, url: str, cap_s: float):
        self.url, self.cap_s = url, cap_s
        self.longest_s, self.probes, self.failed = 0.0, 0, 0
        self._stop, self._first = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._loop, name="health-prober", daemon=True)

    def __enter__(self) -> "Prober":
        """Returns once the first probe is answered: the prober's connection exists before the case starts."""
        self._thread.start()
        self._first.wait(self.cap_s)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.cap_s + STOP_S)

    def _loop(self) -> None:
        with httpx.Client(timeout=self.cap_s) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                try:
                    ok = client.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.longest_s = max(self.longest_s, time.perf_counter() - t0)
                self.probes += 1
                self.failed += not ok
                self._first.set()
                self._stop.wait(PROBE_EVERY_S)


# ---- requests and their answers ----------------------------------------------------------------------------
def answer(response: httpx.Response, body: bytes | None = None) -> str:
    """``"STATUS"``, with the OpenAI error object's code where the answer is one: ``"400 invalid_json"``
    (``body``: a streamed response's bytes, already read)."""
    code = None
    if response.status_code >= 400:
        try:
            code = json.loads(response.content if body is None else body)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            pass
    return f"{response.status_code} {code}" if code else str(response.status_code)


def held(cap_s: float) -> str:
    return f"held > {cap_s:g} s"


def post(url: str, body: dict | bytes, cap_s: float) -> tuple[str, float, httpx.Response | None]:
    """(answer, seconds, response) of one POST of ``body`` (a dict as JSON, bytes as they are), bounded."""
    t0 = time.perf_counter()
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        r = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=cap_s)
    except httpx.TimeoutException:
        return held(cap_s), time.perf_counter() - t0, None
    except httpx.HTTPError as e:
        return f"error {type(e).__name__}", time.perf_counter() - t0, None
    return answer(r), time.perf_counter() - t0, r


def words(chars: int, seed: int = 0) -> str:
    """``chars`` characters of random lowercase words: text a tokenizer splits into many tokens."""
    rng = random.Random(seed)
    out, n = [], 0
    while n < chars:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) + " "
        out.append(word)
        n += len(word)
    return "".join(out)[:chars]


@functools.lru_cache(maxsize=32)
def bomb_png(side: int = 7071, mark: int = 0) -> bytes:
    """A 1-bit PNG of ``side`` x ``side`` pixels, black but for a few pixels placed by ``mark``: a few KB on the
    wire, ``side**2`` pixels decoded (distinct marks: distinct images, so no cache answers one for another)."""
    from PIL import Image

    image = Image.new("1", (side, side), 0)
    for k in range(4):
        image.putpixel(((mark * 131 + k * 17) % side, (mark * 71 + k * 29) % side), 1)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def reference_wav(seconds: float = 0.6, rate: int = 16_000) -> bytes:
    """A short decaying tone as a 16-bit WAV: a valid reference clip."""
    t = np.arange(int(seconds * rate)) / rate
    samples = (0.3 * np.sin(2 * np.pi * 220.0 * t) * np.exp(-t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def streamed(url: str, body: dict, cap_s: float) -> tuple[str, float]:
    """(answer, seconds to the stream's end) of one streamed POST, bounded."""
    t0 = time.perf_counter()
    try:
        with httpx.stream("POST", url, json=body, timeout=cap_s) as r:
            received = bytearray()
            for chunk in r.iter_bytes():
                received += chunk
                if time.perf_counter() - t0 > cap_s:
                    return held(cap_s), time.perf_counter() - t0
            return answer(r, bytes(received)), time.perf_counter() - t0
    except httpx.TimeoutException:
        return held(cap_s), time.perf_counter() - t0


# ---- the cases -----------------------------------------------------------------------------------------------
# Each case: (server options, the hostile requests, optionally a baseline run before the measured window).
# A case returns a dict whose "status" is the line the table shows; its other keys go to the JSON.
def long_prompt(srv: Server, sizes: Sizes, cap_s: float) -> dict:
    status, seconds, _ = post(srv.url + "/v1/completions", {"model": "tiny", "prompt": words(sizes.prompt_chars),
                                                             "max_tokens": 1}, cap_s)
    return {"status": status, "seconds": seconds, "prompt_chars": sizes.prompt_chars}


def _stream_body(tokens: int, stop: list[str] | None) -> dict:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    return body if stop is None else {**body, "stop": stop}


_SHORT_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}


def stop_strings_baseline(srv: Server, sizes: Sizes, cap_s: float) -> dict:
    """The same streams without stop strings, and the short chat alone: what the measured figures compare to."""
    with ThreadPoolExecutor(sizes.streams) as pool:
        plain = list(pool.map(lambda _: streamed(srv.url + "/v1/completions", _stream_body(sizes.stream_tokens, None),
                                                 cap_s), range(sizes.streams)))
    _, chat_s, _ = post(srv.url + "/v1/chat/completions", _SHORT_CHAT, cap_s)
    return {"plain_stream_s": max(s for _, s in plain), "chat_alone_s": chat_s}


def stop_strings(srv: Server, sizes: Sizes, cap_s: float) -> dict:
    return _streams_with_stops(srv, sizes, sizes.stop_chars, cap_s)


def allowed_stop_strings(srv: Server, sizes: Sizes, cap_s: float) -> dict:
    """Stop strings of the longest length both servers take: the per-token check itself, before and after."""
    return _streams_with_stops(srv, sizes, sizes.allowed_stop_chars, cap_s)


def _streams_with_stops(srv: Server, sizes: Sizes, stop_chars: int, cap_s: float) -> dict:
    stops = [words(stop_chars, seed=1 + k) for k in range(sizes.stop_strings)]
    body = _stream_body(sizes.stream_tokens, stops)
    with ThreadPoolExecutor(sizes.streams + 1) as pool:
        streams = [pool.submit(streamed, srv.url + "/v1/completions", body, cap_s) for _ in range(sizes.streams)]
        time.sleep(0.1)  # the streams first, then the unrelated chat beside them
        chat = pool.submit(post, srv.url + "/v1/chat/completions", _SHORT_CHAT, cap_s).result()
        answers = [f.result() for f in streams]
    return {"status": ",".join(sorted({a for a, _ in answers})), "stream_s": max(s for _, s in answers),
            "chat": chat[0], "chat_s": chat[1]}


def image_bombs(srv: Server, sizes: Sizes, cap_s: float) -> dict:
    images = [bomb_png(sizes.bomb_side, k) for k in range(sizes.bombs)]
    content = [{"type": "text", "text": "Describe these."}]
    content += [{"type": "image_url", "image_url": {"url": data_url(png, "image/png")}} for png in images]
    status, seconds, _ = post(srv.url + "/v1/chat/completions",
                              {"model": "tiny-llava", "messages": [{"role": "user", "content": content}],
                               "max_tokens": 1}, cap_s)
    return {"status": status, "seconds": seconds, "wire_bytes": sum(len(png) for png in images)}


_HALF_HEADER = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Never-Ends: "


def half_headers(srv: Server, sizes: Sizes, cap_s: float) -> dict:
    """Connections that each send half a request header and wait; then the server's descriptors, whether a new
    client still gets /health, and how many of the half connections the server closed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the bench's own limit, never the server's
    sockets, refused = [], 0
    try:
        for _ in range(sizes.half_connections):
            try:
                s = socket.create_connection((HOST, srv.port), timeout=5)
                s.sendall(_HALF_HEADER)
                sockets.append(s)
            except OSError:
                refused += 1
        time.sleep(sizes.half_wait_s)
        fds_while_held = open_fds(srv.pid)
        try:
            health = answer(httpx.get(srv.url + "/health", timeout=min(cap_s, 10.0)))
        except httpx.HTTPError as e:
            health = f"no answer ({type(e).__name__})"
        closed = sum(_closed_by_peer(s) for s in sockets)
    finally:
        for s in sockets:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return {"status": f"health {health}", "connections": sizes.half_connections, "refused": refused,
            "closed_by_server": closed, "fds_while_held": fds_while_held, "server_nofile": _nofile(srv.pid)}


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the server has closed ``s`` (or answered it, e.g. 408 or 503, which it closes after)."""
    s.setblocking(False)
    try:
        s.recv(1, socket.MSG_PEEK)  # b"" (closed) or the start of an answer: the server is done with it
        return True
    except BlockingIOError:
        return False
    except OSError:  # reset by the server
        return True


def _nofile(pid: int) -> str:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return " ".join(line.split()[3:5])
    return "?"


def _speech_body(ref_text: str, text: str) -> dict:
    return {"model": "tiny-csm", "input": text, "voice": "cloned", "ref_audio": data_url(reference_wav(), "audio/wav"),
            "ref_text": ref_text, "max_new_tokens": 3, "seed": 1}


def long_ref_text_baseline(srv: Server, sizes: Sizes, cap_s: float) -> dict:
    _, seconds, _ = post(srv.url + "/v1/audio/speech", _speech_body("The clip says this.", "Hello there."), cap_s)
    return {"speech_alone_s": seconds}


def long_ref_text(srv: Server, sizes: Sizes, cap_s: float) -> dict:
    """A speech request with a long ref_text, abandoned by its client; then how long another tenant waits."""
    hostile, _, _ = post(srv.url + "/v1/audio/speech", _speech_body(words(sizes.ref_text_chars), "Hello there."),
                         sizes.abandon_after_s)
    if hostile.startswith("held"):
        hostile = f"abandoned after {sizes.abandon_after_s:g} s"
    after, seconds, _ = post(srv.url + "/v1/audio/speech", _speech_body("The clip says this.", "Hello there."), cap_s)
    return {"status": hostile, "next_speech": after, "next_speech_s": seconds}


def long_image_prompt(srv: Server, sizes: Sizes, cap_s: float) -> dict:
    status, seconds, _ = post(srv.url + "/v1/images/generations",
                              {"model": "tiny-sd3", "prompt": words(sizes.image_prompt_chars),
                               "num_inference_steps": 2}, cap_s)
    return {"status": status, "seconds": seconds}


_VIDEO = {"model": "tiny-wan", "num_inference_steps": 2, "seed": 7}


def video_prompts(srv: Server, sizes: Sizes, cap_s: float) -> dict:
    """Video jobs with long prompts; the job list's bytes right after and once the jobs are done."""
    answers = [post(srv.url + "/v1/videos", {**_VIDEO, "prompt": words(sizes.video_prompt_chars, seed=k)}, cap_s)
               for k in range(sizes.videos)]
    listed = _listing_bytes(srv, cap_s)
    ids = [r.json()["id"] for _, _, r in answers if r is not None and r.status_code == 200]
    ends = [_job_end(srv, job, cap_s) for job in ids]
    return {"status": ",".join(sorted({a for a, _, _ in answers})), "list_bytes": listed,
            "list_bytes_done": _listing_bytes(srv, cap_s), "jobs": ",".join(sorted(set(ends)))}


def _listing_bytes(srv: Server, cap_s: float) -> int | str:
    try:
        return len(httpx.get(srv.url + "/v1/videos", timeout=cap_s).content)
    except httpx.HTTPError as e:
        return f"error {type(e).__name__}"


def _job_end(srv: Server, job: str, cap_s: float) -> str:
    """The job's status once completed or failed, or ``held > CAP s``."""
    deadline = time.monotonic() + cap_s
    while time.monotonic() < deadline:
        status = httpx.get(f"{srv.url}/v1/videos/{job}", timeout=cap_s).json().get("status")
        if status in ("completed", "failed"):
            return status
        time.sleep(0.2)
    return held(cap_s)


def huge_guidance(srv: Server, sizes: Sizes, cap_s: float) -> dict:
    """guidance_scale 1e308: the image's answer and whether its PNG is one flat colour; the video job's end."""
    image, _, r = post(srv.url + "/v1/images/generations",
                       {"model": "tiny-sd3", "prompt": "a red kite", "num_inference_steps": 2, "seed": 3,
                        "guidance_scale": 1e308}, cap_s)
    flat = _flat_png(r.json()["data"][0]["b64_json"]) if r is not None and r.status_code == 200 else None
    video, _, r = post(srv.url + "/v1/videos", {**_VIDEO, "prompt": "a red kite", "guidance_scale": 1e308}, cap_s)
    job = _job_end(srv, r.json()["id"], cap_s) if r is not None and r.status_code == 200 else None
    return {"status": f"image {image}, video {video}", "flat_png": flat, "video_job": job}


def _flat_png(b64: str) -> bool:
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))
    return bool((pixels == pixels.reshape(-1, pixels.shape[-1])[0]).all())


def nested_json(srv: Server, sizes: Sizes, cap_s: float) -> dict:
    body = b'{"prompt": ' + b"[" * sizes.nesting + b"]" * sizes.nesting + b"}"
    status, seconds, _ = post(srv.url + "/v1/videos", body, cap_s)
    return {"status": status, "seconds": seconds}


@dataclass(frozen=True)
class Case:
    options: tuple[str, ...]
    run: Callable[[Server, Sizes, float], dict]
    baseline: Callable[[Server, Sizes, float], dict] | None = None


CASES = {
    "long_prompt": Case(("--preset", "tiny"), long_prompt),
    "stop_strings": Case(("--preset", "tiny"), stop_strings, stop_strings_baseline),
    "allowed_stop_strings": Case(("--preset", "tiny"), allowed_stop_strings, stop_strings_baseline),
    "image_bombs": Case(("--preset", "tiny-llava"), image_bombs),
    "half_headers": Case(("--preset", "tiny"), half_headers),
    "long_ref_text": Case(("--tts", "tiny-csm"), long_ref_text, long_ref_text_baseline),
    "long_image_prompt": Case(("--diffusion", "tiny-sd3"), long_image_prompt),
    "video_prompts": Case(("--diffusion", "tiny-wan"), video_prompts),
    "huge_guidance": Case(("--diffusion", "tiny-sd3", "--diffusion", "tiny-wan"), huge_guidance),
    "nested_json": Case(("--diffusion", "tiny-wan"), nested_json),
}


# ---- measuring -----------------------------------------------------------------------------------------------
def measure(name: str, tree: Path, sizes: Sizes, cap_s: float) -> dict:
    """One case on a fresh server of ``tree``: the case's own record, then what it cost the server."""
    case = CASES[name]
    with server(tree, list(case.options)) as srv:
        record = case.baseline(srv, sizes, cap_s) if case.baseline else {}
        rss_kb, peak_reset, cpu0 = memory_kb(srv.pid, "VmRSS"), reset_peak(srv.pid), cpu_seconds(srv.pid)
        with Prober(srv.url, cap_s) as probe:
            record.update(case.run(srv, sizes, cap_s))
        record.update(stall_ms=probe.longest_s * 1e3, probes=probe.probes, probes_failed=probe.failed,
                      cpu_s=cpu_seconds(srv.pid) - cpu0, peak_mb=(memory_kb(srv.pid, "VmHWM") - rss_kb) / 1024,
                      peak_reset=peak_reset, fds=open_fds(srv.pid), url=srv.url)
    return record


def machine() -> dict:
    """The CPU's model and how many cores this process may use."""
    try:
        models = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")]
    except OSError:
        models = []
    return {"cpu": models[0] if models else "unknown", "cores": len(os.sched_getaffinity(0))}


def commit_of(tree: Path) -> str:
    """The tree's commit, ``+dirty`` where tracked files differ from it (a working tree with fixes in progress)."""
    git = ["git", "-C", str(tree)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return (head or "unknown") + ("+dirty" if changed.stdout.strip() else "")


def run(tree: Path, names: list[str], quick: bool = False, cap_s: float = 120.0,
        on_case: Callable[[str, dict], None] = lambda name, record: None) -> dict:
    """Every case of ``names`` against ``tree``, in order; ``on_case`` sees each record as it is taken."""
    sizes = QUICK if quick else FULL
    result = {"tree": str(tree), "commit": commit_of(tree), "machine": machine(), "quick": quick, "cap_s": cap_s,
              "cases": {}}
    for name in names:
        print(f"[hostile] {name} ...", file=sys.stderr, flush=True)
        result["cases"][name] = measure(name, tree, sizes, cap_s)
        on_case(name, result["cases"][name])
    return result


def table(result: dict) -> str:
    header = ("case", "status", "stall ms", "CPU s", "peak MB", "fds")
    rows = [(name, r["status"], f"{r['stall_ms']:.0f}", f"{r['cpu_s']:.2f}", f"{r['peak_mb']:.0f}", str(r["fds"]))
            for name, r in result["cases"].items()]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hostile", description=__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, default=REPO, help="the source tree whose server is measured (default: "
                                                           "this checkout)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, from: " + ", ".join(CASES))
    p.add_argument("--json", metavar="OUT", help="write the figures here")
    p.add_argument("--quick", action="store_true", help="small sizes, for a test")
    p.add_argument("--cap", type=float, default=120.0, metavar="S", help="the bound of every wait (default 120)")
    args = p.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    if unknown := [n for n in names if n not in CASES]:
        p.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    if not (args.tree / "mmcache" / "cli.py").is_file():
        p.error(f"--tree {args.tree} holds no mmcache/cli.py")
    if not args.cap > 0:
        p.error("--cap must be positive")
    if not writable(args.json, p.prog):
        return 2
    result = run(args.tree.resolve(), names, args.quick, args.cap)
    write_json(args.json, result)
    print(f"{result['tree']} at {result['commit']} on {result['machine']['cpu']} ({result['machine']['cores']} cores)")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
