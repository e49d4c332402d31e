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
