"""Make torchvision importable in vLLM's CPU peer environment without any of its compiled operators, so that
vLLM's server can serve LLaVA and Qwen2-VL folders. Run it with the peer's interpreter, once per environment
(running it again changes nothing)::

    $VLLM_PEER_PYTHON benchmarks/peers/torchvision_python_only.py

Why: vLLM 0.32's ``llava`` model module imports its ``pixtral`` module, which imports transformers' Pixtral
image processor, and its ``qwen2_vl`` module imports transformers' Qwen2-VL image processor; both import
``torchvision.transforms.v2`` at module level. The peer environment's torch is the CPU build, and PyPI's
torchvision wheel for it is a CUDA build: its ``_C.so`` and ``image.so`` need ``libc10_cuda.so`` and
``libtorch_cuda.so``, so loading them fails. torchvision catches that failure (``extension._has_ops()`` is then
False, and every registration of its own operators is skipped) except in two places of
``torchvision/_meta_registrations.py``: the fake kernels of ``torchvision::nms`` and ``torchvision::qnms`` are
registered unconditionally, and registering a kernel for an operator that was never defined raises
"operator torchvision::nms does not exist", so ``import torchvision`` fails.

What it does, exactly:

1. Installs PyPI's torchvision release that matches the environment's torch (``MATCHING``), with
   ``pip install --no-deps``, so that no other package is added, removed or changed. Skipped when that release
   is already installed.
2. Edits one installed file, ``torchvision/_meta_registrations.py``: the two decorators
   ``@torch.library.register_fake("torchvision::nms")`` and ``("torchvision::qnms")`` apply only when
   ``torchvision.extension._has_ops()`` is true, the condition torchvision already puts on every other
   registration in that file. Each edited line ends with the comment ``MARK``; a file that has it is left alone.
   Nothing else is edited; ``pip install --force-reinstall --no-deps torchvision==VERSION`` restores the file.
3. Checks, in a fresh interpreter, that torchvision imports and that transformers' Pixtral and Qwen2-VL image processor modules import; prints
   what it found as one JSON line, ``compiled_ops`` saying whether any compiled torchvision operator loaded
   (False in the peer environment: the argument below rests on it).

Why nothing vLLM computes changes: no compiled torchvision code is loaded (step 3 reports it), so torchvision
adds only Python code that calls torch. vLLM's model code (the CLIP and Qwen2-VL towers, the language models)
does not use torchvision. Image preprocessing is the one place where torchvision's Python code could run:
transformers picks its torchvision backend for image processors when torchvision imports. Start vLLM with
``--mm-processor-kwargs '{"backend": "pil"}'`` (``vllm_server.VllmOpenAIServer`` does so for a VLM) and the
image processor is the PIL one, which uses no torchvision at all and is the one mmcache uses.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

MATCHING = {"2.13": "0.28.0", "2.14": "0.29.1"}  # torch major.minor -> the torchvision release built with it
MARK = "# mmcache: torchvision_python_only"
FAKE_KERNELS = ("torchvision::nms", "torchvision::qnms")
CHECK = """
import json, torchvision, torchvision.extension
from torchvision.transforms.v2 import functional
import transformers.models.pixtral.image_processing_pixtral
import transformers.models.qwen2_vl.image_processing_qwen2_vl
print(json.dumps({"torchvision": torchvision.__version__, "compiled_ops": torchvision.extension._has_ops()}))
"""


class PeerSetupError(RuntimeError):
    """The environment is not one this script knows how to fix; the message says why."""


def matching_torchvision() -> str:
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise PeerSetupError(f"{sys.executable} has no torch: run this with vLLM's peer interpreter "
                             f"($VLLM_PEER_PYTHON)") from None
    key = ".".join(torch_version.split("+")[0].split(".")[:2])
    if key not in MATCHING:
        raise PeerSetupError(f"torch {torch_version}: no matching torchvision release is known here "
                             f"(known: torch {', '.join(MATCHING)})")
    return MATCHING[key]


def installed_torchvision() -> str | None:
    try:
        return importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        return None


def install(version: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", f"torchvision=={version}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PeerSetupError(f"{' '.join(cmd)} failed with {done.returncode}:\n{done.stderr[-2000:]}")


def registrations_file() -> Path:
    spec = importlib.util.find_spec("torchvision")  # finds the package without importing it
    if spec is None or spec.origin is None:
        raise PeerSetupError("torchvision is not installed where this interpreter looks")
    return Path(spec.origin).with_name("_meta_registrations.py")


def patch(path: Path) -> bool:
    """Gate the fake kernels of ``FAKE_KERNELS`` on ``_has_ops()``; False when the file already was."""
    text = path.read_text(encoding="utf-8")
    if MARK in text:
        return False
    for op in FAKE_KERNELS:
        line = f'@torch.library.register_fake("{op}")\n'
        if text.count(line) != 1:
            raise PeerSetupError(f"{path} does not hold the line {line.strip()!r} once; this torchvision is laid "
                                 f"out differently from the release this script knows")
        gated = (f'@(torch.library.register_fake("{op}") if torchvision.extension._has_ops() else (lambda fn: fn))'
                 f"  {MARK}\n")
        text = text.replace(line, gated)
    path.write_text(text, encoding="utf-8")
    return True


def check() -> dict:
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    if done.returncode != 0:
        raise PeerSetupError(f"torchvision still does not import:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    try:
        version = matching_torchvision()
        before = installed_torchvision()
        if before != version:
            install(version)
        path = registrations_file()
        edited = patch(path)
        found = check()
    except PeerSetupError as e:
        print(f"torchvision_python_only: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"installed": before != version, "edited": str(path) if edited else None, **found}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
