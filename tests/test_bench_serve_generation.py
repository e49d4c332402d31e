"""The generation streams of ``mmcache bench serve`` (``benchmarks.serve_generation``) on a tiny run: the JSON's
shape, encoder calls equal to the unique items (plus one for the negative prompt) with the store on and every
item per request with it off, the same outputs on both sides, nothing held after, table rows read from the
JSON, the options, and a failed request as a typed error. Speed is never asserted."""

import argparse
import json

import httpx
import pytest

from benchmarks import serve_generation as sg
from benchmarks.table import Row, render

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(quick=False, seed=0, threads=1, gen_streams=list(sg.STREAMS), image_requests=5, video_requests=4,
            voice_rounds=1, gen_steps=1, gen_runs=1, speech_frames=1, gen_zipf=3.0, voice_preset="tiny-csm")


@pytest.fixture(scope="module")
def result():
    """One tiny run, through JSON and back (what ``--json`` writes is what the rows read)."""
    return json.loads(json.dumps(sg.run(argparse.Namespace(**TINY))))


def test_the_json_has_every_figure_per_stream_and_side(result):
    assert set(result["streams"]) == {"image", "video", "voice"}
    assert result["held_after"] == {"on": 0, "off": 0}
    assert result["config"]["store_bytes_off"] == 1 and result["config"]["store_bytes_on"] > 1
    for stream, r in result["streams"].items():
        n = r["requests"]
        assert n == {"image": 5, "video": 4, "voice": 10}[stream]
        for side in ("on", "off"):
            s = r[side]
            assert len(s["latencies_s"]) == n and all(t > 0 for t in s["latencies_s"])
            assert 0 < s["latency_p50_s"] <= s["latency_p90_s"] <= max(s["latencies_s"])
            assert len(s["encoder_calls_runs"]) == 1
            assert set(s["store_all_runs"]) == set(sg.KINDS)
        assert r["latency_ratio_paired"] > 0
    voice = result["streams"]["voice"]
    for side in ("on", "off"):
        assert len(voice[side]["ttfa_s"]) == voice["requests"]
        assert all(t > 0 for t in voice[side]["ttfa_s"])  # the server's metric, one observation per request
        assert voice[side]["ttfa_p50_s"] <= voice[side]["ttfa_p90_s"]
    assert voice["ttfa_ratio_paired"] > 0


def test_store_on_encodes_each_unique_item_once_plus_the_negative(result):
    streams = result["streams"]
    assert streams["image"]["text_encoders"] == 3 and streams["video"]["text_encoders"] == 1  # SD3; Wan
    assert streams["image"]["unique_items"] < streams["image"]["requests"]  # a popular prompt recurs
    assert streams["voice"]["unique_items"] < streams["voice"]["requests"]  # clips shared by several requests
    for stream in ("image", "video"):
        r = streams[stream]
        assert r["on"]["encoder_calls"] == r["unique_items"] + 1 == r["expected_encoder_calls_on"]
        negative = r["on"]["store_all_runs"]["negative_prompt"]
        assert negative["queries"] - negative["hits"] == r["text_encoders"]  # the negative: once per encoder
    voice = streams["voice"]
    assert voice["on"]["encoder_calls"] == voice["unique_items"]
    assert all(r["encoder_calls_met"] for r in streams.values())


def test_store_off_encodes_every_item_of_every_request(result):
    for stream, r in result["streams"].items():
        per_request = 1 if stream == "voice" else 2  # the prompt and the negative prompt
        assert r["off"]["encoder_calls"] == per_request * r["requests"] == r["expected_encoder_calls_off"]
        assert r["off"]["encoder_calls"] > r["on"]["encoder_calls"]
        assert all(k["hits"] == 0 for k in r["off"]["store_all_runs"].values())


def test_both_sides_make_the_same_outputs(result):
    assert all(r["outputs_identical"] == 1.0 for r in result["streams"].values())


def test_table_rows_read_the_json(result):
    rows = sg.rows(result)
    assert all(isinstance(row, Row) for row in rows)
    by_metric = {row.metric: row for row in rows}
    image = result["streams"]["image"]
    p50 = by_metric["image latency p50"]
    assert (p50.value, p50.baseline, p50.paired) == (image["on"]["latency_p50_s"], image["off"]["latency_p50_s"],
                                                     image["latency_ratio_paired"])
    calls = by_metric["image encoder calls per run (5 requests)"]
    assert (calls.value, calls.baseline) == (image["on"]["encoder_calls"], image["off"]["encoder_calls"])
    assert calls.target.startswith("ok")
    ttfa = by_metric["voice time to first audio p50"]
    assert ttfa.paired == result["streams"]["voice"]["ttfa_ratio_paired"]
    assert "video latency p90" in by_metric and "voice encoder calls per run (10 requests)" in by_metric
    assert "store off" in render(rows)


def test_a_missed_call_count_shows_in_its_row(result):
    changed = json.loads(json.dumps(result))
    changed["streams"]["video"]["encoder_calls_met"] = False
    (row,) = [r for r in sg.rows(changed) if r.metric.startswith("video encoder calls")]
    assert row.target.startswith("MISSED")


def test_options_fill_quick_and_full_sizes_and_refuse_bad_streams():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    sg.add_arguments(p)
    quick = p.parse_args(["--quick", "--image-requests", "3"])
    sg._settle(quick)
    assert quick.image_requests == 3 and quick.video_requests == sg.QUICK["video_requests"]
    full = p.parse_args(["--gen-streams", "voice,image"])
    sg._settle(full)
    assert full.gen_streams == ["voice", "image"] and full.gen_runs == sg.FULL["gen_runs"]
    for bad in (["--gen-streams", "audio"], ["--gen-streams", "image,image"], ["--image-requests", "0"],
                ["--voice-preset", "bark"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_encoder_calls_count_misses_in_items():
    counts = {f"{k}_{what}": 0.0 for k in sg.KINDS for what in ("queries", "hits")}
    counts.update(text_encoder_queries=12, text_encoder_hits=3, negative_prompt_queries=12, negative_prompt_hits=9)
    assert sg.encoder_calls("image", counts, 3) == 4  # 9 + 3 misses over three encoders: 3 prompts + 1 negative
    counts.update(codec_queries=10, codec_hits=6)
    assert sg.encoder_calls("voice", counts, 1) == 4
    voice = sg.voice_requests(1, 0, 1)
    assert sg.unique_items("voice", voice) == len({r["ref_audio"] for r in voice}) < len(voice)


def test_a_failed_request_is_a_typed_error():
    from mmcache.presets import serve

    with serve(sg.server_config(["image"], sg.STORE_BYTES, 1, 1)) as srv, httpx.Client() as http:
        assert sg._post(http, srv.url, "image", {"prompt": "a red fox"}, 1, 0, "s")  # the PNG, base64
        with pytest.raises(sg.GenerationRequestFailed, match="HTTP 400"):
            sg._post(http, srv.url, "image", {"prompt": "a red fox"}, 99, 0, "s")  # steps above the limit
        assert sg.check_sound({"on": srv}) == {"on": 0}
