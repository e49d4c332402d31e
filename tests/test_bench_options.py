"""The benchmarks' command lines: a count of zero or less is refused (argparse: exit code 2) and so is an
output file that cannot be written, before anything is built or measured; options may come before the
benchmark's name; in a run of every benchmark one that fails does not lose the others' figures."""

import argparse
import importlib
import json
import sys
import types

import pytest

from benchmarks import (REGISTRY, chunk_kernel, decode_step, layer_kernels, openmp_runtimes, projections,
                        row_products, runner, widened_linears)
from benchmarks.runner import bench_parser
from mmcache.cli import main as cli
from mmcache.cli import positive_int, writable

COUNTS = {"core": ["--repeats"], "prefix": ["--page-size"],  # core's --tokens starts higher (test_bench_core)
          "vlm": ["--page-size", "--num-pages", "--threads"],
          "diffusion": ["--requests", "--runs", "--steps", "--threads"],
          "cfg": ["--requests", "--runs", "--max-tokens", "--negative-repeat", "--page-size", "--threads"],
          "sampling": ["--repeats", "--batch", "--tokens"],
          "voice": ["--rounds", "--runs", "--frames", "--threads"],
          "serve": ["--repeats", "--sessions", "--turns", "--max-tokens", "--num-pages", "--threads", "--text-sessions",
                    "--text-requests", "--text-turns", "--text-max-tokens"],
          "tp": ["--prompt-tokens", "--repeats", "--page-size"]}


def test_positive_int():
    assert set(COUNTS) == set(REGISTRY)  # a new benchmark's counts belong here too
    assert positive_int("3") == 3
    for bad, says in (("0", "at least 1"), ("-2", "at least 1"), ("2.5", "whole number"), ("x", "whole number")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            positive_int(bad)


@pytest.mark.parametrize("name, option", [(n, o) for n, opts in COUNTS.items() for o in opts])
def test_each_registered_benchmark_refuses_a_zero_count(name, option, capsys):
    parser = bench_parser(name, importlib.import_module(REGISTRY[name]))
    assert getattr(parser.parse_args([option, "2"]), option[2:].replace("-", "_")) == 2
    with pytest.raises(SystemExit) as exc:
        parser.parse_args([option, "0"])
    assert exc.value.code == 2 and "must be at least 1" in capsys.readouterr().err


HUGE = str(10**30)
BOUNDED = [("core", "--tokens", HUGE, "at most 16777216"), ("core", "--repeats", HUGE, "at most 1000"),
           ("sampling", "--tokens", HUGE, "at most 32512"), ("sampling", "--batch", HUGE, "at most 10000"),
           ("sampling", "--repeats", HUGE, "at most"),
           ("diffusion", "--seed", "-1", "at least 0"), ("diffusion", "--seed", str(2**63), "at most"),
           ("diffusion", "--zipf", "nan", "finite"), ("diffusion", "--zipf", "inf", "finite"),
           ("diffusion", "--zipf", "-1e308", "at least 0"), ("diffusion", "--zipf", "-0.5", "at least 0"),
           ("diffusion", "--zipf", "x", "not a number"), ("diffusion", "--requests", HUGE, "at most"),
           ("diffusion", "--runs", HUGE, "at most"), ("diffusion", "--steps", HUGE, "at most"),
           ("diffusion", "--threads", HUGE, "at most 1024"),
           ("cfg", "--seed", "-1", "at least 0"), ("cfg", "--scale", "nan", "finite"),
           ("cfg", "--runs", HUGE, "at most"),
           ("cfg", "--scale", "-inf", "finite"), ("cfg", "--requests", HUGE, "at most"),
           ("cfg", "--max-tokens", HUGE, "at most"), ("cfg", "--negative-repeat", HUGE, "at most 64"),
           ("cfg", "--page-size", "8192", "at most 4096"), ("cfg", "--threads", HUGE, "at most"),
           ("vlm", "--seed", HUGE, "at most"), ("vlm", "--page-size", "8192", "at most 4096"),
           ("vlm", "--num-pages", HUGE, "at most"), ("vlm", "--threads", HUGE, "at most"),
           ("prefix", "--seed", "-1", "at least 0"), ("prefix", "--page-size", "8192", "at most 4096"),
           ("voice", "--rounds", HUGE, "at most 1000"), ("voice", "--frames", HUGE, "at most 1000"),
           ("voice", "--seed", "-1", "at least 0"), ("voice", "--threads", HUGE, "at most"),
           ("serve", "--seed", "-1", "at least 0"), ("serve", "--repeats", HUGE, "at most 1000"),
           ("serve", "--soak", HUGE, "at most 10000"), ("serve", "--rates", "inf", "finite"),
           ("serve", "--duration", "inf", "finite"), ("serve", "--duration", "7200", "must lie in (0, 3600]"),
           ("serve", "--text-requests", HUGE, "at most 10000"), ("serve", "--text-max-tokens", HUGE, "at most 4096")]


@pytest.mark.parametrize("name, option, value, says", BOUNDED, ids=lambda x: str(x)[:12])
def test_a_value_out_of_range_is_refused_by_the_parser(name, option, value, says, capsys):
    """Huge counts (which hung or failed deep in numpy or torch), negative seeds (numpy's default_rng refuses
    them, after the pipeline was built) and non-finite or negative Zipf exponents and guidance scales (NaN
    probabilities, NaN logits) are argparse errors, exit code 2."""
    with pytest.raises(SystemExit) as exc:
        bench_parser(name, importlib.import_module(REGISTRY[name])).parse_args([f"{option}={value}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {option}: " in err and says in err, err


def test_bounds_keep_every_default_and_the_edges_of_the_range():
    """A bound refuses only what was meaningless: each default parses, and so do the range's edges."""
    defaults = {"core": {"tokens": None, "repeats": None}, "sampling": {"batch": 8, "tokens": None},
                "diffusion": {"zipf": 1.1, "seed": 0, "requests": None, "runs": None, "steps": 4, "threads": 1},
                "cfg": {"scale": 3.0, "seed": 0, "page_size": 128, "negative_repeat": None, "max_tokens": None,
                        "runs": None},
                "vlm": {"seed": 0, "page_size": 16, "num_pages": 2048, "threads": 1, "guard_runs": None},
                "prefix": {"seed": 0, "page_size": 128, "workdir": None}}
    for name, want in defaults.items():
        opts = bench_parser(name, importlib.import_module(REGISTRY[name])).parse_args([])
        assert {k: getattr(opts, k) for k in want} == want
    parse = lambda name, *argv: bench_parser(name, importlib.import_module(REGISTRY[name])).parse_args(argv)
    assert parse("diffusion", "--zipf", "0", "--seed", str(2**63 - 1)).zipf == 0.0
    assert parse("cfg", "--scale", "-2.5", "--page-size", "4096").scale == -2.5
    assert parse("core", "--tokens", str(1 << 24)).tokens == 1 << 24
    assert parse("vlm", "--guard-runs", "0", "--guard-requests", "0").guard_runs == 0


def stand_in_benchmark(monkeypatch) -> list:
    """Registers one benchmark, ``fake``, that records its options in the returned list and measures nothing."""
    ran = []
    fake = types.ModuleType("fake_bench")
    fake.DESCRIPTION, fake.add_arguments = "a stand-in", lambda p: None
    fake.run, fake.table_rows = lambda opts: ran.append(opts) or {}, lambda result: []
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    monkeypatch.setattr(runner, "REGISTRY", {"fake": "fake_bench"})
    return ran


def test_an_empty_json_path_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """`--json ''` (an unset variable) is refused before a run, not run and written nowhere; a path under a file is
    refused as one that cannot be written."""
    ran = stand_in_benchmark(monkeypatch)
    for argv in (["bench", "fake", "--json", ""], ["bench", "--json", "", "fake"], ["bench", "--json", ""]):
        assert cli(argv) == 2
        assert ran == [] and "mmcache bench: cannot write '': empty path" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("kept")
    assert not writable(str(tmp_path / "a-file" / "deeper" / "out.json"), "test")
    assert f"{tmp_path / 'a-file'} is not a folder" in capsys.readouterr().err
    assert writable(None, "test")


@pytest.mark.parametrize("name, option", [("prefix", "--preset"), ("prefix", "--dtype"), ("cfg", "--preset"),
                                          ("cfg", "--dtype"), ("vlm", "--preset"), ("vlm", "--dtype")])
def test_an_unknown_preset_or_dtype_is_refused_by_the_benchmarks_own_parser(name, option, capsys):
    # Each benchmark's own parser names the option, before anything is built (not export-model's usage, later).
    with pytest.raises(SystemExit) as exc:
        cli(["bench", name, "--quick", option, "nosuch"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"mmcache bench {name}: error: argument {option}: invalid choice" in err, err


@pytest.mark.parametrize("main, option", [(decode_step.main, "--rounds"), (decode_step.main, "--max-tokens"),
                                          (openmp_runtimes.main, "--pairs"),
                                          (chunk_kernel.main, "--rounds"), (chunk_kernel.main, "--calls"),
                                          (chunk_kernel.main, "--group"), (chunk_kernel.main, "--kv-heads"),
                                          (layer_kernels.main, "--pairs"), (layer_kernels.main, "--batch"),
                                          (layer_kernels.main, "--decode-tokens"), (projections.main, "--hits"),
                                          (projections.main, "--batch"), (row_products.main, "--rounds"),
                                          (row_products.main, "--batch"), (row_products.main, "--tokens")])
def test_the_scripts_refuse_a_zero_count(main, option, capsys):
    with pytest.raises(SystemExit) as exc:
        main([option, "0"])
    assert exc.value.code == 2 and "must be at least 1" in capsys.readouterr().err


def test_options_are_taken_before_the_name_as_after_it(tmp_path, monkeypatch):
    """`mmcache bench --json PATH` (every benchmark, quick) and `mmcache bench --json PATH NAME` write the same
    file as `mmcache bench NAME --json PATH`, and `--quick` before NAME counts as after it; a stand-in benchmark
    records how it was run."""
    fake = types.ModuleType("fake_bench")
    fake.DESCRIPTION = "a stand-in"
    fake.add_arguments = lambda p: p.add_argument("--size", type=positive_int, default=1)
    fake.run = lambda opts: {"quick": opts.quick, "size": opts.size}
    fake.table_rows = lambda result: []
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    monkeypatch.setattr(runner, "REGISTRY", {"fake": "fake_bench"})
    for argv, expect in ((["bench", "--json", "{}"], {"fake": {"quick": True, "size": 1}}),
                         (["bench", "--json", "{}", "fake", "--size", "3"], {"quick": False, "size": 3}),
                         (["bench", "fake", "--json", "{}", "--size", "2"], {"quick": False, "size": 2}),
                         (["bench", "--quick", "--json", "{}", "fake"], {"quick": True, "size": 1}),
                         (["bench", "--quick", "--json", "{}"], {"fake": {"quick": True, "size": 1}})):
        out = tmp_path / f"{len(argv)}-{argv[1]}.json"
        assert cli([a.format(out) for a in argv]) == 0
        assert json.loads(out.read_text()) == expect
    with pytest.raises(SystemExit) as exc:
        cli(["bench", "--json"])
    assert exc.value.code == 2


def test_a_json_path_before_and_after_the_name_is_refused(tmp_path, monkeypatch, capsys):
    """`mmcache bench --json a.json NAME --json b.json` wrote b.json alone, a.json silently dropped."""
    ran = stand_in_benchmark(monkeypatch)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    with pytest.raises(SystemExit) as exc:
        cli(["bench", "--json", str(a), "fake", "--json", str(b)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and ran == [] and not a.exists() and not b.exists()
    assert f"mmcache bench fake: error: --json given both before fake ({a}) and after it ({b}); give it once" in err


def test_a_failing_benchmark_does_not_lose_the_others(tmp_path, monkeypatch, capsys):
    """In quick mode every benchmark runs even when one before it raises; the table has the others' rows, the
    JSON the failure's message under its name (written after each benchmark), and the command exits 1."""
    from benchmarks.table import Row
    from mmcache.errors import MmcacheError

    def module(name, run):
        m = types.ModuleType(name)
        m.DESCRIPTION, m.add_arguments, m.run = name, lambda p: None, run
        m.table_rows = lambda result: [Row(name, "a figure", result["value"], "s")]
        monkeypatch.setitem(sys.modules, name, m)
        return name

    def typed(opts):
        raise MmcacheError("no peer here")

    out = tmp_path / "all.json"
    seen = []

    def bug(opts):  # by now the file holds the first two benchmarks' results
        seen.append(json.loads(out.read_text()))
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(runner, "REGISTRY", {"first": module("typed_bench", typed), "second": module(
        "good_bench", lambda opts: {"value": 2.5}), "third": module("buggy_bench", bug)})
    assert cli(["bench", "--json", str(out)]) == 1
    assert json.loads(out.read_text()) == {"first": {"error": "MmcacheError: no peer here"},
                                           "second": {"value": 2.5},
                                           "third": {"error": "ZeroDivisionError: a bug"}}
    assert seen == [{"first": {"error": "MmcacheError: no peer here"}, "second": {"value": 2.5}}]
    assert [p.name for p in tmp_path.iterdir()] == ["all.json"]  # no partial file left
    captured = capsys.readouterr()
    assert "good_bench" in captured.out and "typed_bench" not in captured.out
    assert "failed: first (MmcacheError: no peer here); third (ZeroDivisionError: a bug)" in captured.err
    assert "Traceback" in captured.err and captured.err.count("Traceback") == 1  # the bug's, not the typed one's


@pytest.mark.parametrize("name", [None, "fake"])
def test_a_json_path_that_cannot_be_written_is_refused_before_anything_runs(name, tmp_path, monkeypatch, capsys):
    ran = stand_in_benchmark(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("kept")
    assert cli(["bench", "--json", str(blocker / "out.json")] + ([name] if name else [])) == 2
    assert ran == [] and "cannot write" in capsys.readouterr().err
    existing = tmp_path / "earlier.json"  # a writable path is checked without touching what it holds
    existing.write_text("earlier")
    assert writable(str(existing), "test") and existing.read_text() == "earlier"
    assert not writable(str(tmp_path), "test") and "Is a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "earlier.json"]


SCRIPTS = (chunk_kernel, decode_step, layer_kernels, openmp_runtimes, projections, row_products, widened_linears)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_the_scripts_refuse_a_json_path_that_cannot_be_written_before_measuring(script, tmp_path, monkeypatch,
                                                                               capsys):
    for name in ("measure", "measure_engine", "run"):
        if hasattr(script, name):
            monkeypatch.setattr(script, name, lambda *a, **k: pytest.fail("measured"))
    (tmp_path / "a-file").write_text("")
    assert script.main(["--json", str(tmp_path / "a-file" / "out.json")]) == 2
    assert "cannot write" in capsys.readouterr().err


class _FakeEngine:
    """Stands in for the sampling benchmark's engine: every gap between two tokens of a ``generate`` call is the
    next of the figures given for the sampler patched in at that moment (the warm-up call excepted)."""

    def __init__(self, gaps: dict):
        self.gaps = {name: iter(v) for name, v in gaps.items()}

    def generate(self, prompts, sampling):
        from benchmarks import sampling as bench
        from mmcache.engine import engine as engine_module

        if len(prompts) == 1:  # the warm-up
            return [types.SimpleNamespace(token_times=[0.0, 1.0])]
        gap = next(self.gaps["definition" if engine_module.sample is bench.by_definition else "mmcache"])
        return [types.SimpleNamespace(token_times=[0.0, gap, 2 * gap]) for _ in prompts]


def test_the_sampling_itl_ratio_is_the_median_of_per_pair_ratios(monkeypatch):
    """Run i of the engine's sampler is paired with run i of the definition's (they ran back to back): here the
    pairs' ratios are 2.5, 1.1 and 1.1, so the paired median is 1.1 where the ratio of the two medians (2.5 / 2)
    would say 1.25; the table's "better by" is the paired figure."""
    from benchmarks import sampling
    from mmcache import presets

    gaps = {"mmcache": [1.0, 2.0, 3.0], "definition": [2.5, 2.2, 3.3]}
    fake = _FakeEngine(gaps)
    monkeypatch.setattr(presets, "engine_from_preset", lambda *a, **k: fake)
    e = sampling._engine_itl(batch=2, tokens=3, runs=3)
    assert e["itl_runs_s"] == gaps and e["itl_p50_s"] == 2.0 and e["itl_p50_definition_s"] == 2.5
    assert e["itl_ratio_pairs"] == pytest.approx([2.5, 1.1, 1.1]) and e["itl_ratio_paired"] == pytest.approx(1.1)
    call = {"mmcache_ms": 1.0, "definition_ms": 2.0}
    cases = ("peaked: temperature 0.8, top-p 0.9", "flat: temperature 0.8, top-p 0.9", "flat: temperature 1.0")
    row = sampling.table_rows({"per_call": dict.fromkeys(cases, call), "engine": e})[-1]
    assert row.ratio == pytest.approx(1.1) and row.baseline / row.value == pytest.approx(1.25)


def test_the_sampling_engine_run_pairs_and_an_even_count_is_said(monkeypatch):
    """Full mode runs an odd number of pairs (with four, the median was the mean of the middle two); quick mode
    keeps two, for time, and its table row says that its ratio is the mean of the two."""
    from benchmarks import sampling

    asked = []
    monkeypatch.setattr(sampling, "_per_call", lambda repeats: {})
    monkeypatch.setattr(sampling, "_engine_itl", lambda batch, tokens, runs: asked.append(runs))
    for quick in (True, False):
        sampling.run(argparse.Namespace(quick=quick, repeats=None, tokens=None, batch=8))
    assert asked == [2, 5]
    call = {"mmcache_ms": 1.0, "definition_ms": 2.0}
    cases = ("peaked: temperature 0.8, top-p 0.9", "flat: temperature 0.8, top-p 0.9", "flat: temperature 1.0")
    engine = {"batch": 8, "itl_p50_s": 1.0, "itl_p50_definition_s": 1.2, "itl_ratio_paired": 1.1}
    rows = {runs: sampling.table_rows({"per_call": dict.fromkeys(cases, call), "engine": dict(engine, runs=runs)})[-1]
            for runs in (2, 5)}
    assert "2 run pairs" in rows[2].metric
    assert rows[2].target == "ratio: median of 2 pair ratios (even: mean of the middle two)"
    assert "5 run pairs" in rows[5].metric and rows[5].target == ""
