"""The CPU compute path behind one seam (``mmcache.engine.compute``): its settings read from the environment in
one place, its config of speed-only flags, and the object that decides what runs and names the backend."""

import ast
from pathlib import Path

import pytest

from mmcache.engine import ATTENTION_BACKEND, ComputeConfig, ComputeConfigError, Engine, EngineConfig, SamplingParams
from mmcache.engine import compute
from mmcache.engine.compute import ComputeSettings, NativeConfigError, kernels, native
from mmcache.presets.text import build_model

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def test_settings_come_from_the_mapping_given():
    env = {"MMCACHE_NATIVE": " Off ", "MMCACHE_TILE_UNIT": "off", "MMCACHE_CACHE_DIR": "kernels-here", "CC": "gcc"}
    s = ComputeSettings.from_env(env)
    assert (s.native, s.tile_unit, s.cache_dir, s.compiler) == ("off", False, Path("kernels-here"), "gcc")
    default = ComputeSettings.from_env({"XDG_CACHE_HOME": "xdg"})
    assert (default.native, default.tile_unit, default.compiler) == ("auto", True, None)
    assert default.library_dir == Path("xdg") / "mmcache"
    assert ComputeSettings.from_env({"MMCACHE_NATIVE": ""}).native == "auto"  # empty counts as unset


@pytest.mark.parametrize("env, named", [({"MMCACHE_NATIVE": "sometimes"}, "MMCACHE_NATIVE"),
                                        ({"MMCACHE_TILE_UNIT": "on"}, "MMCACHE_TILE_UNIT")])
def test_a_bad_variable_is_a_typed_error_naming_it(env, named):
    with pytest.raises(NativeConfigError, match=named):
        ComputeSettings.from_env(env)
    with pytest.raises(NativeConfigError):
        ComputeSettings(native="sometimes")


def test_explicit_settings_override_the_environment(monkeypatch):
    monkeypatch.setenv("MMCACHE_NATIVE", "require")
    monkeypatch.setenv("MMCACHE_CACHE_DIR", "/nonexistent-dir/never-built")
    assert native.library(ComputeSettings(native="off")) is None  # no build attempted, no error raised


def test_only_the_settings_module_reads_the_environment():
    package = Path(compute.__file__).parent
    readers = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                readers.append(path.name)
    assert set(readers) == {"settings.py"}, readers


def test_compute_config_takes_bools_and_a_settings_object_only():
    for name in ("packed_linears", "row_products", "layer_kernels", "tune_malloc", "whole_hits"):
        with pytest.raises(ComputeConfigError, match=name):
            ComputeConfig(**{name: "yes"})
    with pytest.raises(ComputeConfigError, match="settings"):
        ComputeConfig(settings={"native": "off"})
    assert EngineConfig().compute == ComputeConfig()  # the defaults: every fast path where it runs


def test_the_aten_config_computes_on_the_models_own_modules(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "tune_malloc", lambda: calls.append(1) or True)
    model, tok = build_model("tiny-qwen2", "bfloat16")
    eng = Engine(model, tok, EngineConfig(page_size=16, num_pages=64, compute=ComputeConfig.aten()))
    assert eng.backend == ATTENTION_BACKEND and eng.compute.decode_kernel is None
    assert eng.runner.decode_kernel is None and calls == []
    assert eng.compute.num_packed_linears == 0 and eng.compute.num_native_norms == 0
    assert not eng.whole_hits and eng.whole_hits_skipped is None  # not asked for: nothing to explain
    assert eng.packing_skipped is None and eng.row_products_skipped is None
    assert [o.finish_reason for o in eng.generate([list(range(3, 40))], GREEDY)] == ["length"]


def test_the_path_names_what_runs(monkeypatch):
    """The backend an engine reports is the compute path's name for the modules installed, and a second engine
    on the same model with the same flags adopts them (same name, nothing installed again)."""
    model, tok = build_model("tiny-qwen2", "float32")
    first = Engine(model, tok, EngineConfig(page_size=16, num_pages=64))
    path = first.compute
    assert first.backend == path.backend and first.fingerprint.attention_backend == path.backend
    assert path.backend.startswith(ATTENTION_BACKEND)
    assert ("+onednn-packed" in path.backend) == (path.num_packed_linears > 0)
    assert ("+native-decode" in path.backend) == (path.decode_kernel is not None)
    assert ("+native-norm" in path.backend) == (path.num_native_norms > 0)
    installed = []
    monkeypatch.setattr(compute.ComputePath, "pack_linears", lambda self, rows=None: installed.append(rows))
    second = Engine(model, tok, EngineConfig(page_size=16, num_pages=64))
    assert second.backend == first.backend and installed == []
