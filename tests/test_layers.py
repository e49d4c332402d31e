"""The layer order of DESIGN.md, checked on every import of the tree (``ast``, so imports inside functions count).

Lowest first, each a folder: the core (``mmcache/*.py``); the engine (``mmcache/engine/``), the encoders
(``encoders/``) and replay (``mmcache/replay/``), each on the core only; the hosts that compose an engine with
encoders (``mmcache/hosts/``: the VLM front end; ``mmcache/server/``: the HTTP server); the embedded models
(``mmcache/presets/``); the command lines (every ``cli`` module) and the benchmarks, which may import every
layer. A module imports only its own layer and those below; the test fails on any edge against the order.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mmcache", "encoders", "benchmarks")

CORE, ENGINE, ENCODERS, REPLAY, HOSTS, PRESETS, TOP = "core", "engine", "encoders", "replay", "hosts", "presets", "top"
RANK = {CORE: 0, ENGINE: 1, ENCODERS: 1, REPLAY: 1, HOSTS: 2, PRESETS: 3, TOP: 4}
def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "benchmarks" or parts[-1] == "cli":
        return TOP
    if module.startswith("mmcache.presets"):
        return PRESETS
    if module.startswith(("mmcache.hosts", "mmcache.server")):
        return HOSTS
    if parts[0] == "encoders":
        return ENCODERS
    if module.startswith("mmcache.engine"):
        return ENGINE
    if module.startswith("mmcache.replay"):
        return REPLAY
    return CORE


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imported(module: str, path: Path, known: set) -> set:
    """The tree's modules that ``module`` imports anywhere in its source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out.update(n for n in names if n in known and n != module)
    return out


def allowed(source: str, target: str) -> bool:
    a, b = layer(source), layer(target)
    if a == b:
        return True
    if a in (ENGINE, ENCODERS, REPLAY) and b in (ENGINE, ENCODERS, REPLAY):
        return False  # side by side on the core, never on each other
    return RANK[b] < RANK[a]


def edges_against_the_order() -> set:
    found = modules()
    return {(m, t) for m, p in found.items() for t in imported(m, p, set(found)) if not allowed(m, t)}


def test_the_layer_rule_reads_as_intended():
    assert layer("mmcache.names") == CORE and layer("mmcache.engine.compute.native") == ENGINE
    assert layer("mmcache.presets.tts") == PRESETS and layer("mmcache.server.app") == HOSTS
    assert layer("mmcache.hosts.vlm") == HOSTS and layer("encoders.voice") == ENCODERS
    assert layer("mmcache.server.cli") == TOP and layer("benchmarks.core") == TOP
    assert not allowed("mmcache.names", "mmcache.engine.engine")  # the core never imports the engine
    assert not allowed("encoders.vision", "mmcache.engine.tokenizer")  # siblings stay apart
    assert allowed("mmcache.server.app", "encoders.media") and allowed("benchmarks.vlm", "mmcache.server")
    assert allowed("mmcache.presets.serving", "mmcache.server.launch")  # presets build what the hosts serve
    assert not allowed("mmcache.server.launch", "mmcache.presets.vlm")  # and the hosts never build a preset


def test_no_module_imports_a_layer_above_its_own():
    found = edges_against_the_order()
    assert not found, f"imports against the layer order (DESIGN.md): {sorted(found)}"
