"""The open-loop load generator: its Poisson schedule, its statistics on synthetic records (exact values), and
its client against a stub OpenAI-style chat app served in-process over an ASGI transport (no socket)."""

import asyncio
import json

import numpy as np
import pytest

from benchmarks import loadgen
from benchmarks.loadgen import Record, Session


# ---- schedule --------------------------------------------------------------------------------------------
def test_poisson_arrivals_are_seeded_increasing_and_at_the_rate():
    a = loadgen.poisson_arrivals(4.0, 20_000, seed=7)
    assert np.array_equal(a, loadgen.poisson_arrivals(4.0, 20_000, seed=7))
    assert not np.array_equal(a, loadgen.poisson_arrivals(4.0, 20_000, seed=8))
    assert np.all(np.diff(a) > 0) and a[0] > 0
    gaps = np.diff(np.concatenate([[0.0], a]))
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: standard deviation equals the mean
    with pytest.raises(ValueError, match="rate"):
        loadgen.poisson_arrivals(0.0, 3, seed=0)


# ---- statistics ------------------------------------------------------------------------------------------
def rec(send, first=None, step=0.0, tokens=0, outcome="ok", prompt=None, cached=None, status=None, error=None):
    """A record sent at ``send`` whose ``tokens`` content chunks come ``step`` apart from ``first``."""
    times = [first + i * step for i in range(tokens)] if first is not None else []
    return Record(0, 0, "", send, first, times, times[-1] if times else send + 0.01, prompt, cached,
                  tokens, "", outcome, status, error, choice_times=list(times))


def test_a_stream_is_timed_from_its_first_chunk_with_a_choice_whatever_its_text():
    from benchmarks import sse_client

    r = Record(0, 0, "", 1.0)
    for now, text in ((1.2, ""), (1.3, ""), (1.4, "ab"), (1.5, "c")):  # two steps whose bytes were held back
        sse_client._take(r, {"choices": [{"delta": {"content": text}}]}, now)
    sse_client._take(r, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}, 1.6)
    r.end = 1.6
    assert r.choice_times == [1.2, 1.3, 1.4, 1.5]  # the usage chunk carries no choice
    assert r.step_ttft == pytest.approx(0.2) and r.step_tpot == pytest.approx(0.1)
    assert r.ttft == pytest.approx(0.4)  # the first text, which the low-load part pairs with in-process figures
    s = loadgen.summarise([r], ttft_slo_s=0.25, tpot_slo_s=0.2)
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["attainment"] == 1.0  # first text (0.4) would miss
    silent = Record(0, 0, "", 0.0, end=1.0, outcome="ok")  # no chunk with a choice: no TTFT, the SLO missed
    assert silent.step_ttft is None and loadgen.summarise([silent], 1.0, 1.0)["attainment"] == 0.0


def test_a_records_latencies():
    r = rec(1.0, first=1.5, step=0.1, tokens=5)
    assert r.ttft == pytest.approx(0.5) and r.e2e == pytest.approx(0.9) and r.tpot == pytest.approx(0.1)
    assert rec(0.0, first=0.2, tokens=1).tpot is None  # one token: nothing after the first
    assert rec(0.0, outcome="error").ttft is None


def test_percentiles_interpolate_linearly():
    p = loadgen.percentiles(list(range(1, 101)))
    assert p == {50: pytest.approx(50.5), 90: pytest.approx(90.1), 99: pytest.approx(99.01)}
    assert loadgen.percentiles([]) == {50: None, 90: None, 99: None}
    assert loadgen.percentiles([3.0]) == {50: 3.0, 90: 3.0, 99: 3.0}


def test_summary_of_synthetic_records_is_exact():
    records = [rec(0.0, first=0.1, step=0.02, tokens=6, prompt=100, cached=40),   # meets both SLOs
               rec(1.0, first=1.3, step=0.02, tokens=6, prompt=100, cached=60),   # TTFT 0.3: misses
               rec(2.0, first=2.1, step=0.08, tokens=6, prompt=200, cached=0),    # TPOT 0.08: misses
               rec(3.0, first=3.1, step=0.02, tokens=3, outcome="cut"),           # not counted for SLOs
               rec(4.0, outcome="error", status=400, error="invalid_request_error"),
               rec(5.0, outcome="timeout")]
    s = loadgen.summarise(records, ttft_slo_s=0.2, tpot_slo_s=0.05)
    assert s["requests"] == 6
    assert s["outcomes"] == {"ok": 3, "cut": 1, "error": 1, "timeout": 1}
    assert s["statuses"] == {"400": 1}
    assert s["ttft_p50_s"] == pytest.approx(0.1) and s["ttft_p99_s"] == pytest.approx(0.296)
    assert s["tpot_p50_s"] == pytest.approx(0.02) and s["tpot_p90_s"] == pytest.approx(0.068)
    assert s["e2e_p50_s"] == pytest.approx(0.4)  # 0.2, 0.4, 0.5
    assert s["attainment"] == pytest.approx(1 / 5)  # one of the three ok, the error and the timeout
    assert (s["prompt_tokens"], s["cached_tokens"]) == (400, 100) and s["matched_share"] == pytest.approx(0.25)
    assert s["output_tokens"] == 21
    assert s["span_s"] == pytest.approx(5.01) and s["throughput_tok_s"] == pytest.approx(21 / 5.01)
    assert "attainment" not in loadgen.summarise(records)  # no SLOs given


def test_summary_of_nothing_ok():
    s = loadgen.summarise([rec(0.0, outcome="error", status=503, error="server_busy")], 1.0, 1.0)
    assert s["ttft_p50_s"] is None and s["matched_share"] is None and s["attainment"] == 0.0
    assert s["statuses"] == {"503": 1}
    assert loadgen.summarise([rec(0.0, first=0.1, tokens=2, outcome="cut")], 1.0, 1.0)["attainment"] is None


def test_goodput_is_the_highest_rate_meeting_the_threshold():
    rates = [{"rate": 1, "attainment": 1.0}, {"rate": 2, "attainment": 0.95}, {"rate": 4, "attainment": 0.5},
             {"rate": 3, "attainment": 0.9}, {"rate": 8, "attainment": None}]
    assert loadgen.goodput(rates) == 3
    assert loadgen.goodput(rates, threshold=0.99) == 1
    assert loadgen.goodput([{"rate": 1, "attainment": 0.2}]) is None


# ---- the client against a stub app -----------------------------------------------------------------------
async def _read_json(receive) -> dict:
    """An ASGI request's whole body, parsed as JSON."""
    raw = b""
    while True:
        msg = await receive()
        raw += msg.get("body", b"")
        if not msg.get("more_body"):
            return json.loads(raw)


class StubChat:
    """An ASGI app answering /v1/chat/completions like an OpenAI server, streaming ``max_tokens`` chunks
    ("w0 w1 ..."); a user message "fail" gets a 400 error object, "hang" never answers. Keeps every body."""

    def __init__(self):
        self.bodies = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = await _read_json(receive)
        self.bodies.append(body)
        last = body["messages"][-1]["content"]
        if last == "hang":
            await asyncio.sleep(60)
        if last == "fail":
            err = {"error": {"message": "no", "type": "invalid_request_error", "param": None, "code": None}}
            await self._reply(send, 400, "application/json", json.dumps(err).encode())
            return
        prompt = sum(len(str(m["content"]).split()) for m in body["messages"])
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        chunks += [{"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]} for i in range(body["max_tokens"])]
        chunks.append({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": body["max_tokens"],
                                                "total_tokens": prompt + body["max_tokens"],
                                                "prompt_tokens_details": {"cached_tokens": prompt // 2}}})
        common = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
        sse = b"".join(b"data: " + json.dumps({**common, **c}).encode() + b"\n\n" for c in chunks)
        await self._reply(send, 200, "text/event-stream", sse + b"data: [DONE]\n\n")

    @staticmethod
    async def _reply(send, status, ctype, payload):
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype.encode())]})
        await send({"type": "http.response.body", "body": payload})


def run_stub(app, sessions, rate=200.0, time_limit_s=20.0, max_in_flight=None, offsets=None):
    import httpx2
    import openai

    async def go():
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)) as http:
            client = openai.AsyncOpenAI(base_url="http://stub/v1", api_key="k", max_retries=0, http_client=http)
            return await loadgen.open_loop(lambda key: client, sessions, rate, seed=1, time_limit_s=time_limit_s,
                                           max_in_flight=max_in_flight, offsets=offsets)

    return asyncio.run(go())


def session(*turns, cut_after=None, tokens=3):
    return Session([{"role": "system", "content": "be brief"}], [{"role": "user", "content": t} for t in turns],
                   {"model": "m", "max_tokens": tokens}, api_key="k", cut_after=cut_after)


def test_sessions_send_the_whole_history_and_record_every_turn():
    app = StubChat()
    records = run_stub(app, [session("a b", "c"), session("d", cut_after=2, tokens=5), session("e", "fail", "f")])
    by = {(r.session, r.turn): r for r in records}
    assert sorted(by) == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)]  # session 2 stops at its failed turn
    first = by[0, 0]
    assert first.outcome == "ok" and first.text == "w0 w1 w2 " and len(first.token_times) == 3
    assert (first.prompt_tokens, first.cached_tokens, first.output_tokens) == (4, 2, 3)
    assert first.send < first.first_token <= first.token_times[-1] <= first.end
    turn2 = next(b for b in app.bodies if b["messages"][-1]["content"] == "c")
    assert turn2["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b"},
                                 {"role": "assistant", "content": "w0 w1 w2 "}, {"role": "user", "content": "c"}]
    assert turn2["stream"] is True and turn2["stream_options"] == {"include_usage": True}
    cut = by[1, 0]
    assert cut.outcome == "cut" and len(cut.token_times) == 2 and cut.output_tokens == 2
    failed = by[2, 1]
    assert (failed.outcome, failed.status, failed.error) == ("error", 400, "invalid_request_error")
    s = loadgen.summarise(records, 10.0, 10.0)
    assert s["outcomes"] == {"ok": 3, "cut": 1, "error": 1, "timeout": 0} and s["attainment"] == 0.75


def test_the_time_limit_cancels_what_still_runs():
    records = run_stub(StubChat(), [session("x"), session("hang"), session("y")], time_limit_s=1.0,
                       max_in_flight=1)
    outcomes = {r.session: r.outcome for r in records}
    assert outcomes[0] == "ok" and outcomes[1] == "timeout"
    assert outcomes.get(2, "timeout") == "timeout"  # queued behind the hanging one: cancelled before or while sent


# ---- token-id sessions over /v1/completions ----------------------------------------------------------------
class StubCompletions(StubChat):
    """/v1/completions: answers ``max_tokens`` chunks of text; the answer's ids are ``1000 + len(prompt) + i``,
    sent either all on the last chunk (as mmcache does) or one per chunk (as vLLM does) when asked for."""

    def __init__(self, per_chunk: bool):
        super().__init__()
        self.per_chunk = per_chunk

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = await _read_json(receive)
        self.bodies.append(body)
        prompt, n = body["prompt"], body["max_tokens"]
        ids = [1000 + len(prompt) + i for i in range(n)]
        want = body.get("return_token_ids", False)
        chunks = []
        for i in range(n):
            choice = {"index": 0, "text": f"t{i} ", "finish_reason": None}
            if want and self.per_chunk:
                choice["token_ids"] = [ids[i]]
            chunks.append({"choices": [choice]})
        if want and not self.per_chunk:
            chunks[-1]["choices"][0]["token_ids"] = ids
        chunks.append({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                                "total_tokens": len(prompt) + n,
                                                "prompt_tokens_details": {"cached_tokens": 0}}})
        common = {"id": "c", "object": "text_completion", "created": 0, "model": "m"}
        sse = b"".join(b"data: " + json.dumps({**common, **c}).encode() + b"\n\n" for c in chunks)
        await self._reply(send, 200, "text/event-stream", sse + b"data: [DONE]\n\n")


@pytest.mark.parametrize("per_chunk", [False, True])
def test_token_sessions_extend_the_prompt_with_the_answer_ids(per_chunk):
    app = StubCompletions(per_chunk)
    s = loadgen.TokenSession([[5, 6, 7], [8], [9, 9]], {"model": "m", "max_tokens": 9,
                                                        "extra_body": {"cache_salt": "s"}}, max_tokens=[2, 3, 1])
    records = run_stub(app, [s])
    assert [r.outcome for r in records] == ["ok"] * 3
    prompts = [b["prompt"] for b in app.bodies]
    assert prompts[0] == [5, 6, 7]
    assert prompts[1] == [5, 6, 7, 1003, 1004, 8]  # the first answer's ids, then turn 1's own
    assert prompts[2] == prompts[1] + [1006, 1007, 1008, 9, 9]
    assert [b["max_tokens"] for b in app.bodies] == [2, 3, 1]
    assert [b.get("return_token_ids", False) for b in app.bodies] == [True, True, False]  # the last needs none
    assert all(b["cache_salt"] == "s" and b["stream"] is True for b in app.bodies)
    first = records[0]
    assert first.token_ids == [1003, 1004] and first.text == "t0 t1 " and first.output_tokens == 2
    assert first.ttft is not None and first.tpot is not None


def test_a_token_session_without_answer_ids_is_refused():
    class NoIds(StubCompletions):
        async def __call__(self, scope, receive, send):
            async def strip():
                msg = await receive()
                if msg.get("body"):
                    body = json.loads(msg["body"])
                    body.pop("return_token_ids", None)
                    msg = dict(msg, body=json.dumps(body).encode(), more_body=False)
                return msg
            await super().__call__(scope, strip, send)

    s = loadgen.TokenSession([[5], [6]], {"model": "m", "max_tokens": 2})
    with pytest.raises(loadgen.MissingTokenIds, match="0 answer ids for 2 output tokens"):
        run_stub(NoIds(False), [s])


def test_given_offsets_replace_the_poisson_schedule():
    app = StubCompletions(False)
    sessions = [loadgen.TokenSession([[i + 1]], {"model": "m", "max_tokens": 1}) for i in range(3)]
    records = run_stub(app, sessions, time_limit_s=20.0, offsets=[0.0, 0.0, 0.3])
    sends = {r.session: r.send for r in records}
    assert sends[2] - min(sends.values()) >= 0.29
    with pytest.raises(ValueError, match="one finite"):
        run_stub(app, sessions, offsets=[0.0, 1.0])
