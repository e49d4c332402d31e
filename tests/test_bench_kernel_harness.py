"""The kernel micro-benchmarks' shared harness (``benchmarks.kernel_harness``)."""

import json

from benchmarks import kernel_harness as h


def test_sides_take_turns_starting_one_later_each_repeat():
    assert [h.order(("a", "b"), r) for r in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert [h.order(("a", "b", "c"), r)[0] for r in range(4)] == ["a", "b", "c", "a"]


def test_in_turns_measures_every_side_in_every_repeat_in_the_rotated_order():
    calls = []
    times = h.in_turns(("a", "b"), 3, lambda side: calls.append(side) or float(len(calls)))
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert times == {"a": [1.0, 4.0, 5.0], "b": [2.0, 3.0, 6.0]}


def test_a_step_that_took_prompt_tokens_is_no_decode_step():
    class Engine:
        def __init__(self):
            self.counters, self.prefills = {"prompt_tokens": 0}, [True, False]

        def step(self):
            self.counters["prompt_tokens"] += 5 if self.prefills.pop(0) else 0

    eng = Engine()
    assert h.decode_only_step(eng) is None
    took = h.decode_only_step(eng)
    assert took is not None and took >= 0 and eng.prefills == []


def test_the_ratio_is_the_median_of_per_repeat_ratios_not_a_ratio_of_medians():
    times = {"slow": [2.0, 30.0, 4.0], "fast": [1.0, 10.0, 4.0]}  # per repeat: 2, 3, 1
    got = h.paired(times, "slow", "fast")
    assert got == {"slow_s": 4.0, "fast_s": 4.0, "slow_over_fast": 2.0}  # medians 4 and 4: their ratio is 1
    assert h.ratio([3.0, 8.0], [1.0, 2.0]) == 3.5


def test_timed_is_the_mean_per_call():
    calls = []
    took = h.timed(calls.append, 7, calls=5)
    assert calls == [7] * 5 and took >= 0


def test_the_machine_line_and_the_json(tmp_path, capsys):
    m = h.machine(kernels=False)
    assert m["threads"] >= 1 and isinstance(m["openmp"], str) and "kernels" not in m
    h.say_machine("bench", kernels=False)
    assert f"[bench] {m['threads']} threads" in capsys.readouterr().err
    path = tmp_path / "out.json"
    h.write_json(str(path), {"b": 1, "a": 2}, say=False)
    assert json.loads(path.read_text()) == {"a": 2, "b": 1}
