"""The README's Python examples run as written, from the project root, and print what their comments say.

Every ```python block of README.md is run in one fresh interpreter (each block in its own namespace, in order;
one interpreter so that torch and transformers are imported once). A ``print(...)  # VALUE: why`` line states
the line it prints: the k-th print of a block writes the k-th line of that block's output. A block that says it
runs under ``torchrun --nproc-per-node N`` runs so instead, on its own.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "----- mmcache readme block -----"
_DRIVER = f"""
import sys
for source in sys.argv[1:]:
    print({MARK!r}, flush=True)
    exec(compile(source, "README.md", "exec"), {{"__name__": "__readme__"}})
    sys.stdout.flush()
"""
_STATED = re.compile(r"^\s*print\(.*\)\s+#\s*([^:#]+?)\s*:")
_TORCHRUN = re.compile(r"torchrun --nproc-per-node (\d+)")


def readme_blocks(torchrun: bool = False) -> list[str]:
    """The README's Python blocks: those for one interpreter, or (``torchrun``) those run under torchrun."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S | re.M)
    return [b for b in blocks if bool(_TORCHRUN.search(b)) == torchrun]


def stated_lines(block: str) -> list[str | None]:
    """For each print of ``block`` in order, the line its comment states, or None where it states none."""
    return [(m.group(1) if (m := _STATED.match(line)) else None)
            for line in block.splitlines() if line.lstrip().startswith("print(")]


def test_the_readme_statements_are_read_as_intended():
    blocks = readme_blocks()
    assert len(blocks) >= 5  # the core, engine, VLM, diffusion and voice examples
    assert stated_lines("x = 1\nprint(a.b)   # 1920: every full page\nprint(c)\nprint(d, e)  # 1 1: once") \
        == ["1920", None, "1 1"]
    assert sum(s is not None for b in blocks for s in stated_lines(b)) >= 3


def test_the_readme_torchrun_examples_run_on_their_ranks(tmp_path):
    blocks = readme_blocks(torchrun=True)
    assert blocks  # the tensor-parallel example
    for i, block in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(block)
        ranks = _TORCHRUN.search(block).group(1)
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={ranks}", str(script)], cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        printed = run.stdout.splitlines()
        assert len(printed) == len(stated_lines(block)), run.stdout  # rank 0 prints; the others follow
        assert all(want is None or got == want for want, got in zip(stated_lines(block), printed)), run.stdout


def test_the_readme_examples_run_and_print_what_they_state():
    blocks = readme_blocks()
    run = subprocess.run([sys.executable, "-c", _DRIVER, *blocks], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    outputs = run.stdout.split(MARK + "\n")[1:]
    assert len(outputs) == len(blocks), run.stdout[-2000:]
    for block, output in zip(blocks, outputs):
        printed = output.splitlines()
        stated = stated_lines(block)
        assert len(printed) == len(stated), (block, output)
        for want, got in zip(stated, printed):
            if want is not None:
                assert got == want, (block, output)
