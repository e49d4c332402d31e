"""CPU fast paths: a decoder's linear layers with weights packed once for oneDNN, gated MLPs fused, each
attention module's query, key and value projections grouped into one product; and an allocator setting that
keeps activation memory mapped between forwards (``tune_malloc``).

``torch.nn.functional.linear`` on CPU lays the weight out for oneDNN's blocked kernels on every call; for the
row counts of a decode or a cached-prefix prefill that copy costs as much as the product. ``pack_linears``
does it once: each ``nn.Linear`` of the decoder layers (and the LM head: ``ComputePath.pack_linears``) becomes a
``PackedLinear`` that keeps its parameters (names, values and ``state_dict`` unchanged) and also holds the
packed copy; a gated MLP (``down(act(gate(x)) * up(x))`` with SiLU or tanh-GELU) runs as three packed
products with the activation and the product fused into them; and the ``q_proj``, ``k_proj`` and ``v_proj``
of an attention module (one input size, all with a bias or none) become ``PackedProjection`` parts of one
``PackedProjections``: one product over their concatenated weights per input tensor, which reads the three
weights in one pass and saves two calls (a few percent of a decode step or a hit, ``benchmarks/projections.py``).
Where the engine asks for it (``ComputeConfig.row_products``), products of a few rows (a decode step's) run on
a compiled kernel instead, from a second copy of the weight laid out for it in the weight's own dtype
(``row_kernel``; ``benchmarks/row_products.py``): on AVX2 builds of the compiled library float32 products of
at most ``native.ROW_PRODUCT_ROWS`` rows (``native.RowWeight``, ``native.linear``), and bfloat16 products of at
most ``native.TILE_PRODUCT_ROWS`` rows on the AMX tile unit where the CPU grants it, else with AVX-512 BF16 where
the CPU has that (``native.TileWeight``, ``native.product_way``).

Invariants:

* The packed copy takes as much memory again as the weights it packs, twice as much for bfloat16 weights
  packed as float32 (``widened``; the engine packs only where that fits, see ``ComputePath.packing_skipped``). It
  is made from the weights as they are when packing; an engine's model is frozen from then on (an in-place
  weight change is not seen by the packed copies). With the row kernel every packed weight has a second copy,
  laid out for it in the weight's own dtype (as many bytes as the weight, for the tile kernel padded to whole
  blocks of 64 columns; counted by ``Engine``'s packing room).
* A fused MLP and grouped projections are installed only after they reproduced the modules' own forward on
  probe inputs (within float rounding); otherwise the linears are packed one by one.
* A group hands a part out from its kept product only for the very tensor object that product was computed
  from, and keeps nothing once every part is out, so no activation outlives its forward.
* Several engines may share one model object, and so these modules, each stepping on its own thread. Every
  module here computes from its arguments and its weights alone; the one thing kept between calls, a group's
  parts, is kept per thread (``threading.local``), so a thread is only ever handed parts of its own input.
* Results are deterministic for a given input shape, like the unpacked path; they differ from it in the
  last bits, so cache-on and cache-off runs must use the same setting (the engine uses one for its life).
  On the row and tile kernels a row's result depends only on that row (any company, any number of threads).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import torch
from torch import nn

from . import native

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


def widened(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` are packed as float32 here: bfloat16 on a CPU where oneDNN has no bfloat16
    path (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU has neither, and there ATen's own
    bfloat16 product runs several times slower than float32)."""
    return dtype == torch.bfloat16 and not _packs(dtype)


def packed_bytes(weight: torch.Tensor) -> int:
    """Bytes of the packed copy of ``weight``."""
    return weight.numel() * (4 if widened(weight.dtype) else weight.element_size())


_PACKS: dict[torch.dtype, bool] = {}


def _packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs a weight of ``dtype`` on this CPU: asked once per process, by packing a small one
    (the operation itself is the test, so no list of CPU features can disagree with it)."""
    if dtype not in _PACKS:
        try:
            _pack(torch.zeros(16, 16, dtype=dtype))
            _PACKS[dtype] = True
        except RuntimeError:
            _PACKS[dtype] = False
    return _PACKS[dtype]


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


#: ``row_kernel``'s kinds for bfloat16 weights on ``native.TileWeight``: its tile unit way and its vector way.
TILE_LAYOUT = (native.PRODUCTS_TILES, native.PRODUCTS_VECTOR)


def row_kernel(lib, dtype: torch.dtype, widen: bool) -> str | None:
    """Which compiled kernel computes a packed weight's products of few rows, given the library the engine
    offers for them (``native.library()``, or None for none): for a bfloat16 weight that oneDNN packs as it is,
    "tiles" where the library can use the AMX tile unit, else "vector" where it has AVX-512 BF16
    (``native.product_way``; both on ``native.TileWeight``); "rows" for a float32 or widened bfloat16 weight
    (the row kernel reads either in its own dtype; the engine offers the library for it on the AVX2 build,
    ``native.row_products``), else None."""
    if lib is None:
        return None
    if dtype == torch.bfloat16 and not widen:
        return native.product_way(lib)
    return "rows"


def row_copy_bytes(weight: torch.Tensor, lib) -> int:
    """Bytes of the copy of ``weight`` that its row kernel reads (see ``row_kernel``), 0 where none; ``lib``
    True asks as if the library offered the row kernel ("rows")."""
    kind = "rows" if lib is True else row_kernel(lib, weight.dtype, widened(weight.dtype))
    if kind in TILE_LAYOUT:
        return int(lib.mmc_tile_elements(*weight.shape)) * weight.element_size()
    return weight.numel() * weight.element_size() if kind else 0


class PackedWeight:
    """A weight (and bias) laid out once for oneDNN, and products with it.

    Where oneDNN computes in the weight's own dtype on this CPU, the copy keeps that dtype. A bfloat16 weight
    on a CPU without oneDNN's bfloat16 path is kept as float32 (``widened``): each product takes its bfloat16
    input widened to float32 (exactly), multiplies and accumulates in float32, as bfloat16 hardware does, and
    rounds the result to bfloat16 once, so the module still takes and returns bfloat16. It differs from ATen's
    bfloat16 product only in the order of the float32 sums."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, widen: bool | None = None,
                 rows=None):
        """``widen``: pack a bfloat16 weight as float32 or not whatever this CPU's oneDNN does (measuring only:
        ``benchmarks/widened_linears.py``); by default as ``widened`` says. ``rows``: the compiled library
        (``native.library()``) to compute products of few rows with (at most ``row_limit``), on the kernel
        ``row_kernel`` names, from a copy of ``weight`` laid out for it in its own dtype; None: oneDNN for every
        product."""
        self.dtype = weight.dtype
        self.widened = widened(weight.dtype) if widen is None else widen and weight.dtype == torch.bfloat16
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
        #: The compiled kernel for products of few rows: "tiles" or "vector" (``native.TileWeight``, bfloat16
        #: weights kept as they are, on the AMX tile unit where the CPU grants it, else with AVX-512 BF16), "rows"
        #: (``native.RowWeight``, float32 weights and widened bfloat16 ones, on the AVX2 build), or None (oneDNN
        #: for every product).
        self.row_kernel = row_kernel(rows, weight.dtype, self.widened)
        self.rows = rows if self.row_kernel else None
        on_tiles = self.row_kernel in TILE_LAYOUT
        #: Products of at most this many rows run on the row kernel.
        self.row_limit = native.TILE_PRODUCT_ROWS if on_tiles else native.ROW_PRODUCT_ROWS
        if on_tiles:  # the bias widened there, kept here as it is
            self.row_weight = native.TileWeight(rows, weight, bias, way=self.row_kernel)
        else:
            if self.widened or self.rows is not None:
                bias = None if bias is None else bias.float()  # both take a float32 bias (no copy when it is one)
            self.row_weight = native.RowWeight(rows, weight, bias) if self.rows is not None else None
        self.packed, self.bias = _pack(weight.float() if self.widened else weight), bias

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as this weight's products take it."""
        return x.float() if self.widened else x

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """A product's result in the module's dtype."""
        return y.to(self.dtype) if self.widened else y

    def on_rows(self, x: torch.Tensor) -> bool:
        """Whether ``product`` of ``x`` runs on the compiled row kernel (few rows, and one was given)."""
        return self.rows is not None and x.numel() <= self.row_limit * x.shape[-1]

    def product(self, x: torch.Tensor, attr: str = "none", algorithm: str = "") -> torch.Tensor:
        """``attr(x @ weight^T + bias)`` on an input already passed through ``input``, not yet ``output``. The
        row kernel takes only ``attr="none"`` (callers check ``on_rows`` and apply their activation)."""
        if attr == "none" and self.on_rows(x):
            return self.row_weight(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, attr, [], algorithm)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.product(self.input(x)))


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` computed from a weight packed once for oneDNN."""

    def __init__(self, linear: nn.Linear, rows=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = PackedWeight(linear.weight, linear.bias, rows=rows)  # a plain attribute: not in state_dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x)


class PackedGatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` as three packed products: act fused into gate, the product into up."""

    def __init__(self, mlp: nn.Module, attr: str, algorithm: str, rows=None):
        super().__init__()
        self.gate_proj = PackedLinear(mlp.gate_proj, rows)
        self.up_proj = PackedLinear(mlp.up_proj, rows)
        self.down_proj = PackedLinear(mlp.down_proj, rows)
        self.act_fn = mlp.act_fn
        self.attr, self.algorithm = attr, algorithm
        #: The library whose activation kernel computes silu(gate) * up on the tile kernel's rows (so each row's
        #: bits depend on that row alone: ``native.silu_mul``), or None: torch's two operations.
        self.native_act = (rows if attr == "swish" and self.gate_proj.packed.row_kernel in TILE_LAYOUT
                           and hasattr(rows, "mmc_silu_mul") else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Widened weights keep the two intermediate activations in float32 (rounded to bfloat16 only at the end).
        gate_w, up_w, down_w = self.gate_proj.packed, self.up_proj.packed, self.down_proj.packed
        x = gate_w.input(x)
        if gate_w.on_rows(x):  # few rows on the row kernel: the activation and the product after it
            if self.native_act is not None:
                hidden = native.silu_mul(self.native_act, gate_w.product(x), up_w.product(x))
            else:
                hidden = self.act_fn(gate_w.product(x)).mul_(up_w.product(x))
        else:
            gate = gate_w.product(x, self.attr, self.algorithm)
            hidden = torch.ops.mkldnn._linear_pointwise.binary(x, gate, up_w.packed, None, "mul")
        return down_w.output(down_w.product(hidden))


class _Kept:
    """What one thread keeps of a ``PackedProjections``: the tensor its product was computed from, the parts not
    handed out yet (None where handed out) and how many remain; nothing (None, (), 0) between forwards."""

    __slots__ = ("x", "parts", "left")

    def __init__(self):
        self.x, self.parts, self.left = None, (), 0


class PackedProjections:
    """The query, key and value projections of one attention module as one packed product over their
    concatenated weights (one weight read and one call instead of three), handed out part by part.

    Attention modules call ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` on one tensor in turn: the first call
    computes all three parts and keeps them; a later call on that same tensor object (``is``, never an equal
    one) returns its kept part; a call on any other tensor computes afresh. The parts are column slices of
    one result (views, rows ``sum(widths)`` apart). The kept parts are dropped once all are handed out.

    The parts are kept per thread (a ``_Kept`` in a ``threading.local``): forwards of engines that share this
    module on other threads neither see nor replace them, and a thread's kept tensor and parts are always read
    from that thread's own record, so they belong together. A plain local holding a slotted record costs about
    a tenth of a microsecond per call more than attributes of the group (a ``threading.local`` subclass with
    class defaults costs several times that)."""

    def __init__(self, linears: list[nn.Linear], rows=None):
        has_bias = linears[0].bias is not None
        self.packed = PackedWeight(torch.cat([m.weight.detach() for m in linears]),
                                   torch.cat([m.bias.detach() for m in linears]) if has_bias else None, rows=rows)
        self.widths = [m.out_features for m in linears]
        self._local = threading.local()

    def _kept(self) -> _Kept:
        """The calling thread's record (made on its first call)."""
        try:
            return self._local.kept
        except AttributeError:
            kept = self._local.kept = _Kept()
            return kept

    @property
    def _x(self) -> torch.Tensor | None:
        """The tensor whose parts the calling thread keeps, or None."""
        return self._kept().x

    @property
    def _parts(self) -> list | tuple:
        """The parts the calling thread keeps (None where handed out), or ``()``."""
        return self._kept().parts

    def part(self, i: int, x: torch.Tensor) -> torch.Tensor:
        try:  # inline ``_kept``: this runs three times per layer and step
            kept = self._local.kept
        except AttributeError:
            kept = self._kept()
        parts = kept.parts
        if kept.x is not x or parts[i] is None:
            parts = kept.parts = list(self.packed(x).split(self.widths, dim=-1))
            kept.x, kept.left = x, len(parts)
        part, parts[i] = parts[i], None
        kept.left -= 1
        if kept.left == 0:
            kept.x, kept.parts = None, ()
        return part


class PackedProjection(PackedLinear):
    """One of the projections of a ``PackedProjections`` (its parameters unchanged, as ``PackedLinear``)."""

    def __init__(self, linear: nn.Linear, group: PackedProjections, index: int):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = None  # the group holds the packed weight
        self.group, self.index = group, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(self.index, x)


PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_PROBE_ROWS = (1, 7, 128)


def _projections(module: nn.Module) -> list[nn.Linear] | None:
    parts = [getattr(module, n, None) for n in PROJECTIONS]
    if not all(type(p) is nn.Linear for p in parts):
        return None
    if len({p.in_features for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
        return None
    return parts


@torch.inference_mode()
def _projections_match(parts: list[nn.Linear], group: PackedProjections) -> bool:
    """Whether the grouped product reproduces each projection's own forward on probes of a few row counts
    (within float rounding: oneDNN may block a wider product differently)."""
    gen = torch.Generator().manual_seed(0)
    w = parts[0].weight
    tol = 1e-4 if w.dtype == torch.float32 else 3e-2
    for rows in _PROBE_ROWS:
        x = torch.randn(rows, parts[0].in_features, generator=gen).to(w.dtype)
        for i, p in enumerate(parts):
            want, got = p(x).float(), group.part(i, x).float()
            if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
                return False
    return True


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


def pack_linears(layers: nn.Module, rows=None) -> None:
    """Pack every ``nn.Linear`` under ``layers``, fusing gated MLPs and grouping each attention module's
    query, key and value projections (idempotent). ``rows``: see ``PackedWeight``."""
    for name, module in list(layers.named_modules()):
        act = _fusable(module)
        if act is not None:
            fused = PackedGatedMLP(module, *act, rows=rows)
            if _fused_matches(module, fused):
                _replace(layers, name, fused)
        parts = _projections(module)
        if parts is not None:
            group = PackedProjections(parts, rows)
            if _projections_match(parts, group):
                for i, (attr, part) in enumerate(zip(PROJECTIONS, parts)):
                    setattr(module, attr, PackedProjection(part, group, i))
    for name, module in list(layers.named_modules()):
        if type(module) is nn.Linear:
            _replace(layers, name, PackedLinear(module, rows))


def count_packed(module: nn.Module) -> int:
    return sum(isinstance(m, PackedLinear) for m in module.modules())


def count_on_rows(module: nn.Module, kind: str | None = None) -> int:
    """Packed linears under ``module`` whose products of few rows run on a compiled kernel (``kind``: only those
    on that one, "rows", "tiles" or "vector"; see ``row_kernel``)."""
    return sum(isinstance(m, PackedLinear) and (m.packed or m.group.packed).rows is not None
               and kind in (None, (m.packed or m.group.packed).row_kernel) for m in module.modules())


def _replace(root: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)
