"""Rotary position embedding on the compiled kernel (``native.rotary``), with the same bits as transformers'.

The Llama family's attention modules call their modeling module's ``apply_rotary_pos_emb(q, k, cos, sin)``,
six tensor operations per tensor (two products, a negation, a concatenation, a sum, the slices). ``install``
points that name, in the modeling module of each attention module under a decoder, at ``NativeRotary``, which
computes the same thing in one pass per row with each operation rounded as torch rounds it.

Invariants:

* The replacement returns the same bits as the function it replaces. Only a function of transformers'
  signature ``(q, k, cos, sin, unsqueeze_dim=1)`` is replaced, and only after the replacement gave its bits
  on probe inputs in float32 and bfloat16 (head sizes whose halves are and are not whole vectors). A call
  the kernel does not take (other dtypes or devices, ``cos`` not (B, T, D), another ``unsqueeze_dim``) goes
  to the original function. So nothing computed changes, for the engine or for any other user of that
  modeling module in the process, and the engine's backend name does not change either.
* It is process-wide and lasts: the name stays pointed at the replacement once installed (``uninstall``
  restores the original, for measurements).
"""

from __future__ import annotations

import ctypes
import inspect
import sys

import torch
from torch import nn

from . import native

NAME = "apply_rotary_pos_emb"


class NativeRotary:
    """``apply_rotary_pos_emb`` of one modeling module, computed by ``native.rotary`` where it can be."""

    def __init__(self, original, lib: ctypes.CDLL):
        self.original = original
        self.lib = lib
        self.__name__ = NAME
        self.__doc__ = original.__doc__

    def __call__(self, q, k, cos, sin, unsqueeze_dim=1):
        if (unsqueeze_dim == 1 and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                and native.rotary_takes(q, cos, sin) and native.rotary_takes(k, cos, sin)):
            return native.rotary_taken(self.lib, q, cos, sin), native.rotary_taken(self.lib, k, cos, sin)
        return self.original(q, k, cos, sin, unsqueeze_dim)


def _probes(head_dim: int):
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator().manual_seed(head_dim)
        q = (torch.randn(1, 5, 3, head_dim, generator=gen) * 4).to(dtype).transpose(1, 2)
        k = torch.randn(1, 5, 2, head_dim, generator=gen).to(dtype).transpose(1, 2)
        cos, sin = (torch.randn(1, 5, head_dim, generator=gen).to(dtype) for _ in range(2))
        yield q, k, cos, sin


@torch.inference_mode()
def _reproduces(original, replacement: NativeRotary, head_dims) -> bool:
    for d in head_dims:
        for q, k, cos, sin in _probes(d):
            want, got = original(q, k, cos, sin), replacement(q, k, cos, sin)
            if not all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(want, got)):
                return False
    return True


def _plain_signature(fn) -> bool:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return params == ["q", "k", "cos", "sin", "unsqueeze_dim"]


def install(root: nn.Module, lib: ctypes.CDLL) -> int:
    """Point ``apply_rotary_pos_emb`` of the modeling module of every attention module under ``root`` at
    ``NativeRotary`` where it reproduces the original (idempotent); returns how many modeling modules use it."""
    done, tried = set(), set()
    for module in root.modules():
        home = sys.modules.get(type(module).__module__)
        fn = getattr(home, NAME, None) if home is not None else None
        if fn is None or home.__name__ in tried or not hasattr(module, "head_dim"):
            continue
        tried.add(home.__name__)
        if isinstance(fn, NativeRotary):
            done.add(home.__name__)
            continue
        replacement = NativeRotary(fn, lib)
        if _plain_signature(fn) and _reproduces(fn, replacement, {16, 6, int(module.head_dim)}):
            setattr(home, NAME, replacement)
            done.add(home.__name__)
    return len(done)


def installed(root: nn.Module) -> int:
    """How many modeling modules of attention modules under ``root`` use ``NativeRotary``."""
    homes = {sys.modules.get(type(m).__module__) for m in root.modules() if hasattr(m, "head_dim")}
    return sum(isinstance(getattr(h, NAME, None), NativeRotary) for h in homes if h is not None)


def uninstall(root: nn.Module) -> None:
    """Point the name back at the original function in the modeling modules of ``root``'s attention modules."""
    for module in root.modules():
        home = sys.modules.get(type(module).__module__)
        fn = getattr(home, NAME, None) if home is not None else None
        if isinstance(fn, NativeRotary):
            setattr(home, NAME, fn.original)
