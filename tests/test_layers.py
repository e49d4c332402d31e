"""The layer order of docs/DESIGN.md, checked on every import of the tree (``ast``, so imports inside functions
count).

Lowest first, each a folder: the core (``mmcache/*.py``); the engine (``mmcache/engine/``), the encoders
(``encoders/``) and replay (``mmcache/replay/``), each on the core only and never on each other; the hosts that
compose an engine with encoders (``mmcache/hosts/``); the HTTP server (``mmcache/server/``), which may use the
hosts; the embedded models (``mmcache/presets/``), which build what the server serves; replicas on Ray Serve
(``mmcache/replicas/``), which serve the server's app from several engines; the command lines (every
``cli`` module, and ``mmcache/launcher/``, what a command does before anything runs) and the benchmarks, which
may import every layer. A module imports only its own layer and those below. The core's imports from outside
the tree are torch, numpy, xxhash and the standard library, nothing else. The test fails on any edge against the
order and on any other third-party import in the core.
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mmcache", "encoders", "benchmarks")

CORE, ENGINE, ENCODERS, REPLAY, HOSTS, SERVER, PRESETS, REPLICAS, TOP = (
    "core", "engine", "encoders", "replay", "hosts", "server", "presets", "replicas", "top")
RANK = {CORE: 0, ENGINE: 1, ENCODERS: 1, REPLAY: 1, HOSTS: 2, SERVER: 3, PRESETS: 4, REPLICAS: 5, TOP: 6}
SIBLINGS = (ENGINE, ENCODERS, REPLAY)  # side by side on the core, never on each other
CORE_THIRD_PARTY = frozenset({"torch", "numpy", "xxhash"})
FOLDERS = (("mmcache.launcher", TOP), ("mmcache.replicas", REPLICAS), ("mmcache.presets", PRESETS),
           ("mmcache.server", SERVER),
           ("mmcache.hosts", HOSTS), ("mmcache.engine", ENGINE), ("mmcache.replay", REPLAY))


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "benchmarks" or parts[-1] == "cli":
        return TOP
    if parts[0] == "encoders":
        return ENCODERS
    for folder, name in FOLDERS:
        if module == folder or module.startswith(folder + "."):
            return name
    return CORE


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def import_names(module: str, source: str, is_package: bool) -> set:
    """Every module name ``module``'s source imports, relative imports made absolute; for ``from a import b`` both
    ``a`` and ``a.b`` (``b`` may be a module or a name in ``a``)."""
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def allowed(source: str, target: str) -> bool:
    a, b = layer(source), layer(target)
    if a == b:
        return True
    if a in SIBLINGS and b in SIBLINGS:
        return False
    return RANK[b] < RANK[a]


def edges_against_the_order(module: str, source: str, is_package: bool, known: set) -> set:
    """The edges from ``module`` to the tree's modules (``known``) that the layer order forbids."""
    targets = {n for n in import_names(module, source, is_package) if n in known and n != module}
    return {(module, t) for t in targets if not allowed(module, t)}


def foreign_imports(module: str, source: str, is_package: bool) -> set:
    """The third-party packages a core module imports beyond torch, numpy and xxhash; empty above the core."""
    if layer(module) != CORE:
        return set()
    tops = {n.split(".")[0] for n in import_names(module, source, is_package)}
    return {t for t in tops if t not in sys.stdlib_module_names and t not in PACKAGES and t not in CORE_THIRD_PARTY}


def tree() -> list[tuple[str, str, bool]]:
    return [(m, p.read_text(encoding="utf-8"), p.name == "__init__.py") for m, p in modules().items()]


def test_the_layer_rule_reads_as_intended():
    assert layer("mmcache.names") == CORE and layer("mmcache.engine.compute.native") == ENGINE
    assert layer("mmcache.presets.tts") == PRESETS and layer("mmcache.server.app") == SERVER
    assert layer("mmcache.hosts.vlm") == HOSTS and layer("encoders.voice") == ENCODERS
    assert layer("mmcache.server.cli") == TOP and layer("benchmarks.core") == TOP
    assert layer("mmcache.launcher.openmp") == TOP and layer("mmcache.presets.tokenizer") == PRESETS
    assert layer("mmcache.serverless") == CORE  # a folder's name is matched whole, not as a prefix
    assert not allowed("mmcache.names", "mmcache.engine.engine")  # the core never imports the engine
    assert not allowed("encoders.vision", "mmcache.engine.models")  # siblings stay apart
    assert allowed("mmcache.server.app", "encoders.media") and allowed("benchmarks.vlm", "mmcache.server")
    assert allowed("mmcache.server.prompts", "mmcache.hosts.vlm")  # the server serves what the hosts compose
    assert not allowed("mmcache.hosts.vlm", "mmcache.server.app")  # and the hosts never reach up to it
    assert allowed("mmcache.presets.serving", "mmcache.server.launch")  # presets build what the server serves
    assert not allowed("mmcache.server.launch", "mmcache.presets.vlm")  # and the server never builds a preset
    assert allowed("mmcache.cli", "mmcache.launcher.openmp")  # a command line uses the launcher
    assert not allowed("mmcache.engine.engine", "mmcache.launcher.openmp")  # the library never does


def test_a_host_that_imports_the_server_is_caught():
    known = set(modules()) | {"mmcache.hosts.probe"}
    for source in ("from ..server.app import create_app\n", "import mmcache.server.launch\n",
                   "def later():\n    from mmcache.server import intake\n"):
        found = edges_against_the_order("mmcache.hosts.probe", source, False, known)
        assert found and all(t.startswith("mmcache.server") for _, t in found), source
    assert not edges_against_the_order("mmcache.hosts.probe", "from ..engine.engine import Engine\n", False, known)


def test_a_new_third_party_import_in_the_core_is_caught():
    for source, package in (("import requests\n", "requests"), ("from transformers import AutoModel\n",
                                                               "transformers"),
                            ("def later():\n    import fastapi.responses\n", "fastapi")):
        assert foreign_imports("mmcache.probe", source, False) == {package}, source
    allowed_source = "import os\nimport numpy.linalg\nfrom torch import nn\nimport xxhash\nfrom .names import Namer\n"
    assert foreign_imports("mmcache.probe", allowed_source, False) == set()
    assert foreign_imports("mmcache.engine.probe", "import transformers\n", False) == set()  # above the core


def test_no_module_imports_a_layer_above_its_own():
    known = set(modules())
    found = set().union(*(edges_against_the_order(m, s, pkg, known) for m, s, pkg in tree()))
    assert not found, f"imports against the layer order (docs/DESIGN.md): {sorted(found)}"


def test_the_core_imports_only_torch_numpy_xxhash_and_the_standard_library():
    found = {m: sorted(f) for m, s, pkg in tree() if (f := foreign_imports(m, s, pkg))}
    assert not found, f"third-party imports in the core (docs/DESIGN.md): {found}"


def test_the_hosts_are_a_package():
    assert (ROOT / "mmcache" / "hosts" / "__init__.py").is_file()


def test_every_pointer_to_the_design_names_the_repositorys_own():
    design = ROOT / "docs" / "DESIGN.md"
    headings = {line.lstrip("#").strip() for line in design.read_text(encoding="utf-8").splitlines()
                if line.startswith("## ")}
    for module, source, _ in tree():
        for line in source.splitlines():
            assert "shared folder" not in line, f"{module} points outside the repository: {line.strip()}"
            if "DESIGN.md" in line:
                assert "docs/DESIGN.md" in line, f"{module} names a design other than docs/DESIGN.md: {line.strip()}"
    assert {"Layers", "Names, and what a hit verifies", "Digests and salts", "Eviction", "Replica choice",
            "The RFC's phases"} <= headings  # the sections the docstrings name
