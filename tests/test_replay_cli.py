"""``mmcache replay`` end to end: JSON keys, the sweep and its plot, refusing a malformed trace."""

import json

import pytest

from mmcache.cli import main
from test_replay_ceiling import random_trace, write_trace

KEYS = {"ceiling_share", "realized_share", "forfeit_share", "evictions", "stalls", "requests", "replicas",
        "spread"}


def records(n=30):
    # Mooncake's block is 512 tokens; shrink the lengths so the run stays tiny.
    return random_trace(21, n=n, block=512)


def test_single_run_writes_the_record_for_both_storing_settings(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", records())
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--pool-tokens", "16384", "--page-size", "64", "--replicas", "2",
                 "--routing", "random", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert KEYS <= set(result)
    assert result["store_at"] == "teardown" and set(result["by_store_at"]) == {"teardown", "prefill"}
    assert result["by_store_at"]["prefill"]["forfeit_share"] == 0
    assert result["requests"] == 30 and result["num_replicas"] == 2
    assert [r["replica"] for r in result["replicas"]] == [0, 1]
    assert sum(r["requests"] for r in result["replicas"]) == 30
    assert result["duplicate_media_rate"] is None
    assert "realized%" in capsys.readouterr().out


def test_sweep_writes_records_and_plot(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", records())
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    assert main(["replay", str(trace), "--format", "mooncake", "--page-size", "64", "--replicas", "2",
                 "--store-at", "teardown", "--sweep", "--sweep-pools", "8192,32768", "--json", str(out),
                 "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    sweep = result["sweep"]
    assert [(r["pool_tokens"], r["num_replicas"], r["routing"]) for r in sweep] == [
        (8192, 1, "single"), (8192, 2, "random"), (8192, 2, "affinity"),
        (32768, 1, "single"), (32768, 2, "random"), (32768, 2, "affinity")]
    assert all(KEYS <= set(r) and r["stalls"] == 0 for r in sweep)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sessions_format_from_a_parameter_file(tmp_path):
    params = tmp_path / "p.json"
    params.write_text(json.dumps({"sessions": 3, "concurrency": 2, "turns": {"kind": "constant", "mean": 3}}))
    out = tmp_path / "r.json"
    assert main(["replay", str(params), "--pool-tokens", "262144", "--store-at", "prefill", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["requests"] == 9 and result["workload"] == "sessions:p.json"
    assert result["realized_share"] == pytest.approx(result["ceiling_share"])


def test_malformed_trace_fails_before_anything_is_replayed(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    lines = [json.dumps(r) for r in records(5)]
    lines[3] = lines[3].replace('"hash_ids"', '"hashes"')
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--json", str(out)]) == 1
    assert "t.jsonl:4: missing key(s) hash_ids" in capsys.readouterr().err
    assert not out.exists()


def test_an_output_path_that_cannot_be_written_is_refused_before_the_replay(tmp_path, capsys, monkeypatch):
    from mmcache.replay import cli as replay_cli

    trace = write_trace(tmp_path / "t.jsonl", records(3))
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(replay_cli, "run_sweep", lambda *a, **k: pytest.fail("replayed"))
    assert main(["replay", str(trace), "--json", str(tmp_path / "a-file" / "r.json")]) == 2
    assert "mmcache replay: cannot write" in capsys.readouterr().err
    assert main(["replay", str(trace), "--sweep", "--plot", str(tmp_path / "a-file" / "p.png")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "t.jsonl"]


def test_a_plot_path_that_cannot_take_the_plot_is_refused_before_the_replay(tmp_path, capsys, monkeypatch):
    # Each of these ran the whole replay and sweep first: a .txt plot then raised matplotlib's ValueError, the
    # default plot beside --json hit a folder (IsADirectoryError), or the plot replaced the JSON just written.
    from mmcache.replay import cli as replay_cli

    trace = write_trace(tmp_path / "t.jsonl", records(3))
    monkeypatch.setattr(replay_cli, "run_sweep", lambda *a, **k: pytest.fail("replayed"))
    (tmp_path / "out.png").mkdir()
    for args, says in ((["--plot", str(tmp_path / "p.txt")], "must end in .png"),
                       (["--json", str(tmp_path / "out.json")], "cannot write"),  # out.png is a folder
                       (["--json", str(tmp_path / "r.png")], "would replace the JSON"),
                       (["--json", str(tmp_path / "r.png"), "--plot", str(tmp_path / "r.png")], "would replace")):
        assert main(["replay", str(trace), "--sweep", *args]) == 2
        assert says in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.png", "t.jsonl"]


@pytest.mark.parametrize("option", [["--plot", "p.png"], ["--sweep-pools", "1000"],
                                    ["--sweep-pools", "65536,131072,262144,524288"]])  # the default, given
def test_a_sweep_option_without_sweep_is_refused(tmp_path, capsys, option):
    trace = write_trace(tmp_path / "t.jsonl", records(3))
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), *option, "--json", str(out)]) == 2
    assert capsys.readouterr().err == f"mmcache replay: {option[0]} needs --sweep\n" and not out.exists()


def test_limit_replays_the_first_requests_and_is_refused_for_sessions(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", records(10))
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--limit", "4", "--store-at", "teardown", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["requests"] == 4
    assert main(["replay", "default", "--limit", "4"]) == 2


@pytest.mark.parametrize("option", [["--seed", "-1"], ["--prefill-tps", "0"], ["--route-load-factor", "0.5"],
                                    ["--pool-tokens", "64"],
                                    ["--pool-tokens", "100000000000000"],  # MemoryError traceback before
                                    ["--replicas", str(10**27)]])  # built replicas until memory ran out
def test_bad_option_values_fail_with_a_message(tmp_path, capsys, option):
    trace = write_trace(tmp_path / "t.jsonl", records(3))
    assert main(["replay", str(trace), *option]) == 1
    assert capsys.readouterr().err.startswith("mmcache replay: ")


def test_without_matplotlib_an_asked_for_plot_is_refused_first_and_a_default_one_left_out(tmp_path, capsys,
                                                                                          monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib now raises
    trace = write_trace(tmp_path / "t.jsonl", records(10))
    out = tmp_path / "s.json"
    args = ["replay", str(trace), "--page-size", "64", "--store-at", "teardown", "--sweep", "--sweep-pools",
            "8192", "--json", str(out)]
    assert main(args + ["--plot", str(tmp_path / "s.png")]) == 2
    assert "matplotlib" in capsys.readouterr().err and not out.exists()  # nothing was replayed
    assert main(args) == 0
    assert json.loads(out.read_text())["sweep"] and not (tmp_path / "s.png").exists()
    assert "no plot" in capsys.readouterr().err


@pytest.mark.parametrize("pools", [",", ""])
def test_a_sweep_of_no_pool_sizes_is_refused(tmp_path, pools):  # it ran nothing and wrote an empty plot
    trace = write_trace(tmp_path / "t.jsonl", records(3))
    with pytest.raises(SystemExit) as exit_:
        main(["replay", str(trace), "--sweep", "--sweep-pools", pools])
    assert exit_.value.code == 2


def test_the_route_fallback_option_reaches_the_record(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", records(10))
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--page-size", "64", "--replicas", "2", "--store-at", "teardown",
                 "--route-fallback", "least_loaded", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["router"]["fallback"] == "least_loaded"
    assert main(["replay", str(trace), "--page-size", "64", "--replicas", "2", "--store-at", "teardown",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["router"]["fallback"] == "deeper"  # the router's default
