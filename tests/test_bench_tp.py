"""``mmcache bench tp``: both sizes run under torchrun and the figures it reports hold what they claim."""

import argparse

from benchmarks import tp


def test_bench_tp_quick_runs_both_sizes_bit_exact_with_every_hit():
    result = tp.run(argparse.Namespace(quick=True, preset="tiny", dtype="float32", prompt_tokens=64, repeats=1,
                                       page_size=16))
    assert result["tokens_equal_across_sizes"]
    for n in ("1", "2"):
        s = result["sizes"][n]
        e = s["exactness"]
        assert e["logits_equal"] and e["tokens_equal"] and e["follower_digests_equal"]
        assert e["matched_on"] == [0, 80, 32]
        assert s["matched_tokens"] == [48]  # every full page but the one holding the last token
    two = result["sizes"]["2"]["agreement_per_rank"]
    assert [r["calls"] for r in two] == [4, 4]  # one agreement per admission (cold and hit, two rounds) per rank
    assert all(ms is not None and ms > 0 for ms in result["agreement_ms_per_admission"])
    assert result["follower_catchup_ms"][0] > 0
    rows = tp.table_rows(result)
    assert len(rows) == 3 and "bit-exact on/off: yes" in rows[1].metric
