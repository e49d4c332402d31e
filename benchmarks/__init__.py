"""Benchmark definitions run by ``mmcache bench``; recorded figures are in RESULTS.md beside this file.

Each module in ``REGISTRY`` provides:

* ``DESCRIPTION``: one line;
* ``add_arguments(parser)``: its own options (``--json`` and ``--quick`` are added by the runner);
* ``run(args) -> dict``: measures, returns the JSON-ready result (the runner writes it to ``--json``);
* ``table_rows(result) -> list[Row]``: the lines it contributes to the comparison table.
"""

REGISTRY = {
    "core": "benchmarks.core",
    "prefix": "benchmarks.prefix",
    "vlm": "benchmarks.vlm",
    "diffusion": "benchmarks.diffusion",
    "cfg": "benchmarks.cfg",
    "voice": "benchmarks.voice",
    "sampling": "benchmarks.sampling",
    "serve": "benchmarks.serve",
    "tp": "benchmarks.tp",
}
