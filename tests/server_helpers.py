"""Helpers shared by the server tests: metrics scraping, data URLs, waiting for the engine to go quiet."""

from __future__ import annotations

import base64
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> list:
    """Every sample of the server's /metrics, parsed by prometheus_client's own parser."""
    text = httpx.get(url + "/metrics").text
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def metric(samples: list, name: str, **labels) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` (0 when none)."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def wait_quiet(host, timeout_s: float = 30.0) -> None:
    """Wait until the host has no request in flight and the engine none live."""
    deadline = time.monotonic() + timeout_s
    while host.waiting or host.running or host.engine.has_unfinished():
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.01)


def error_of(response: httpx.Response) -> dict:
    """The OpenAI error object of an error response (checking its shape)."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def store_holds(store) -> int:
    """Leases held on the store's entries, all entries together (0 when no request holds anything)."""
    return sum(store.held(key) for key in store.keys())


class Blocked:
    """Keeps a generation queue's worker busy (``with Blocked(queue, waiting=k):``): one job that waits for the
    block to end, and ``waiting`` more queued behind it, so the queue's state is known while the block runs."""

    def __init__(self, queue, waiting: int = 0):
        import threading

        self.queue = queue
        self.gate = threading.Event()
        self.started = threading.Event()
        self.waiting = waiting

    def _hold(self, job):
        self.started.set()
        self.gate.wait(60)

    def __enter__(self):
        self.jobs = [self.queue.submit(self._hold)]
        assert self.started.wait(30), "the worker did not take the blocking job"
        self.jobs += [self.queue.submit(lambda job: None) for _ in range(self.waiting)]
        return self

    def __exit__(self, *exc):
        self.gate.set()
        for job in self.jobs:
            job.future.result(60)


def cancelled_from_a_hook(module, render) -> int:
    """Run ``render(job)`` with its job cancelled from a forward hook of ``module`` at the hook's first call;
    the render must raise ``JobCancelled``. Returns how many forwards of ``module`` ran."""
    import pytest

    from mmcache.server.job_queue import Job, JobCancelled

    job, calls = Job(lambda j: None), []

    def cancel(module, args, output):
        calls.append(1)
        job.cancelled.set()

    hook = module.register_forward_hook(cancel)
    try:
        with pytest.raises(JobCancelled):
            render(job)
    finally:
        hook.remove()
    return len(calls)
