"""CPU fast paths: a decoder's linear layers with weights packed once for oneDNN, gated MLPs fused; and an
allocator setting that keeps activation memory mapped between forwards (``tune_malloc``).

``torch.nn.functional.linear`` on CPU lays the weight out for oneDNN's blocked kernels on every call; for the
row counts of a decode or a cached-prefix prefill that copy costs as much as the product. ``pack_linears``
does it once: each ``nn.Linear`` of the decoder layers (and the LM head, see the adapter) becomes a ``PackedLinear`` that
keeps its parameters (names, values and ``state_dict`` unchanged) and also holds the packed copy, and a
gated MLP (``down(act(gate(x)) * up(x))`` with SiLU or tanh-GELU) runs as three packed products with the
activation and the product fused into them.

Invariants:

* The packed copy takes as much memory again as the weights it packs (the engine packs only where that fits,
  see ``Engine.packing_skipped``). It is made from the weights as they are when packing; an engine's model is frozen from then
  on (an in-place weight change is not seen by the packed copy).
* A fused MLP is installed only after it reproduced the module's own forward on a probe input; otherwise its
  linears are packed one by one.
* Results are deterministic for a given input shape, like the unpacked path; they differ from it in the
  last bits, so cache-on and cache-off runs must use the same setting (the engine uses one for its life).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch
from torch import nn

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters

_ACTIVATIONS = {"SiLU": ("swish", ""), "SiLUActivation": ("swish", ""), "GELUTanh": ("gelu", "tanh"),
                "PytorchGELUTanh": ("gelu", "tanh")}


def tune_malloc() -> bool:
    """Keep freed activation memory in the process (glibc only); returns whether the allocator took it.

    By default glibc serves each allocation above a few MiB with a fresh ``mmap`` and unmaps it when freed, so
    every prefill forward page-faults (and the kernel zeroes) every large activation again: at 2048 tokens
    that costs as much as a third of the forward. Raising the mmap threshold to its 32 MiB maximum and the
    trim threshold to 1 GiB keeps that memory mapped between forwards. This is process-wide: every later
    allocation of the process is served the same way (other engines in the process benefit alike).
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS, Windows): leave the allocator alone
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and dtype in (torch.float32, torch.bfloat16))


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` computed from a weight packed once for oneDNN."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = _pack(linear.weight)  # a plain attribute: not a parameter, not in state_dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PackedGatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` as three packed products: act fused into gate, the product into up."""

    def __init__(self, mlp: nn.Module, attr: str, algorithm: str):
        super().__init__()
        self.gate_proj = PackedLinear(mlp.gate_proj)
        self.up_proj = PackedLinear(mlp.up_proj)
        self.down_proj = PackedLinear(mlp.down_proj)
        self.act_fn = mlp.act_fn
        self.attr, self.algorithm = attr, algorithm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = torch.ops.mkldnn
        gate = ops._linear_pointwise(x, self.gate_proj.packed, None, self.attr, [], self.algorithm)
        hidden = ops._linear_pointwise.binary(x, gate, self.up_proj.packed, None, "mul")
        return ops._linear_pointwise(hidden, self.down_proj.packed, None, "none", [], "")


def _fusable(mlp: nn.Module) -> tuple[str, str] | None:
    parts = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(p) is nn.Linear and p.bias is None for p in parts):
        return None
    return _ACTIVATIONS.get(type(getattr(mlp, "act_fn", None)).__name__)


@torch.inference_mode()
def _fused_matches(mlp: nn.Module, fused: PackedGatedMLP) -> bool:
    gen = torch.Generator().manual_seed(0)
    w = mlp.gate_proj.weight
    x = torch.randn(3, mlp.gate_proj.in_features, generator=gen).to(w.dtype)
    want, got = mlp(x).float(), fused(x).float()
    tol = 1e-4 if w.dtype == torch.float32 else 3e-2
    return bool(torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())))


def pack_linears(layers: nn.Module) -> None:
    """Pack every ``nn.Linear`` under ``layers``, fusing gated MLPs (idempotent)."""
    for name, module in list(layers.named_modules()):
        act = _fusable(module)
        if act is not None:
            fused = PackedGatedMLP(module, *act)
            if _fused_matches(module, fused):
                _replace(layers, name, fused)
    for name, module in list(layers.named_modules()):
        if type(module) is nn.Linear:
            _replace(layers, name, PackedLinear(module))


def count_packed(module: nn.Module) -> int:
    return sum(isinstance(m, PackedLinear) for m in module.modules())


def _replace(root: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)
