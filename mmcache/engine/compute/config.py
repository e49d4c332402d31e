"""The compute path's speed-only settings: ``ComputeConfig``, one field of ``EngineConfig`` (``compute``).

Invariants (checked at construction, ``ComputeConfigError`` otherwise):

* Every field is a bool. None of them changes what the cache reuses or when; packed linears, the row and
  tile kernels, the compiled norms and the chunk kernel change the last bits of results, so the path taken is
  named in the fingerprint's backend (``ComputePath.backend``; the compiled rotary embedding keeps every bit).
* ``row_products`` acts only with ``packed_linears`` (the row kernel reads a packed weight's second copy).
* ``whole_hits`` is taken only where the forward gives each row the same bits whatever else it computes
  (``ComputePath.whole_hit_blocker``), so a hit's logits stay equal to the exact schedule's.
* ``ComputeConfig.aten()`` turns everything off: plain ATen modules, no compiled kernel (``settings``), no
  process-wide allocator setting.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import MmcacheError
from .settings import ComputeSettings

FLAGS = ("packed_linears", "row_products", "layer_kernels", "tune_malloc", "whole_hits")


class ComputeConfigError(MmcacheError, ValueError):
    """A compute setting is not what it takes."""


@dataclass(frozen=True)
class ComputeConfig:
    packed_linears: bool = True  # pack the decoder's linear weights once for oneDNN (CPU, where memory allows)
    row_products: bool = True  # packed linears' products of few rows on a compiled kernel: the row kernel on the
    #                            AVX2 build, bfloat16 ones on the tile kernel where the CPU has AMX or AVX-512 BF16
    #                            (kernels.PackedWeight, native.row_products, native.product_way); needs
    #                            packed_linears
    layer_kernels: bool = True  # RMSNorms and rotary embedding on the compiled kernels (norms, rotary)
    tune_malloc: bool = True  # process-wide glibc setting that keeps activations mapped (kernels.tune_malloc)
    whole_hits: bool = True  # a prompt cached whole computes only its last token again, where that is exact
    settings: ComputeSettings | None = None  # where the compiled kernels come from; None: the environment's

    def __post_init__(self):
        for name in FLAGS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ComputeConfigError(f"{name} must be a bool, got {value!r}")
        if self.settings is not None and not isinstance(self.settings, ComputeSettings):
            raise ComputeConfigError(f"settings must be a ComputeSettings or None, got {self.settings!r}")

    @classmethod
    def aten(cls) -> ComputeConfig:
        """Plain ATen: the model's own modules, no compiled kernel, no allocator setting, no whole hits."""
        return cls(**dict.fromkeys(FLAGS, False), settings=ComputeSettings(native="off"))
