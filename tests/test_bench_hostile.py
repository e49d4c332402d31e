"""``benchmarks.hostile`` against this checkout, quick: the JSON's shape, the bounded answers of the cases whose
fixes are in (a long prompt, half headers, nested JSON), and that the bench connects to the loopback address only.
Each case starts a server process of its own; nothing here asserts a time."""

from __future__ import annotations

import io
import json
import socket

import pytest
from PIL import Image

from benchmarks import hostile

CASES = ("long_prompt", "half_headers", "nested_json")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """(exit code, the JSON written, every address the bench connected to) of one quick run of ``CASES``."""
    out = tmp_path_factory.mktemp("hostile") / "hostile.json"
    connected = []
    real_connect = socket.socket.connect

    def connect(sock, address):
        connected.append(address)
        return real_connect(sock, address)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", connect)
        code = hostile.main(["--quick", "--cases", ",".join(CASES), "--json", str(out)])
    return code, json.loads(out.read_text()), connected


def test_the_json_names_the_tree_the_machine_and_each_cases_costs(quick_run):
    code, result, _ = quick_run
    assert code == 0
    assert result["tree"] == str(hostile.REPO) and result["commit"] != "unknown" and result["quick"] is True
    assert set(result["machine"]) == {"cpu", "cores"} and result["machine"]["cores"] >= 1
    assert set(result["cases"]) == set(CASES)
    for record in result["cases"].values():
        assert {"status", "stall_ms", "cpu_s", "peak_mb", "fds", "probes", "probes_failed"} <= set(record)
        assert record["probes"] >= 1 and record["probes_failed"] == 0  # /health answered throughout
        assert record["cpu_s"] >= 0 and record["fds"] > 0 and record["peak_reset"] is True


def test_the_fixed_cases_get_their_bounded_answers(quick_run):
    cases = quick_run[1]["cases"]
    assert cases["long_prompt"]["status"].startswith("400 ")
    assert cases["nested_json"]["status"] == "400 invalid_json"
    half = cases["half_headers"]
    assert half["status"] == "health 200" and half["refused"] == 0
    assert half["fds_while_held"] >= half["connections"]  # the server held every half connection while it waited


def test_the_bench_connects_to_loopback_only(quick_run):
    connected = quick_run[2]
    assert len(connected) > hostile.QUICK.half_connections
    assert {host for host, _port in connected} == {"127.0.0.1"}
    assert all(r["url"].startswith("http://127.0.0.1:") for r in quick_run[1]["cases"].values())


def test_a_bomb_is_small_on_the_wire_and_large_decoded():
    png = hostile.bomb_png(2000, mark=1)
    assert len(png) < 4096
    assert Image.open(io.BytesIO(png)).size == (2000, 2000)
    assert png != hostile.bomb_png(2000, mark=2)  # distinct images: no cache answers one for another


@pytest.mark.parametrize("argv", [["--cases", "long_prompt,no_such_case"], ["--tree", "/"], ["--cap", "0"]])
def test_bad_options_are_refused_before_any_server_starts(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        hostile.main(argv)
    assert exit_.value.code == 2
    assert "hostile" in capsys.readouterr().err
