"""The engine packs its linears only where the packed copy fits in memory beside the KV pool: otherwise it runs
on the plain linears, exactly as ``packed_linears=False`` does, says why, and later engines on the same model
keep that choice; where only the row kernel's copies do not fit, it packs without them.
``memory.available_bytes`` reads the system's and the control group's figures."""

import logging

import numpy as np
import pytest
import torch

from mmcache.engine import ComputeConfig, Engine, EngineConfig, Request, SamplingParams, memory
from mmcache.engine.config import EngineConfigError
from mmcache.engine.compute.path import PACKING_HEADROOM, PATH_ATTR
from mmcache.engine.inspect import record_logits, rows_equal
from mmcache.presets.text import build_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CONFIG = dict(page_size=16, num_pages=64, compute=ComputeConfig(layer_kernels=False))
PLAIN = dict(CONFIG, compute=ComputeConfig(packed_linears=False, layer_kernels=False))


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_available_bytes_takes_the_smaller_of_the_system_and_the_control_group(tmp_path):
    meminfo = write(tmp_path / "meminfo", "MemTotal:  32000000 kB\nMemFree:  1000 kB\nMemAvailable:  20000000 kB\n")
    none = tmp_path / "no-cgroup"
    assert memory.available_bytes(meminfo, none) == 20000000 * 1024
    v2 = tmp_path / "v2"
    write(v2 / "memory.max", "8000000000\n")
    write(v2 / "memory.current", "3000000000\n")
    assert memory.available_bytes(meminfo, v2) == 5000000000  # the group's room is smaller
    write(v2 / "memory.max", "max\n")  # no limit: the system's figure
    assert memory.available_bytes(meminfo, v2) == 20000000 * 1024
    v1 = tmp_path / "v1"
    write(v1 / "memory" / "memory.limit_in_bytes", str((1 << 63) - 4096))  # v1's "no limit"
    write(v1 / "memory" / "memory.usage_in_bytes", "123")
    assert memory.available_bytes(meminfo, v1) == 20000000 * 1024
    write(v1 / "memory" / "memory.limit_in_bytes", "1000")  # a group over its limit has no room
    write(v1 / "memory" / "memory.usage_in_bytes", "5000")
    assert memory.available_bytes(meminfo, v1) == 0


def test_available_bytes_is_none_when_nothing_can_be_read(tmp_path):
    assert memory.available_bytes(tmp_path / "missing", tmp_path / "missing-too") is None
    garbage = write(tmp_path / "meminfo", "MemAvailable: lots\nnonsense\n")
    assert memory.available_bytes(garbage, tmp_path) is None
    v2 = tmp_path / "v2"
    write(v2 / "memory.max", "-1\n")
    write(v2 / "memory.current", "12\n")
    assert memory.available_bytes(garbage, v2) is None


def test_short_of_memory_the_engine_runs_exactly_as_with_packing_off(monkeypatch, caplog):
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 20)
    model, tok = build_model("tiny-qwen2", "float32")
    with caplog.at_level(logging.WARNING, logger="mmcache.engine"):
        short = Engine(model, tok, EngineConfig(**CONFIG))
    assert short.compute.num_packed_linears == 0
    assert short.packing_skipped and "is available" in short.packing_skipped
    assert any("linears left unpacked" in r.getMessage() for r in caplog.records)
    plain = Engine(build_model("tiny-qwen2", "float32")[0], tok, EngineConfig(**PLAIN))
    assert plain.packing_skipped is None and short.fingerprint == plain.fingerprint
    rows = {id(short): record_logits(short), id(plain): record_logits(plain)}
    prompts = [np.random.default_rng(2).integers(2, 512, size=n).tolist() for n in (9, 37)]
    assert [o.output_ids for o in short.generate(prompts, GREEDY)] == [o.output_ids for o in
                                                                      plain.generate(prompts, GREEDY)]
    got, want = rows[id(short)], rows[id(plain)]
    assert got.keys() == want.keys() and all(rows_equal(got, want, rid, GREEDY.max_tokens) for rid in want)

    # A later engine with the same settings keeps the first one's choice, whatever memory says now.
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 50)
    later = Engine(model, tok, EngineConfig(**CONFIG))
    assert later.compute.num_packed_linears == 0 and later.packing_skipped == short.packing_skipped
    assert later.backend == short.backend


@pytest.mark.parametrize("room", [None, 1 << 50])
def test_with_room_or_no_figure_the_engine_packs(monkeypatch, room):
    monkeypatch.setattr(memory, "available_bytes", lambda: room)
    model, tok = build_model("tiny-qwen2", "float32")
    need = Engine(build_model("tiny-qwen2", "float32")[0], tok,
                  EngineConfig(**PLAIN)).compute.bytes_to_pack()
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert need == sum(m.weight.numel() * 4 for m in linears) > 0  # every layer linear and the head, float32
    eng = Engine(model, tok, EngineConfig(**CONFIG))
    assert eng.packing_skipped is None and eng.compute.num_packed_linears > 0
    assert eng.compute.bytes_to_pack() == 0  # nothing left to pack


def test_short_of_room_for_the_row_kernels_copies_the_engine_packs_without_them(native_kernel, monkeypatch,
                                                                                  caplog):
    from mmcache.engine.compute import native

    monkeypatch.setattr(native, "row_products", lambda lib: lib is not None)  # as on an AVX2 build
    model, tok = build_model("tiny-qwen2", "float32")
    probe = Engine(build_model("tiny-qwen2", "float32")[0], tok, EngineConfig(**PLAIN))
    pool = probe.page_bytes * probe.num_pages
    packed, with_rows = probe.compute.bytes_to_pack(), probe.compute.bytes_to_pack(rows=True)
    assert with_rows > packed > 0
    room = int(((packed + with_rows) // 2 + pool) / PACKING_HEADROOM)  # the packed copy fits, the row copies not
    monkeypatch.setattr(memory, "available_bytes", lambda: room)
    with caplog.at_level(logging.WARNING, logger="mmcache.engine"):
        eng = Engine(model, tok, EngineConfig(**CONFIG))
    assert eng.packing_skipped is None and eng.compute.num_packed_linears > 0
    assert eng.compute.num_row_product_linears == 0 and "+native-rows" not in eng.backend
    assert eng.row_products_skipped and "is available" in eng.row_products_skipped
    assert any("row kernel left out" in r.getMessage() for r in caplog.records)
    # a later engine with the same settings keeps the choice, whatever memory says now
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 50)
    later = Engine(model, tok, EngineConfig(**CONFIG))
    assert later.row_products_skipped == eng.row_products_skipped and later.backend == eng.backend
    # with room for both, both
    roomy = Engine(build_model("tiny-qwen2", "float32")[0], tok, EngineConfig(**CONFIG))
    assert roomy.row_products_skipped is None and "+native-rows" in roomy.backend


def test_a_kv_pool_larger_than_the_memory_left_is_refused_before_the_model_is_touched(monkeypatch):
    # Allocating and zeroing it used to end in MemoryError, a bare allocator RuntimeError, or the kernel killing
    # the process, depending on how much larger than memory it was.
    model, tok = build_model("tiny-qwen2", "float32")
    probe = Engine(build_model("tiny-qwen2", "float32")[0], tok, EngineConfig(**PLAIN))
    pool = probe.page_bytes * probe.num_pages
    monkeypatch.setattr(memory, "available_bytes", lambda: pool - 1)
    with pytest.raises(EngineConfigError, match="num_pages"):
        Engine(model, tok, EngineConfig(**CONFIG))
    assert getattr(model, PATH_ATTR, None) is None  # refused before the engine set up the model's modules
    assert Engine(model, tok, EngineConfig(**dict(CONFIG, num_pages=CONFIG["num_pages"] // 2))).num_pages == 32


def test_a_cfg_pool_that_does_not_fit_fails_its_request_only(monkeypatch):
    model, tok = build_model("tiny-qwen2", "float32")
    eng = Engine(model, tok, EngineConfig(**dict(CONFIG, cfg_num_pages=4096)))
    monkeypatch.setattr(memory, "available_bytes", lambda: eng.page_bytes * 4095)  # room for the main pool
    guided = Request([5, 6, 7, 8], GREEDY, "guided", negative_prompt=[9, 10], guidance_scale=3.0)
    outs = {o.request_id: o for o in eng.generate([guided, Request([5, 6, 7, 8], GREEDY, "plain")])}
    assert isinstance(outs["guided"].error, EngineConfigError) and "cfg_num_pages" in str(outs["guided"].error)
    assert outs["plain"].finish_reason == "length" and len(outs["plain"].output_ids) == GREEDY.max_tokens
    assert set(eng.managers) == {"main"}
    eng.check_invariants()
    monkeypatch.setattr(memory, "available_bytes", lambda: None)  # no figure: no refusal
    assert eng.generate([guided])[0].finish_reason == "length" and set(eng.managers) == {"main", "cfg"}
