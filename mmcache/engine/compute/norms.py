"""A decoder's RMSNorms on the compiled kernel (``native.rms_norm``).

The Llama family's RMSNorm module (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``MistralRMSNorm`` and their copies)
computes ``weight * dtype(h * rsqrt(mean(h * h) + eps))`` as seven tensor operations with two float32 copies of
its input; a decoder runs two per layer. At a decode's few rows each call is mostly dispatch, and at a long
prefill the copies are memory traffic (``benchmarks/RESULTS.md``, CPU compute path). ``install`` replaces each
such module with ``NativeRMSNorm``, which makes one pass per row.

Invariants:

* A module is replaced only when its class name ends in ``RMSNorm``, it holds one 1-D float32 or bfloat16
  ``weight`` and a float epsilon and nothing else, and the kernel reproduced its own forward on a probe
  input (to one rounding of the element type). Other formulas (Gemma's ``1 + weight``, a norm that
  multiplies in float32 before rounding) keep their own forward.
* The replacement keeps the module's ``weight`` Parameter (same name, same tensor): ``state_dict`` and tied
  or shared weights are unchanged, and so is the epsilon.
* Inputs the kernel does not take (another dtype than the weight's, another device) run the module's formula
  in torch instead.
* Results may differ from the module's own forward in the last bit of a few elements (the kernel sums the
  squares in its own order), so the engine names the path in its attention backend, and cache-on and
  cache-off runs compared bit for bit must both use it or both not. Engines built on one model object share
  its modules: the first that installs the kernel installs it for all of them.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from . import native

_EPS_NAMES = ("variance_epsilon", "eps")


def _epsilon(module: nn.Module) -> float | None:
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


class NativeRMSNorm(nn.Module):
    """The Llama family's RMSNorm computed by ``native.rms_norm``; holds the replaced module's weight."""

    def __init__(self, norm: nn.Module, lib: ctypes.CDLL):
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = _epsilon(norm)
        self.lib = lib

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if hidden_states.dtype == w.dtype and hidden_states.device.type == "cpu":
            return native.rms_norm(self.lib, hidden_states, w, self.variance_epsilon)
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return w * h.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _candidate(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    params = list(module.parameters(recurse=True))
    return (type(module).__name__.endswith("RMSNorm") and not isinstance(module, NativeRMSNorm)
            and isinstance(weight, nn.Parameter) and weight.dim() == 1
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.device.type == "cpu"
            and len(params) == 1 and not list(module.buffers()) and _epsilon(module) is not None)


@torch.inference_mode()
def _matches(module: nn.Module, native_norm: NativeRMSNorm) -> bool:
    """Whether the kernel reproduces the module's own forward on a probe input, to one rounding of the dtype."""
    w = module.weight
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, w.shape[0], generator=gen) * 3).to(w.dtype)
    want, got = module(x), native_norm(x)
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    ulp = torch.finfo(w.dtype).eps
    return bool(torch.allclose(got.float(), want.float(), rtol=2 * ulp, atol=ulp * float(want.abs().max())))


def install(root: nn.Module, lib: ctypes.CDLL) -> int:
    """Replace every Llama-family RMSNorm under ``root`` with ``NativeRMSNorm`` (idempotent); returns how many
    modules under ``root`` now run on the kernel."""
    for name, module in list(root.named_modules()):
        if name and _candidate(module):
            replacement = NativeRMSNorm(module, lib)
            if _matches(module, replacement):
                parent_name, _, child = name.rpartition(".")
                setattr(root.get_submodule(parent_name) if parent_name else root, child, replacement)
    return count(root)


def count(root: nn.Module) -> int:
    return sum(isinstance(m, NativeRMSNorm) for m in root.modules())
