"""One fingerprint module: every encoder takes its fingerprinting from ``encoders.fingerprint``, and the strings
it returns do not move, since every stored entry's key is built from one."""

import ast
from pathlib import Path

import pytest
import torch

from encoders.fingerprint import (LiveFingerprint, kernel_implementations, module_configs, module_fingerprint,
                                  module_kernels, nested_configs, weights_digest)
from mmcache.presets.vlm import build_preset
from mmcache.errors import InvalidRequest

ROOT = Path(__file__).resolve().parent.parent
NAMES = {f.__name__ for f in (LiveFingerprint, kernel_implementations, module_configs, module_fingerprint,
                              module_kernels, nested_configs, weights_digest)}


def fixed_modules() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A float32 linear and a module of int64 and bfloat16 buffers, with fixed values."""
    linear = torch.nn.Linear(3, 2)
    with torch.no_grad():
        linear.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4)
        linear.bias.copy_(torch.tensor([-1.0, 0.5]))
    buffers = torch.nn.Module()
    buffers.register_buffer("table", torch.arange(4, dtype=torch.int64))
    buffers.register_buffer("scale", torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    return linear, buffers


def test_fingerprint_strings_are_the_ones_store_keys_were_built_with():
    # Taken with the code as it stood before fingerprinting moved into its own module: a change here re-keys
    # every stored entry, and must come with a FINGERPRINT_VERSION bump, not by accident.
    linear, buffers = fixed_modules()
    assert module_fingerprint(linear, {"kind": "pin"}) == "b85a78a9583e49022d21a6c618e1cfea"
    assert module_fingerprint(buffers, {"kind": "pin", "n": 2}) == "f5a61d1c9d70b682b7e36bf1c5ade88a"
    assert weights_digest([linear, buffers]) == "27f80a9596fdbd16ab5a962fa0746a0f"
    assert weights_digest([buffers, linear]) == "259702503cae094fb87d4fbe67369ccb"  # the order is part of it


def _imports_and_definitions(path: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """(module, name) of every ``from ... import name`` in ``path``, and the top-level names it defines."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imports = [(node.module or "", alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               for alias in node.names]
    defined = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    return imports, defined


@pytest.mark.parametrize("folder", ["encoders", "mmcache", "benchmarks", "tests"])
def test_fingerprinting_is_imported_from_the_fingerprint_module_only(folder):
    for path in sorted((ROOT / folder).rglob("*.py")):
        imports, defined = _imports_and_definitions(path)
        for module, name in imports:
            if name in NAMES:
                assert module in ("fingerprint", "encoders.fingerprint"), f"{path.name} imports {name} from {module}"
        if path != ROOT / "encoders" / "fingerprint.py":
            assert not NAMES & set(defined), f"{path.name} defines {sorted(NAMES & set(defined))}"


def test_module_kernels_name_each_config_the_module_runs_on():
    model = build_preset("tiny-llava").model
    kernels = module_kernels(model)
    assert set(kernels) == set(module_configs(model))
    assert {k["attention"] for k in kernels.values()} == {"sdpa"}
    model.set_attn_implementation({"vision_config": "eager"})
    changed = {path for path, k in module_kernels(model).items() if k != kernels[path]}
    assert changed and all("vision" in path for path in changed)


def test_bad_arguments_are_refused():
    linear, _ = fixed_modules()
    for call in (lambda: module_fingerprint(None, {}), lambda: module_fingerprint(linear, ["kind"]),
                 lambda: weights_digest(linear), lambda: weights_digest([linear, "x"]),
                 lambda: LiveFingerprint([], lambda: 1), lambda: LiveFingerprint("model", lambda: 1)):
        with pytest.raises(InvalidRequest):
            call()
