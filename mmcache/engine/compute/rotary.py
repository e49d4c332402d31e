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
* A wrapped function is replaced inside its wrapper. transformers 5.x (with the ``kernels`` package it
  requires) binds the name to a ``torch.nn.Module`` whose class forward calls the plain function it closes
  over, unless the calling attention module was kernelized with a hub kernel (whose private copy of the
  wrapper then runs that kernel instead). The replacement takes the plain function's place in that closure,
  so the name, the wrapper, its dispatch to hub kernels and its pickling stay as they are. A value of another
  kind is left alone (``skipped`` says why).
* It is process-wide and lasts: the name stays pointed at the replacement once installed (``uninstall``
  restores the original, for measurements).
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import sys

import torch
from torch import nn

from . import native

NAME = "apply_rotary_pos_emb"
_log = logging.getLogger("mmcache.engine.compute.rotary")
_skipped: dict[str, str] = {}  # modeling module name -> why ``install`` left its function alone (last try)


class NativeRotary:
    """``apply_rotary_pos_emb`` of one modeling module, computed by ``native.rotary`` where it can be."""

    def __init__(self, original, lib: ctypes.CDLL):
        self.original = original
        self.lib = lib
        # It answers for the original: the wrapper of the kernels package pickles itself by the module and
        # name of the function it holds, and introspection finds the original's signature.
        self.__name__, self.__qualname__ = NAME, getattr(original, "__qualname__", NAME)
        self.__module__ = getattr(original, "__module__", __name__)
        self.__doc__ = original.__doc__
        self.__wrapped__ = original

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


class _Slot:
    """Where a modeling module's function lives: the module's attribute ``NAME``, or, where that holds a wrapper
    of the ``kernels`` package, the cell of the wrapper class's forward that holds the function."""

    def __init__(self, home, cell=None):
        self.home, self.cell = home, cell

    def get(self):
        return getattr(self.home, NAME) if self.cell is None else self.cell.cell_contents

    def set(self, fn) -> None:
        if self.cell is None:
            setattr(self.home, NAME, fn)
        else:
            self.cell.cell_contents = fn


def _held(value) -> bool:
    return isinstance(value, NativeRotary) or (inspect.isfunction(value) and value.__name__ == NAME)


def _function_cell(wrapper: nn.Module):
    """The one cell of the wrapper class's forward that holds the function (or its replacement), or None."""
    cells = []
    for cell in getattr(type(wrapper).forward, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if _held(value):
            cells.append(cell)
    return cells[0] if len(cells) == 1 else None


def _slot(home) -> tuple[_Slot | None, str | None]:
    """Where ``home``'s function lives, and None; or None and why it cannot be replaced there."""
    value = getattr(home, NAME)
    if inspect.isfunction(value) or isinstance(value, NativeRotary):
        return _Slot(home), None
    if not (isinstance(value, nn.Module) and hasattr(value, "kernel_layer_name")):
        return None, f"{NAME} is a {type(value).__qualname__}, neither a function nor a known wrapper"
    cell = _function_cell(value)
    if cell is None:
        return None, f"{NAME} is wrapped ({type(value).__qualname__}) around no single function found"
    return _Slot(home, cell), None


def _homes(root: nn.Module) -> dict:
    """The modeling modules (by name) of the attention modules under ``root`` that define ``NAME``, each with
    the head size of its first attention module."""
    homes = {}
    for module in root.modules():
        home = sys.modules.get(type(module).__module__)
        if home is not None and hasattr(module, "head_dim") and hasattr(home, NAME):
            homes.setdefault(home.__name__, (home, int(module.head_dim)))
    return homes


def install(root: nn.Module, lib: ctypes.CDLL) -> int:
    """Replace ``apply_rotary_pos_emb`` of the modeling module of every attention module under ``root`` with
    ``NativeRotary`` where it reproduces the original (idempotent; inside a wrapper, see the module docstring);
    returns how many modeling modules use it. Logs, once per modeling module and reason, why one was left
    alone (``skipped``)."""
    done = 0
    for name, (home, head_dim) in _homes(root).items():
        why = _replace(home, lib, head_dim)
        if why is None:
            done += 1
            _skipped.pop(name, None)
        elif _skipped.get(name) != why:
            _skipped[name] = why
            _log.info("rotary embedding of %s stays transformers' own: %s", name, why)
    return done


def _replace(home, lib: ctypes.CDLL, head_dim: int) -> str | None:
    """Put a replacement in the slot of ``home``'s function; None when done (or already), else why not."""
    slot, why = _slot(home)
    if slot is None:
        return why
    current = slot.get()
    if isinstance(current, NativeRotary):
        return None
    if not _plain_signature(current):
        return f"{NAME} has another signature than (q, k, cos, sin, unsqueeze_dim)"
    candidate = NativeRotary(current, lib)
    if not _reproduces(current, candidate, {16, 6, head_dim}):
        return "the kernel does not give its bits on the probe inputs"
    slot.set(candidate)
    return None


def replacement(home) -> NativeRotary | None:
    """The ``NativeRotary`` in place in modeling module ``home`` (its attribute, or inside its wrapper), or
    None."""
    slot, _ = _slot(home) if hasattr(home, NAME) else (None, None)
    current = slot.get() if slot is not None else None
    return current if isinstance(current, NativeRotary) else None


def skipped(root: nn.Module) -> dict[str, str]:
    """Why ``install`` left alone the function of each modeling module of ``root``'s attention modules that
    does not use ``NativeRotary``, by module name (modules ``install`` has not tried are absent)."""
    return {name: _skipped[name] for name, (home, _) in sorted(_homes(root).items())
            if name in _skipped and replacement(home) is None}


def installed(root: nn.Module) -> int:
    """How many modeling modules of attention modules under ``root`` use ``NativeRotary``."""
    return sum(replacement(home) is not None for home, _ in _homes(root).values())


def uninstall(root: nn.Module) -> None:
    """Put the original function back in the modeling modules of ``root``'s attention modules."""
    for home, _ in _homes(root).values():
        slot, _ = _slot(home)
        current = slot.get() if slot is not None else None
        if isinstance(current, NativeRotary):
            slot.set(current.original)
