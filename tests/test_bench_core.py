"""``mmcache bench core``: the figures it reports are there, consistent, and measured on equal work."""

import argparse

import numpy as np
import pytest

from benchmarks import core, runner
from benchmarks.table import render


def test_the_three_naming_schemes_name_the_same_pages():
    ids = np.random.default_rng(0).integers(0, 151_936, size=10 * core.PAGE + 5).astype(np.int32)
    mm = core._manager(8).prepare(ids).names
    assert len(mm) == len(core._sha256_pickle(ids.tolist(), core.PAGE)) == len(core._blake2b(ids.tolist(), core.PAGE))
    same = core._manager(8).prepare(np.tile(ids[:core.PAGE], 10)).names
    assert len(set(same.tolist())) == 10  # chained: equal pages at different depths get different names


def test_quick_run_reports_every_figure_with_side_by_side_ratios():
    p = argparse.ArgumentParser()
    core.add_arguments(p)
    args = p.parse_args(["--repeats", "3", "--tokens", str(1 << 14)])
    args.quick = False
    r = core.run(args)
    n = r["naming"]
    assert n["tokens"] == 1 << 14
    for k in ("mmcache", "mmcache_from_list", "sha256_pickle", "blake2b"):
        assert n[f"{k}_mtok_s"] > 0
    assert n["vs_sha256_pickle"] > 0 and n["vs_blake2b"] > 0
    assert set(r["lookup_ms"]) >= {"pages_100", "pages_1000"} and r["evict_ms_per_1000_pages"] > 0
    assert 0 < r["metadata_array_bytes_per_page"] <= r["metadata_bytes_per_page"] < 4096
    rows = core.table_rows(r)
    assert [row.metric for row in rows][:2] == ["page naming throughput"] * 2


@pytest.mark.parametrize("tokens", ["1", str(core.MIN_TOKENS - 1)])
def test_too_few_tokens_for_every_scheme_to_name_a_page_are_refused_by_the_parser(tokens, capsys):
    # 1 token divided by zero; up to 1023 the reference schemes, naming an eighth of them, named no page.
    parser = runner.bench_parser("core", core)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--quick", "--tokens", tokens, "--repeats", "1"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument --tokens: must be at least {core.MIN_TOKENS}, got {tokens}" in err
    assert parser.parse_args(["--tokens", str(core.MIN_TOKENS)]).tokens == core.MIN_TOKENS == 8 * core.PAGE


def test_the_smallest_naming_run_names_a_page_with_every_scheme():
    n = core.bench_naming(core.MIN_TOKENS, 1)
    for k in ("mmcache", "mmcache_from_list", "sha256_pickle", "blake2b"):
        assert n[f"{k}_mtok_s"] > 0
    assert n["vs_sha256_pickle"] > 0 and n["vs_blake2b"] > 0
    with pytest.raises(ValueError, match=f"at least {core.MIN_TOKENS}"):
        core.bench_naming(core.MIN_TOKENS - 1, 1)


def test_the_table_gives_the_paired_naming_ratios_of_the_json():
    # Medians 300 against 30 and 20 would read 10x and 15x; the JSON's paired ratios (RESULTS.md quotes them)
    # are what the table must give, marked as such.
    naming = {"mmcache_mtok_s": 300.0, "sha256_pickle_mtok_s": 30.0, "blake2b_mtok_s": 20.0,
              "vs_sha256_pickle": 14.5, "vs_blake2b": 17.25}
    r = {"naming": naming, "lookup_ms": {"pages_1000": 0.3, "pages_100": 0.07}, "evict_ms_per_1000_pages": 4.6,
         "metadata_bytes_per_page": 577.0}
    sha, blake = core.table_rows(r)[:2]
    assert (sha.ratio, blake.ratio) == (14.5, 17.25)
    table = render([sha, blake])
    assert "14.50x paired" in table and "17.25x paired" in table
