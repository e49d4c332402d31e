"""``mmcache bench core``: the figures it reports are there, consistent, and measured on equal work."""

import argparse

import numpy as np

from benchmarks import core


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
