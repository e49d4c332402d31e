"""The layer order of DESIGN.md, checked on every import of the tree (``ast``, so imports inside functions count).

Lowest first: the core (``mmcache/*.py``); the engine, the encoders and replay, each on the core only; the hosts
that compose an engine with encoders (the VLM front end, the HTTP server); the embedded-model presets; the command
lines and the benchmarks, which may import every layer. A module imports only its own layer and those below.

``KNOWN`` lists the edges against the order that the tree still has, each one a piece of the layer work left in
issue 41 (presets that hosts and the engine build from, the VLM front end living in the engine's folder). The
test fails on any other edge, and on an entry of ``KNOWN`` that is gone, so the list only shrinks.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mmcache", "encoders", "benchmarks")

CORE, ENGINE, ENCODERS, REPLAY, HOSTS, PRESETS, TOP = "core", "engine", "encoders", "replay", "hosts", "presets", "top"
RANK = {CORE: 0, ENGINE: 1, ENCODERS: 1, REPLAY: 1, HOSTS: 2, PRESETS: 3, TOP: 4}
PRESET_MODULES = {"mmcache.engine.presets", "mmcache.engine.vlm_presets", "encoders.local_tokenizers"}

KNOWN = {
    ("mmcache.engine", "mmcache.engine.presets"),
    ("mmcache.engine", "mmcache.engine.vlm"),
    ("mmcache.engine", "mmcache.engine.vlm_presets"),
    ("mmcache.engine.models", "mmcache.engine.presets"),
    ("mmcache.engine.vlm", "mmcache.engine.vlm_presets"),
    ("mmcache.server.launch", "mmcache.engine.vlm_presets"),
    ("mmcache.server.pipelines", "encoders.diffusion_presets"),
    ("mmcache.server.pipelines", "encoders.tts_presets"),
    ("mmcache.server.speech", "encoders.tts_presets"),
}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "benchmarks" or parts[-1] == "cli":
        return TOP
    if module in PRESET_MODULES or parts[-1].endswith("_presets"):
        return PRESETS
    if module == "mmcache.engine.vlm" or module.startswith("mmcache.server"):
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
    assert layer("encoders.tts_presets") == PRESETS and layer("mmcache.server.app") == HOSTS
    assert layer("mmcache.server.cli") == TOP and layer("benchmarks.core") == TOP
    assert not allowed("mmcache.names", "mmcache.engine.engine")  # the core never imports the engine
    assert not allowed("encoders.vision", "mmcache.engine.tokenizer")  # siblings stay apart
    assert allowed("mmcache.server.app", "encoders.media") and allowed("benchmarks.vlm", "mmcache.server")


def test_no_module_imports_a_layer_above_its_own():
    new = edges_against_the_order() - KNOWN
    assert not new, f"imports against the layer order (DESIGN.md): {sorted(new)}"


def test_the_known_exceptions_are_still_there():
    gone = KNOWN - edges_against_the_order()
    assert not gone, f"these edges are gone: take them out of KNOWN: {sorted(gone)}"
