"""The prefix benchmark's harness on the tiny preset: mmcache and transformers runners, the bit-exact check,
a whole ``mmcache bench prefix`` run, and the vLLM peer's failure paths."""

import inspect
import json
import sys
from collections import Counter

import pytest

from benchmarks import prefix, prefix_exact, prefix_figures, prefix_table, prefix_turns
from benchmarks import runner as bench_runner
from benchmarks import text_workloads as tw
from benchmarks.peers import protocol, vllm_cpu
from mmcache.cli import main as cli
from mmcache.engine import EngineConfig

PAGE = 16
SHAPE = prefix.Shape(probe_repeats=1, probe_len=4 * PAGE, probe_shared=3 * PAGE, vpc_prefix_len=2 * PAGE,
                     vpc_input_range=(2 * PAGE + 4, 3 * PAGE), vpc_num_prompts=2, vpc_repeat_count=2,
                     vpc_output_len=3, gsp_num_groups=2, gsp_prompts_per_group=2, gsp_system_prompt_len=2 * PAGE,
                     gsp_question_len=5, gsp_output_len=3, mt_conversations=2, mt_max_user_turns=2,
                     mt_max_answer_tokens=4)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("prefix")


@pytest.fixture(scope="module")
def tiny_dir(workdir):
    """The tiny preset exported where a whole run with ``--workdir`` looks for it first."""
    out = workdir / "model-tiny-float32"
    assert cli(["export-model", "tiny", str(out), "--dtype", "float32"]) == 0
    return str(out)


def probe_rows(rounds):
    return {key: rnd.records[0] for key, rnd in zip(prefix_figures.PROBE_KEYS, rounds)}


def play_probes(run_round, space, method=prefix_figures.ProbeMethod()):
    """The warm-up, then every probe repeat, as the benchmark plays them for one engine."""
    protocol.play(prefix_turns.warmup_workload(space, 0, SHAPE.probe_len), run_round)
    return [protocol.play(w, run_round) for w in prefix_turns.probe_workloads(space, SHAPE, 0, method)]


@pytest.mark.parametrize("mode", ["on", "off"])
def test_mmcache_probe_matches_exactly(tiny_dir, mode):
    space = prefix.token_space(tiny_dir)
    runner = prefix_turns.MmcacheRunner(tiny_dir, "float32", mode, PAGE, 64, store_at="teardown")
    probes = play_probes(runner.run_round, space)
    rows = probe_rows(probes[0])
    figures = prefix_figures.summarize_probe(probes)["repeats"][0]
    assert all(figures[k] == rnd.wall_s >= rows[k].ttft_s for k, rnd in zip(prefix_figures.PROBE_KEYS, probes[0]))
    hit = 3 * PAGE if mode == "on" else 0  # the repeat keeps its last page to compute the first token's logits
    assert [rows[k].matched_tokens for k in prefix_figures.PROBE_KEYS] == [0, hit, hit, 0]
    assert all(len(r.output_ids) == 1 and r.first_token >= r.arrival for r in rows.values())
    runner.close()


def test_multi_turn_prompts_extend_the_models_answers(tiny_dir):
    """Turn 2 hits every full page of turn 1's prompt and answer, which only holds if the harness built turn 2
    from the engine's own output ids."""
    shape = tw.MultiTurnShape(2, tw.Distribution("constant", value=4), tw.Distribution("constant", value=20),
                              tw.Distribution("uniform", low=10, high=30), tw.Distribution("uniform", low=8, high=12),
                              tw.Distribution("uniform", low=20, high=24))
    space = prefix.token_space(tiny_dir)
    w = tw.multi_turn(shape, space, seed=5)
    runner = prefix_turns.MmcacheRunner(tiny_dir, "float32", "on", PAGE, 64, store_at="teardown")
    rounds = protocol.play(w, runner.run_round)
    for first, second, asked in zip(rounds[0].records, rounds[1].records, w.rounds[1]):
        written = first.prompt_len + len(first.output_ids) - 1  # the last sampled token is never written
        assert second.prompt_len == first.prompt_len + len(first.output_ids) + len(asked.tokens)
        assert second.matched_tokens == min(written // PAGE, (second.prompt_len - 1) // PAGE) * PAGE
    assert all(r.matched_tokens == 0 for r in rounds[0].records[:1])
    runner.close()


def test_transformers_cb_reuses_blocks_across_rounds(tiny_dir):
    from benchmarks.peers.transformers_cb import TransformersCB

    space = prefix.token_space(tiny_dir)
    peer = TransformersCB(tiny_dir, "float32", page_size=PAGE, num_blocks=64, max_batch_tokens=256)
    try:
        probes = play_probes(peer.run_round, space, prefix_figures.ProbeMethod(2))
    finally:
        peer.close()
    rows = probe_rows(probes[0])
    assert [rows[k].matched_tokens for k in prefix_figures.PROBE_KEYS] == [0, 3 * PAGE, 3 * PAGE, 0]
    for r in rows.values():
        assert len(r.output_ids) == 2 and r.arrival <= r.token_times[0] <= r.token_times[1]
    # Its probe figure is the round's wall time, as mmcache's and vLLM's, less its second token's step; that
    # span holds the engine's own first-token stamp minus arrival, and more (handing the request over).
    figures = prefix_figures.summarize_probe(probes, prefix_figures.ProbeMethod(2))["repeats"][0]
    for key, rnd in zip(prefix_figures.PROBE_KEYS, probes[0]):
        step = rows[key].token_times[1] - rows[key].token_times[0]
        assert figures[key] == pytest.approx(rnd.wall_s - step) and figures[key] >= rows[key].ttft_s


def test_bit_exact_check_hits_and_agrees(tiny_dir):
    result = prefix_exact.bit_exact_check(tiny_dir, "float32", PAGE, prefix.token_space(tiny_dir), 0, "prefill")
    assert result["bit_exact"] is True
    assert result["matched_tokens_on"][0] == 0 and min(result["matched_tokens_on"][1:]) > 0


def test_whole_run_writes_every_figure(tiny_dir, workdir, tmp_path, capsys):
    out = tmp_path / "prefix.json"
    sizes = []
    shape = prefix.Shape(**{**SHAPE.__dict__, "workload_repeats": 2})
    for name in prefix.Shape.__dataclass_fields__:
        v = getattr(shape, name)
        sizes += ["--" + name.replace("_", "-"), f"{v[0]}:{v[1]}" if isinstance(v, tuple) else str(v)]
    rc = cli(["bench", "prefix", "--preset", "tiny", "--dtype", "float32", "--page-size", str(PAGE), "--json", str(out),
              "--engines", "mmcache,mmcache_nocache,transformers_cb",
              "--workloads", "vllm_prefix_caching,generated_shared_prefix", "--workdir", str(workdir)] + sizes)
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["bit_exact"] is True
    assert set(result["engines"]) == {"mmcache", "mmcache_nocache", "transformers_cb"}
    defaults = EngineConfig()  # every engine schedules under mmcache's step budget, and the JSON says which
    budget = {"max_tokens_per_step": defaults.max_tokens_per_step, "max_num_seqs": defaults.max_num_seqs}
    assert result["step_budget"] == budget
    assert (result["turn_settle_s"], result["turn_order"]) == (prefix_turns.TURN_SETTLE_S, "williams")
    for name in ("mmcache", "mmcache_nocache"):
        settings = result["engines"][name]["meta"]["settings"]
        assert {k: settings[k] for k in budget} == budget
    cb = result["engines"]["transformers_cb"]["meta"]["settings"]
    assert (cb["max_batch_tokens"], cb["max_requests_per_batch"]) == tuple(budget.values())
    for name, e in result["engines"].items():
        assert set(prefix_figures.PROBE_KEYS) <= set(e["probe"]) and len(e["probe"]["repeats"]) == 1
        for w in ("vllm_prefix_caching", "generated_shared_prefix"):
            assert {"ttft_p50_s", "ttft_p90_s", "itl_p50_s", "throughput_tok_s", "matched_share"} <= set(e[w])
            assert e[w]["requests"] == 8 and [r["requests"] for r in e[w]["by_repeat"]] == [4, 4]
    assert result["engines"]["mmcache"]["probe"]["repeats"][0]["same_matched"] == 3 * PAGE
    for name in ("mmcache", "mmcache_nocache"):  # the compute path each ran on is on record
        meta = result["engines"][name]["meta"]
        assert meta["backend"].startswith("mmcache_paged_sdpa") and meta["packing_skipped"] is None
    assert result["engines"]["mmcache_nocache"]["vllm_prefix_caching"]["matched_share"] == 0
    paired = result["workloads_paired"]
    assert set(paired) == {"over_mmcache_nocache", "over_transformers_cb"}
    assert len(paired["over_mmcache_nocache"]["generated_shared_prefix"]["ttft_p50"]["runs"]) == 2
    table = capsys.readouterr().out
    assert "probe: same 2048 prompt, TTFT" in table and "transformers CB" in table
    assert any("generated_shared_prefix: TTFT p50 (paired: mean of 2)" in line for line in table.splitlines())


@pytest.mark.parametrize("bad, says", [(["--probe-repeats", "0"], "probe_repeats"),
                                       (["--vpc-input-range", "3"], "MIN:MAX"),
                                       (["--probe-shared", "4096"], "shared_len"),
                                       (["--gsp-question-len", "0"], "positive"),
                                       (["--engines", ","], "names no engine"),
                                       (["--peers", "--engines", "mmcache,mmcache_nocache"],
                                        "leaves out (transformers_cb, vllm_cpu)"),
                                       (["--peers", "--engines", "mmcache,vllm_cpu"],
                                        "--peers adds transformers_cb and vllm_cpu in quick mode"),
                                       (["--vllm-eager"], "--vllm-eager sets how vLLM starts"),
                                       (["--vllm-eager", "--engines", "mmcache,transformers_cb"], "no vllm_cpu"),
                                       (["--probe-len", str(10**30)], "probe_len"),
                                       (["--probe-repeats", str(10**30)], "probe_repeats"),
                                       (["--gsp-num-groups", "1000", "--gsp-prompts-per-group", "1000"],
                                        "prompt tokens"),
                                       (["--preset", "tiny"],
                                        "probe_len 2048 is above its maximum 1024 (the model's context)"),
                                       (["--preset", "tiny", "--probe-len", "512", "--probe-shared", "256",
                                         "--page-size", "512"], "bit-exact check needs 1609")])
def test_bad_shapes_fail_before_anything_runs(bad, says, tmp_path, capsys):
    """A shape the workloads cannot take is refused with its typed error's message and exit code 2, before a
    model is exported into the work folder."""
    rc = cli(["bench", "prefix", "--quick", "--workdir", str(tmp_path)] + bad)
    err = capsys.readouterr().err
    assert rc == 2 and "WorkloadShapeError" in err and says in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing exported


def test_peers_and_vllm_eager_agree_with_the_engines_named():
    """--peers adds vllm_cpu (and, in quick mode, transformers_cb): an --engines list with them is accepted (the
    runs in RESULTS.md), one without them refused; --vllm-eager needs vllm_cpu among the engines."""
    parse = bench_runner.bench_parser("prefix", prefix).parse_args
    assert prefix.engines_from_args(parse(["--peers", "--engines", "mmcache,vllm_cpu"])) == ["mmcache", "vllm_cpu"]
    assert prefix.engines_from_args(parse(["--peers", "--vllm-eager", "--quick"]))[-1] == "vllm_cpu"
    assert prefix.engines_from_args(parse(["--vllm-eager", "--engines", "vllm_cpu"])) == ["vllm_cpu"]
    for argv in (["--peers", "--engines", "mmcache,transformers_cb"], ["--vllm-eager", "--quick"],
                 ["--quick", "--peers", "--engines", "vllm_cpu"], ["--vllm-eager"]):
        with pytest.raises(tw.WorkloadShapeError):
            prefix.engines_from_args(parse(argv))


def test_a_workdir_that_cannot_be_a_folder_is_refused_by_the_parser(tmp_path, capsys):
    """--workdir on a file (or below one) is refused by the parser, before the shape checks and the export."""
    (tmp_path / "a-file").write_text("")
    for workdir in (tmp_path / "a-file", tmp_path / "a-file" / "below"):
        with pytest.raises(SystemExit) as exc:
            bench_runner.bench_parser("prefix", prefix).parse_args(["--workdir", str(workdir)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"argument --workdir: {tmp_path / 'a-file'} is not a folder" in err
    made = tmp_path / "new" / "deeper"  # a folder still to be made is taken, and not made by the parser
    assert bench_runner.bench_parser("prefix", prefix).parse_args(["--workdir", str(made)]).workdir == str(made)
    assert not (tmp_path / "new").exists()


def test_an_export_that_fails_is_a_typed_error(monkeypatch, tmp_path):
    import mmcache.cli
    from mmcache.errors import MmcacheError

    monkeypatch.setattr(mmcache.cli, "main", lambda argv: 1)
    with pytest.raises(MmcacheError, match="export-model tiny .* failed with exit code 1"):
        prefix.export_model("tiny", "float32", str(tmp_path / "model"))


def test_conversations_longer_than_the_context_are_refused():
    """Multi-turn conversations are measured on the real token space (their later lengths are drawn after
    tokens), after the export and before any engine loads."""
    space = tw.TokenSpace(2, 100)
    workloads = prefix.build_workloads(prefix.QUICK, space, 0, ["multi_turn"])
    longest = prefix_turns.session_len(workloads[0])
    prefix.check_context(workloads, prefix.QUICK, 16, longest)
    prefix.check_context(workloads, prefix.QUICK, 16, longest - 1, sessions=False)
    with pytest.raises(tw.WorkloadShapeError, match=f"multi_turn needs {longest}"):
        prefix.check_context(workloads, prefix.QUICK, 16, longest - 1)


def test_vllm_peer_failures_are_typed(tmp_path, monkeypatch):
    monkeypatch.delenv(vllm_cpu.ENV_VAR, raising=False)
    with pytest.raises(vllm_cpu.VllmUnavailable, match="VLLM_PEER_PYTHON"):
        vllm_cpu.interpreter()
    args = bench_runner.bench_parser("prefix", prefix).parse_args(["--peers", "--quick"])
    with pytest.raises(vllm_cpu.VllmUnavailable):
        prefix.run(args)  # refused before anything is exported or measured
    # An interpreter without vLLM: the runner starts, fails to import vllm, and the log tail comes back.
    monkeypatch.setenv(vllm_cpu.ENV_VAR, sys.executable)
    w = tw.probe(tw.TokenSpace(2, 100), 0, 32, 16)
    with pytest.raises(vllm_cpu.VllmUnavailable, match="vllm"):
        vllm_cpu.run(str(tmp_path), w, [w], str(tmp_path), timeout_s=120)


def test_engines_take_turns_in_the_rows_of_the_balanced_order(tmp_path, monkeypatch):
    """Each probe repeat, then each repeat of each workload, is played by every engine in turn, after the
    driver has idled, in the next row of ``turn_order`` each time."""
    space = tw.TokenSpace(2, 100)
    shape = prefix.Shape(**{**SHAPE.__dict__, "probe_repeats": 3, "workload_repeats": 2})
    repeats = prefix.workload_repeats(shape, space, 0, ["vllm_prefix_caching", "generated_shared_prefix"])
    log = []
    monkeypatch.setattr(prefix_turns, "_settle", lambda s: log.append(("driver", "idle", s)))

    def fake(name, method=prefix_figures.ProbeMethod()):
        def run_round(ids, prompts, max_tokens):
            return [protocol.Record(i, len(p), [7] * n, 0.0, 0.5, [0.5 + k for k in range(n)], 0)
                    for i, p, n in zip(ids, prompts, max_tokens)]

        def play(w):
            log.append((name, w.name, w.rounds[0][0].id))
            return protocol.play(w, run_round)

        return prefix_turns.Player(name, play, lambda: log.append((name, "closed", "")), {"who": name}, method)

    players = [fake("a"), fake("b", prefix_figures.ProbeMethod(2)), fake("c")]
    out = prefix_turns.play_interleaved(players, space, shape, repeats, 0)
    # Every measured turn starts after the default idle (no engine's spinning threads in the next one's time).
    turns = [e for e in log if not e[1].startswith("warmup")]
    assert turns[0::2] == [("driver", "idle", prefix_turns.TURN_SETTLE_S)] * (len(turns) // 2) and len(turns) == 2 * 21
    assert all(n != "driver" for n, _, _ in turns[1::2])
    played = [(n, w, i) for n, w, i in log if not w.startswith(("warmup", "idle"))]
    probe_order = [n for n, w, _ in played if w.startswith("probe")]
    assert probe_order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    work = [(n, w) for n, w, _ in played if not w.startswith("probe")]
    vpc, gsp = "vllm_prefix_caching", "generated_shared_prefix"
    assert work == [("a", vpc), ("b", vpc), ("c", vpc), ("b", gsp), ("c", gsp), ("a", gsp),
                    ("c", vpc), ("a", vpc), ("b", vpc), ("c", gsp), ("b", gsp), ("a", gsp)]
    first_ids = [i for _, w, i in played if w == vpc]
    assert len(set(first_ids[:3])) == 1 and len(set(first_ids[3:])) == 1 and first_ids[0] != first_ids[3]
    assert sum(w.startswith("warmup") for _, w, _ in log) == 3 and "closed" not in {w for _, w, _ in log}
    assert set(out) == {"a", "b", "c"} and out["b"].meta == {"who": "b"}
    assert len(out["a"].probe["repeats"]) == 3 and set(out["a"].workloads) == {vpc, gsp}
    pooled = out["a"].workloads[vpc]
    assert len(pooled["by_repeat"]) == 2
    assert pooled["requests"] == sum(r["requests"] for r in pooled["by_repeat"]) == 2 * repeats[0][0].num_requests
    assert len(out["a"].outputs) == 3 * 4 + 2 * sum(w.num_requests for w in repeats[0])  # no id played twice
    assert out["b"].probe["figure"].startswith("wall time of a round of one 2-token")  # b's own method
    assert out["a"].probe["figure"].startswith("wall time of a round of one 1-token")
    assert out["a"].probe["figure"].endswith("median of 3")


@pytest.mark.parametrize("n", range(1, 8))
def test_turn_order_puts_every_engine_after_every_other_and_in_every_place_equally_often(n):
    names = [f"e{i}" for i in range(n)]
    period = n if n % 2 == 0 else 2 * n
    rows = [prefix_turns.turn_order(names, k) for k in range(3 * period)]
    assert all(sorted(r) == names for r in rows)  # every engine once per play
    assert rows[period:2 * period] == rows[:period]  # the design repeats
    rows = rows[:period]
    places = Counter((r[i], i) for r in rows for i in range(n))
    assert len(places) == n * n and len(set(places.values())) == 1
    if n > 1:  # each ordered pair (a right before b, a != b) equally often: no engine has a fixed predecessor
        after = Counter((r[i], r[i + 1]) for r in rows for i in range(n - 1))
        assert len(after) == n * (n - 1) and len(set(after.values())) == 1
    if n == 2:
        assert rows == [names, names[::-1]]
    assert prefix_turns.turn_order([], n) == []


def test_workload_repeats_draw_fresh_tokens_and_the_first_is_the_single_play():
    space = tw.TokenSpace(2, 100)
    names = list(prefix_figures.WORKLOADS)
    one = prefix.build_workloads(SHAPE, space, 0, names)
    reps = prefix.workload_repeats(prefix.Shape(**{**SHAPE.__dict__, "workload_repeats": 3}), space, 0, names)
    assert [len(ws) for ws in reps] == [3, 3, 3] and reps[0] == one
    for a, b in ((reps[0], reps[1]), (reps[1], reps[2])):
        for wa, wb in zip(a, b):
            assert wa.name == wb.name  # same shape; multi-turn draws its lengths anew from its distributions
            assert wa.params == wb.params or wa.name == "multi_turn"
            ta = {r.tokens[:8] for rnd in wa.rounds for r in rnd}
            assert not ta & {r.tokens[:8] for rnd in wb.rounds for r in rnd}  # nothing for one repeat to hit
    for field in ("workload_repeats", "probe_repeats"):
        with pytest.raises(tw.WorkloadShapeError, match=field):
            prefix.Shape(**{**SHAPE.__dict__, field: 0})
    assert prefix.FULL.workload_repeats >= 3


FAKE_VLLM = {
    "__init__.py": """
import sys
from types import SimpleNamespace
__version__ = "0.0-fake"

class SamplingParams:
    def __init__(self, max_tokens, **kw):
        self.max_tokens = max_tokens

class _Engine:
    def __init__(self):
        self.live = {}
    def add_request(self, key, prompt, params):
        self.live[key] = (prompt["prompt_token_ids"], params.max_tokens, [])
    def has_unfinished_requests(self):
        return bool(self.live)
    def step(self):
        print("fake vLLM log line on stdout", flush=True)  # the reader must skip it
        outs = []
        for key, (prompt, n, toks) in list(self.live.items()):
            toks.append(len(prompt) % 97)
            done = len(toks) >= n
            outs.append(SimpleNamespace(request_id=key, outputs=[SimpleNamespace(token_ids=list(toks))],
                                        num_cached_tokens=len(prompt) // 2, finished=done))
            if done:
                del self.live[key]
        return outs

class LLM:
    def __init__(self, **kw):
        import json, os
        if os.environ.get("FAKE_VLLM_KW"):  # what the runner started vLLM with, for the test to read
            with open(os.environ["FAKE_VLLM_KW"], "w") as f:
                json.dump(kw, f)
        self.llm_engine = _Engine()
""",
    "inputs.py": "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n",
    "sampling_params.py": "class RequestOutputKind:\n    CUMULATIVE = 1\n",
}


def test_vllm_server_plays_workloads_on_request_and_skips_vllms_own_output(tmp_path, monkeypatch):
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    for name, text in FAKE_VLLM.items():
        (pkg / name).write_text(text)
    monkeypatch.setenv(vllm_cpu.ENV_VAR, sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    space = tw.TokenSpace(2, 100)
    w1, w2 = tw.probe(space, 0, 32, 16), tw.probe(space, 1, 40, 16, max_tokens=3)
    with vllm_cpu.VllmServer(str(tmp_path), w1, str(tmp_path), eager=True) as server:
        assert server.version == "0.0-fake" and server.settings["eager"] is True
        for w in (w2, w1):
            rounds = server.play(w)
            assert [[r.id for r in rnd.records] for rnd in rounds] == [[r.id for r in rnd] for rnd in w.rounds]
            for rnd, want in zip(rounds, w.rounds):
                rec, req = rnd.records[0], want[0]
                assert len(rec.output_ids) == req.max_tokens and rec.matched_tokens == len(req.tokens) // 2
        assert server.proc.poll() is None  # waiting for the next workload
    assert server.proc.returncode == 0
    # A runner that cannot start: the log tail comes back in the error.
    monkeypatch.setenv("PYTHONPATH", "")
    with pytest.raises(vllm_cpu.VllmUnavailable, match="vllm"):
        vllm_cpu.VllmServer(str(tmp_path), w1, str(tmp_path))


def test_vllm_runs_under_mmcaches_step_budget(tmp_path, monkeypatch):
    """vLLM gets the token budget and sequence cap mmcache runs with (not its own default budget, the context
    length): from the benchmark's player through the server and the runner's command line to ``LLM``."""
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    for name, text in FAKE_VLLM.items():
        (pkg / name).write_text(text)
    kw_file = tmp_path / "llm_kwargs.json"
    monkeypatch.setenv(vllm_cpu.ENV_VAR, sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("FAKE_VLLM_KW", str(kw_file))
    defaults = EngineConfig()
    budget = prefix_turns.StepBudget.of_mmcache()
    assert (budget.max_tokens_per_step, budget.max_num_seqs) == (defaults.max_tokens_per_step, defaults.max_num_seqs)
    args = bench_runner.bench_parser("prefix", prefix).parse_args(["--dtype", "float32", "--page-size", str(PAGE)])
    space = tw.TokenSpace(2, 100)
    workloads = prefix.build_workloads(SHAPE, space, 0, ["multi_turn"])
    player = prefix_turns.vllm_player(str(tmp_path), space, SHAPE, workloads, 0, args, str(tmp_path), budget)
    player.close()
    kw = json.loads(kw_file.read_text())
    assert (kw["max_num_batched_tokens"], kw["max_num_seqs"]) == (defaults.max_tokens_per_step, defaults.max_num_seqs)
    assert kw["max_model_len"] > kw["max_num_batched_tokens"]  # vLLM V1 chunks the longer prefills
    assert player.meta["settings"]["max_num_batched_tokens"] == defaults.max_tokens_per_step
    for params in (inspect.signature(vllm_cpu.VllmServer).parameters, inspect.signature(vllm_cpu.run).parameters):
        assert params["max_num_batched_tokens"].default == defaults.max_tokens_per_step
        assert params["max_num_seqs"].default == defaults.max_num_seqs


def test_probe_ratios_are_taken_repeat_by_repeat():
    """A slow minute that hits both engines in one repeat must not decide the comparison: the paired median
    uses each repeat's own ratio, where the ratio of medians would mix repeats."""
    def engine(colds, sames):
        reps = [{"cold_s": c, "same_s": s} for c, s in zip(colds, sames)]
        return {"probe": {"cold_s": sorted(colds)[1], "same_s": sorted(sames)[1], "shared1920_s": 0.1,
                          "cold2_s": 1.0, "repeats": reps}}

    engines = {"mmcache": engine([2.0, 4.0, 2.2], [0.2, 0.4, 0.2]),
               "vllm_cpu": engine([1.0, 2.0, 4.4], [0.1, 0.2, 0.4])}
    pp = prefix_figures.paired_probe(engines)
    assert pp["mmcache"]["same_vs_cold"]["runs"] == pytest.approx([10.0, 10.0, 11.0])
    assert pp["vllm_cpu"]["same_vs_cold"]["p50"] == pytest.approx(10.0)
    over = pp["mmcache"]["over_vllm_cpu"]
    assert over["cold"]["runs"] == pytest.approx([2.0, 2.0, 0.5]) and over["cold"]["p50"] == pytest.approx(2.0)
    assert over["hit"]["p50"] == pytest.approx(2.0) and over["hit"]["min"] == pytest.approx(0.5)
    rows = {(r.metric, r.versus): r for r in prefix_table.table_rows({"bit_exact": True, "engines": engines})}
    cold = rows[("probe: cold TTFT", "vLLM CPU")]
    assert cold.ratio == pytest.approx(0.5)  # paired: vLLM twice as fast in two repeats of three
    assert cold.baseline / cold.value == pytest.approx(2.0 / 2.2)  # the medians alone would say 0.91
    assert rows[("probe: same 2048 prompt, TTFT", "cold")].ratio == pytest.approx(10.0)
    from benchmarks.table import render
    assert "0.50x paired" in render(list(rows.values()))
    # The probe's targets are the issue's, stated for the Qwen2.5-0.5B shape in bfloat16: another preset or
    # dtype (the quick run's small model) shows them as that shape's, not as this run's to meet.
    def targets(**shape):
        return {r.versus + " " + r.metric: r.target for r in prefix_table.table_rows(
            {"bit_exact": True, "engines": engines, **shape}) if r.target and r.metric.startswith("probe")}

    assert targets(preset="qwen2.5-0.5b", dtype="bfloat16") == {
        "cold probe: same 2048 prompt, TTFT": ">= 12x", "vLLM CPU probe: cold TTFT": ">= 0.77x",
        "vLLM CPU probe: hit TTFT": ">= 0.77x"}
    for shape in ({"preset": "small", "dtype": "bfloat16"}, {"preset": "qwen2.5-0.5b", "dtype": "float32"}):
        assert set(targets(**shape).values()) == {">= 12x (on qwen2.5-0.5b bfloat16)",
                                                  ">= 0.77x (on qwen2.5-0.5b bfloat16)"}


def test_workload_rows_compare_the_decode_step_with_cache_off_and_vllm():
    def workload(ttft, itl):
        return {"ttft_p50_s": ttft, "ttft_p90_s": ttft, "itl_p50_s": itl, "throughput_tok_s": 10.0,
                "matched_share": 0.5}

    probe = {"probe": {"cold_s": 2.0, "same_s": 0.2, "shared1920_s": 0.2, "cold2_s": 2.0,
                       "repeats": [{"cold_s": 2.0, "same_s": 0.2}]}}
    engines = {"mmcache": {**probe, "multi_turn": workload(1.0, 0.08)},
               "mmcache_nocache": {**probe, "multi_turn": workload(4.0, 0.10)},
               "vllm_cpu": {**probe, "multi_turn": workload(1.1, 0.12)},
               "transformers_cb": {**probe, "multi_turn": workload(3.0, None)}}  # no ITL recorded: no row
    rows = {(r.metric, r.versus): r for r in prefix_table.table_rows({"bit_exact": True, "engines": engines})}
    assert rows[("multi_turn: ITL p50", "vLLM CPU")].ratio == pytest.approx(1.5)  # 0.12 / 0.08: mmcache faster
    assert rows[("multi_turn: ITL p50", "cache off")].ratio == pytest.approx(1.25)
    assert not any(m == "multi_turn: ITL p50" and v == "transformers CB" for m, v in rows)
    assert all(r.paired is None for r in rows.values() if r.metric.startswith("multi_turn"))  # one play each


def test_workload_ratios_are_taken_repeat_by_repeat():
    """As for the probe: each workload repeat's ratio, then the median, so that one engine's slow minute in one
    repeat does not decide the comparison."""
    def workload(ttfts, itls, tputs):
        reps = [{"ttft_p50_s": t, "itl_p50_s": i, "throughput_tok_s": x} for t, i, x in zip(ttfts, itls, tputs)]
        return {"ttft_p50_s": sorted(ttfts)[1], "ttft_p90_s": 1.0, "itl_p50_s": sorted(itls)[1],
                "throughput_tok_s": sorted(tputs)[1], "matched_share": 0.5, "by_repeat": reps}

    probe = {"probe": {"cold_s": 2.0, "same_s": 0.2, "shared1920_s": 0.2, "cold2_s": 2.0,
                       "repeats": [{"cold_s": 2.0, "same_s": 0.2}]}}
    engines = {"mmcache": {**probe, "multi_turn": workload([1.0, 3.0, 1.1], [0.10, 0.30, 0.11], [10, 4, 9])},
               "mmcache_nocache": {**probe, "multi_turn": workload([2.0, 2.0, 2.2], [0.1, 0.1, 0.1], [5, 5, 5])},
               "vllm_cpu": {**probe, "multi_turn": workload([0.5, 6.0, 0.55], [0.05, 0.6, 0.055], [20, 2, 18]),
                            "generated_shared_prefix": workload([1, 1, 1], [1, 1, 1], [1, 1, 1])}}
    pw = prefix_figures.paired_workloads(engines)
    over = pw["over_vllm_cpu"]["multi_turn"]
    assert over["ttft_p50"]["runs"] == pytest.approx([2.0, 0.5, 2.0]) and over["ttft_p50"]["p50"] == pytest.approx(2.0)
    assert over["itl_p50"]["p50"] == pytest.approx(2.0) and over["throughput"]["p50"] == pytest.approx(0.5)
    assert set(pw["over_vllm_cpu"]) == {"multi_turn"}  # mmcache did not play the other workload
    rows = {(r.metric, r.versus): r for r in prefix_table.table_rows({"bit_exact": True, "engines": engines})}
    ttft = rows[("multi_turn: TTFT p50", "vLLM CPU")]
    assert ttft.ratio == pytest.approx(0.5)  # paired: vLLM twice as fast in two repeats of three
    assert ttft.baseline / ttft.value == pytest.approx(0.55 / 1.1)
    assert rows[("multi_turn: ITL p50", "vLLM CPU")].ratio == pytest.approx(0.5)
    assert rows[("multi_turn: output tokens/s", "cache off")].ratio == pytest.approx(1.8)  # 2.0, 0.8, 1.8
    assert rows[("multi_turn: TTFT p50", "cache off")].ratio == pytest.approx(2.0)
