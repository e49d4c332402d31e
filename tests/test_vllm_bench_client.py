"""``benchmarks.peers.vllm_bench_client`` without vLLM: a stand-in interpreter plays ``vllm bench serve`` (it
checks the arguments it is given and writes a result in vLLM's format), so the command, the figures, the CLI
and every failure are checked here; the real client is run by hand against real servers."""

import json
import math
import sys

import pytest

from benchmarks.peers import vllm_bench_client as vbc
from benchmarks.peers.vllm_cpu import VllmUnavailable

RESULT = {"duration": 16.5, "completed": 31, "failed": 1, "request_throughput": 1.9, "output_throughput": 30.1,
          "total_token_throughput": 1100.0, "itls": [[0.1] * 15, [0.1] * 3, [], [0.1] * 15],
          "errors": ["", "", "timed out", ""],
          **{f"{stat}_{metric}_ms": float(i) for i, (stat, metric) in enumerate(
              (s, m) for s in ("mean", "median", "p99") for m in ("ttft", "tpot", "itl", "e2el"))}}

FAKE = """#!{python}
import json, os, sys, time
assert sys.argv[1] == "-c" and "vllm.benchmarks.serve" in sys.argv[2]
args = sys.argv[3:]
print("args", json.dumps(args))
mode = os.environ.get("FAKE_MODE", "ok")
if mode == "fail":
    print("boom: the server refused")
    sys.exit(3)
if mode == "slow":
    time.sleep(30)
if mode != "silent":
    out = os.path.join(args[args.index("--result-dir") + 1], args[args.index("--result-filename") + 1])
    with open(out, "w") as f:
        json.dump({result}, f)
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    path = tmp_path / "python"
    path.write_text(FAKE.format(python=sys.executable, result=json.dumps(RESULT)))
    path.chmod(0o755)
    monkeypatch.setenv("VLLM_PEER_PYTHON", str(path))
    return path


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "tokenizer.json").write_text("{}")
    return str(d)


def _args(log) -> list[str]:
    line = next(line for line in log.read_text().splitlines() if line.startswith("args "))
    return json.loads(line[len("args "):])


def test_run_passes_the_shape_and_returns_the_figures(fake, folder, tmp_path):
    shape = vbc.BenchShape(prefix_len=64, suffix_len=8, num_prefixes=2, output_len=4, num_prompts=6,
                           request_rate=3.0, seed=7)
    got = vbc.run("http://127.0.0.1:9/v1/", "m", folder, str(tmp_path / "out" / "r.json"), shape)
    assert got["completed"] == 31 and got["failed"] == 1 and got["request_throughput"] == 1.9
    assert got["ttft_median_ms"] == RESULT["median_ttft_ms"] and got["itl_p99_ms"] == RESULT["p99_itl_ms"]
    assert got["shape"]["prefix_len"] == 64 and got["result"].endswith("r.json")
    assert got["chunks_per_request_median"] == 16  # of the three that succeeded: 4, 16, 16
    args = _args(tmp_path / "out" / "r.log")
    pairs = dict(zip(args, args[1:]))
    assert pairs["--base-url"] == "http://127.0.0.1:9" and pairs["--endpoint"] == "/v1/completions"
    assert pairs["--backend"] == "openai" and pairs["--tokenizer"] == folder and pairs["--model"] == "m"
    assert (pairs["--prefix-repetition-prefix-len"], pairs["--prefix-repetition-suffix-len"],
            pairs["--prefix-repetition-num-prefixes"], pairs["--prefix-repetition-output-len"]) == ("64", "8", "2", "4")
    assert (pairs["--num-prompts"], pairs["--request-rate"], pairs["--seed"]) == ("6", "3.0", "7")
    assert "--ignore-eos" in args and "--save-result" in args and "--save-detailed" in args


def test_chat_uses_vllms_chat_backend(fake, folder, tmp_path):
    vbc.run("http://127.0.0.1:9", "m", folder, str(tmp_path / "r.json"),
            vbc.BenchShape(endpoint="/v1/chat/completions", ignore_eos=False))
    args = _args(tmp_path / "r.log")
    assert args[args.index("--backend") + 1] == "openai-chat" and "--ignore-eos" not in args


@pytest.mark.parametrize("mode, message", [("fail", "exited with 3"), ("silent", "wrote no result")])
def test_a_failed_run_raises_with_its_log(fake, folder, tmp_path, monkeypatch, mode, message):
    monkeypatch.setenv("FAKE_MODE", mode)
    with pytest.raises(vbc.BenchClientFailed, match=message) as info:
        vbc.run("http://127.0.0.1:9", "m", folder, str(tmp_path / "r.json"))
    assert "args" in str(info.value)  # the log's tail


def test_a_run_past_its_time_is_killed(fake, folder, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "slow")
    with pytest.raises(vbc.BenchClientFailed, match="ran past"):
        vbc.run("http://127.0.0.1:9", "m", folder, str(tmp_path / "r.json"), timeout_s=1.0)


@pytest.mark.parametrize("change", [{"num_prompts": 0}, {"output_len": -1}, {"prefix_len": 1.5},
                                    {"suffix_len": True}, {"request_rate": 0.0}, {"request_rate": math.nan},
                                    {"num_prompts": 3, "num_prefixes": 4}, {"endpoint": "/v1/embeddings"}])
def test_bad_shapes_are_refused_before_anything_runs(folder, tmp_path, monkeypatch, change):
    monkeypatch.delenv("VLLM_PEER_PYTHON", raising=False)  # refused before the interpreter is looked for
    with pytest.raises(vbc.BadBenchShape):
        vbc.run("http://127.0.0.1:9", "m", folder, str(tmp_path / "r.json"), vbc.BenchShape(**change))


def test_bad_targets_are_refused(fake, folder, tmp_path, monkeypatch):
    with pytest.raises(vbc.BadBenchShape, match="http"):
        vbc.run("127.0.0.1:9", "m", folder, str(tmp_path / "r.json"))
    with pytest.raises(vbc.BadBenchShape, match="tokenizer"):
        vbc.run("http://127.0.0.1:9", "m", str(tmp_path), str(tmp_path / "r.json"))
    monkeypatch.delenv("VLLM_PEER_PYTHON")
    with pytest.raises(VllmUnavailable):
        vbc.run("http://127.0.0.1:9", "m", folder, str(tmp_path / "r.json"))


def test_cli_writes_the_figures_or_says_why_not(fake, folder, tmp_path, monkeypatch, capsys):
    out = tmp_path / "figures.json"
    argv = ["--base-url", "http://127.0.0.1:9", "--model", "m", "--folder", folder, "--json", str(out),
            "--num-prompts", "8", "--no-ignore-eos"]
    assert vbc.main(argv) == 0
    got = json.loads(out.read_text())
    assert got["completed"] == 31 and got["shape"]["num_prompts"] == 8 and got["shape"]["ignore_eos"] is False
    assert (tmp_path / "figures.vllm.json").is_file()
    monkeypatch.setenv("FAKE_MODE", "fail")
    assert vbc.main(argv) == 2 and "exited with 3" in capsys.readouterr().err
    assert vbc.main([*argv[:-3], "--request-rate", "0"]) == 2
