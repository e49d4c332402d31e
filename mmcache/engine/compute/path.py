"""``ComputePath``: what a model computes with on this CPU, decided once per model object, and its name.

Given the engine's adapter (where the model's decoder and head live) and a ``ComputeConfig``, it decides what
runs: packed linears (``kernels``), products of few rows on the row or tile kernel (``native``), decode and
chunk attention on the compiled kernels, the compiled norms and rotary embedding (``norms``, ``rotary``) and
whole hits; applies that to the model; and names the backend. Invariants:

* The first engine on a model object sets its modules up (``set_up``); a later one with the same requests
  computes with what is there and one with others raises ``ComputeConfigError`` before changing anything
  (replaced modules change the last bits of every engine's results on that model).
* The packed copy (and the row kernel's copy) is made only where it fits beside the KV pool in
  ``PACKING_HEADROOM`` of available memory; ``packing_skipped`` / ``row_products_skipped`` say why not.
* ``backend`` names every choice that changes a result's bits, so pages written under one path are never
  served under another. ``ComputeConfig.aten()`` gives ``attention.ATTENTION_BACKEND`` alone.
"""

from __future__ import annotations

import logging

import torch

from .. import attention, memory  # the module, not its names: attention imports this package's kernels
from . import kernels, native, norms, rotary
from .config import ComputeConfig, ComputeConfigError
from .settings import ComputeSettings

PATH_ATTR = "_mmcache_compute_path"  # set on a model by the first engine that sets up its modules
PACKING_HEADROOM = 0.9  # pack only when the packed copy and the KV pool fit in this share of available memory
# The chunk kernel's two ways differ in the last bits (their sums run in other orders), so each names the backend.
_CHUNK_SUFFIX = {native.CHUNK_TILES: "+native-chunk", native.CHUNK_VECTOR: "+native-chunk-vector",
                 native.CHUNK_NONE: ""}
_log = logging.getLogger("mmcache.engine")


class ComputePath:
    """The compute path of one engine's model. ``decode_kernel``: the compiled library the engine's attention
    uses (None: ATen). After ``set_up``: ``packing_skipped``, ``row_products_skipped`` and ``backend``."""

    def __init__(self, adapter, config: ComputeConfig | None = None):
        self.adapter = adapter
        self.config = config = config or ComputeConfig()
        self.settings = config.settings or ComputeSettings.from_env()
        self.decode_kernel = native.library(self.settings) if adapter.device.type == "cpu" else None
        #: Why the linears were left unpacked although ``packed_linears`` asked for them, or None.
        self.packing_skipped: str | None = None
        #: Why the row kernel's copies were left out although ``row_products`` asked for them (they did not fit
        #: beside the packed copy and the KV pool; the packed copy alone did), or None.
        self.row_products_skipped: str | None = None

    # ---- deciding and applying ---------------------------------------------------------------------
    def requested(self) -> dict:
        """What this engine would install: packed linears, products of few rows on a kernel, layer kernels."""
        a, lib = self.adapter, self.decode_kernel
        packs = self.config.packed_linears and kernels.available(a.device, a.dtype)
        return {"packed_linears": packs, "layer_kernels": self.config.layer_kernels and lib is not None,
                "row_products": self._row_library(packs) is not None}

    def _row_library(self, packs: bool):
        """The library offered for products of few rows (the AVX2 build's row kernel, or bfloat16 on the tile
        kernel's ways), or None."""
        lib = self.decode_kernel
        offers = (native.row_products(lib)
                  or kernels.row_kernel(lib, self.adapter.dtype, kernels.widened(self.adapter.dtype))
                  in kernels.TILE_LAYOUT)
        return lib if packs and self.config.row_products and offers else None

    def set_up(self, pool_bytes: int) -> None:
        """Apply the path to the model (first engine on it) or adopt the first engine's (``claim``), beside a
        KV pool of ``pool_bytes``; then the process-wide allocator setting where asked."""
        requested = self.requested()
        held = self.claim(requested)
        if held is not None:
            self.packing_skipped, self.row_products_skipped = held["packing_skipped"], held["row_products_skipped"]
        else:
            if requested["packed_linears"]:
                self._pack_where_it_fits(self._row_library(True), pool_bytes)
                self._record()
            if requested["layer_kernels"]:
                self.install_layer_kernels()
        if self.config.tune_malloc:
            kernels.tune_malloc()

    def _pack_where_it_fits(self, rows, pool: int) -> None:
        """Pack with the row kernel's copies where both fit; without them where only the packed copy does;
        else leave the linears plain and say why."""
        self.packing_skipped = packing_room(self.bytes_to_pack(rows), pool)
        if self.packing_skipped and rows is not None and packing_room(self.bytes_to_pack(), pool) is None:
            self.row_products_skipped, self.packing_skipped, rows = self.packing_skipped, None, None
            _log.warning("row kernel left out (packed linears alone fit): %s", self.row_products_skipped)
        if self.packing_skipped is None:
            self.pack_linears(rows)
        else:
            _log.warning("linears left unpacked: %s", self.packing_skipped)

    def claim(self, requested: dict) -> dict | None:
        """Fix the modules this model computes with before any is replaced: None for the first engine on the
        model (it installs, then records what it decided), or the first engine's record for a later one with
        the same requests; ``ComputeConfigError`` for one with other requests, before anything changes."""
        model = self.adapter.model
        held = getattr(model, PATH_ATTR, None)
        if held is None:
            setattr(model, PATH_ATTR, {"requested": dict(requested), "packing_skipped": None,
                                       "row_products_skipped": None})
            return None
        if held["requested"] != requested:
            differ = ", ".join(f"{k}: {held['requested'][k]} there, {requested[k]} here" for k in requested
                               if held["requested"].get(k) != requested[k])
            raise ComputeConfigError(
                f"this {type(model).__name__} object already serves an engine that computes with other "
                f"modules ({differ}); an engine replaces the model's modules in place, so build this one on "
                f"another model object (load the model again, or take copy.deepcopy(model) before the first "
                f"engine is built on it: a model with replaced modules cannot be copied) or with the same "
                f"packed_linears, row_products and layer_kernels")
        return held

    def _record(self) -> None:
        held = getattr(self.adapter.model, PATH_ATTR)
        held["packing_skipped"], held["row_products_skipped"] = self.packing_skipped, self.row_products_skipped

    def bytes_to_pack(self, rows=None) -> int:
        """Bytes of the packed copies ``pack_linears`` would add (the plain weights stay): every linear of the
        decoder layers and the head not packed yet; with ``rows`` (the library offered for products of few rows,
        or True for the row kernel), also each of those weights once more as its row kernel reads it."""
        decoder = self.adapter.decoder
        plain = [m for m in getattr(decoder, "layers", decoder).modules() if type(m) is torch.nn.Linear]
        if type(self.adapter.lm_head) is torch.nn.Linear:
            plain.append(self.adapter.lm_head)
        return sum(kernels.packed_bytes(m.weight) + (kernels.row_copy_bytes(m.weight, rows) if rows else 0)
                   for m in plain)

    def pack_linears(self, rows=None) -> None:
        """Pack the decoder's linears and the LM head for oneDNN where available; ``rows``: the compiled library
        for products of few rows (``kernels.PackedWeight``), or None."""
        a = self.adapter
        if not kernels.available(a.device, a.dtype):
            return
        kernels.pack_linears(getattr(a.decoder, "layers", a.decoder), rows)
        head = a.lm_head
        if type(head) is torch.nn.Linear:
            # The packed module keeps the head's Parameter, so a head tied to the embeddings stays tied.
            a.model.set_output_embeddings(kernels.PackedLinear(head, rows))

    def install_layer_kernels(self) -> None:
        """The decoder's Llama-family RMSNorms on the compiled kernel (``norms``), and its rotary embedding
        (same bits; ``rotary``)."""
        if self.adapter.device.type == "cpu":
            norms.install(self.adapter.decoder, self.decode_kernel)
            rotary.install(self.adapter.decoder, self.decode_kernel)

    # ---- what runs ---------------------------------------------------------------------------------
    @property
    def num_packed_linears(self) -> int:
        """Linears of the decoder and head computed from packed weights (also when packed by another engine)."""
        return kernels.count_packed(self.adapter.decoder) + isinstance(self.adapter.lm_head, kernels.PackedLinear)

    @property
    def num_row_product_linears(self) -> int:
        """Packed linears of the decoder and head whose products of few rows run on a compiled kernel."""
        head = self.adapter.lm_head
        return kernels.count_on_rows(self.adapter.decoder) + (isinstance(head, kernels.PackedLinear)
                                                              and head.packed.rows is not None)

    def num_tile_product_linears(self, way: str = native.PRODUCTS_TILES) -> int:
        """Those of them on the tile kernel (``native.TileWeight``) by its ``way``: the tile unit, or the vector
        way (``native.PRODUCTS_VECTOR``)."""
        head = self.adapter.lm_head
        return kernels.count_on_rows(self.adapter.decoder, way) + (isinstance(head, kernels.PackedLinear)
                                                                   and head.packed.row_kernel == way)

    @property
    def num_native_norms(self) -> int:
        """RMSNorms of the decoder computed by the compiled kernel (also when installed by another engine)."""
        return norms.count(self.adapter.decoder)

    def chunk_way(self) -> str | None:
        """How a bfloat16 prefill chunk's attention runs (``native.chunk_way``); None for other dtypes."""
        if self.adapter.dtype != torch.bfloat16:
            return native.CHUNK_NONE
        return native.chunk_way(self.decode_kernel, self.adapter.head_dim)

    @property
    def backend(self) -> str:
        """The attention backend's name with every choice that changes the last bits of a result: packed (and
        widened) linears, products of few rows on each kernel, decode and chunk attention, compiled norms."""
        return (attention.ATTENTION_BACKEND + self._linears_suffix()
                + ("+native-decode" if self.decode_kernel is not None else "")
                + _CHUNK_SUFFIX[self.chunk_way()]
                + ("+native-norm" if self.num_native_norms else ""))

    def _linears_suffix(self) -> str:
        if not self.num_packed_linears:
            return ""
        name = "+onednn-packed" + ("-f32" if kernels.widened(self.adapter.dtype) else "")
        tiles, vector = self.num_tile_product_linears(), self.num_tile_product_linears(native.PRODUCTS_VECTOR)
        name += "+native-rows" if self.num_row_product_linears > tiles + vector else ""
        return name + ("+native-tile-rows" if tiles else "") + ("+native-vector-rows" if vector else "")

    # ---- whole hits --------------------------------------------------------------------------------
    def whole_hits(self, page_size: int, cache_on: bool) -> tuple[bool, str | None]:
        """Whether whole hits are taken, and why not where ``ComputeConfig.whole_hits`` asked for them (None
        where taken or not asked for, or where the cache is not on)."""
        if not (self.config.whole_hits and cache_on):
            return False, None
        why = self.whole_hit_blocker(page_size)
        return why is None, why

    def whole_hit_blocker(self, page_size: int) -> str | None:
        """Why this model's forward could give a row other bits than the same row computed alone, or None.

        A whole hit computes a prompt's last token again in a forward of one row, where the exact schedule
        computed it in a chunk of up to ``page_size`` rows; its logits are the same bits only where every
        operation gives each row what it would give it alone: products on the tile kernel (up to
        ``native.TILE_PRODUCT_ROWS`` rows, all on one of its ways), attention on the chunk kernel, every norm on
        the compiled kernel, the gated MLPs' activation on the activation kernel (``native.silu_mul``), and no
        sliding window. The rest of the forward is element by element. Checked on the modules as installed."""
        a = self.adapter
        if self.decode_kernel is None or a.device.type != "cpu":
            return "no compiled library for the CPU"
        if a.dtype != torch.bfloat16:
            return f"{a.dtype} products run on oneDNN, whose bits depend on the number of rows"
        if page_size > native.TILE_PRODUCT_ROWS:
            return f"page_size {page_size} is more rows than the tile kernel takes ({native.TILE_PRODUCT_ROWS})"
        if self.chunk_way() is native.CHUNK_NONE:
            return f"attention of head size {a.head_dim} does not run on the chunk kernel here"
        if any(w is not None for w in a.layer_windows):
            return "sliding-window attention"
        return self._module_blocker()

    def _module_blocker(self) -> str | None:
        """Which installed module of the decoder or head is not on a row-exact kernel, or None."""
        decoder = self.adapter.decoder
        linears = sum(isinstance(m, torch.nn.Linear) for m in decoder.modules())
        linears += isinstance(self.adapter.lm_head, torch.nn.Linear)
        if not linears or max(self.num_tile_product_linears(w) for w in kernels.TILE_LAYOUT) != linears:
            return "not every linear runs on the tile kernel (on one of its ways)"
        for name, m in decoder.named_modules():
            if type(m).__name__.endswith("Norm") and not isinstance(m, norms.NativeRMSNorm):
                return f"{name} ({type(m).__name__}) does not run on the compiled norm kernel"
        for i, layer in enumerate(getattr(decoder, "layers", ())):
            mlp = getattr(layer, "mlp", None)
            if not isinstance(mlp, kernels.PackedGatedMLP) or mlp.native_act is None:
                return f"layer {i}'s MLP does not run on the activation kernel"
        return None


def packing_room(need: int, pool: int) -> str | None:
    """None when the packed copy of the linears (``need`` bytes) and the KV pool fit in available memory with
    headroom (or memory cannot be read); otherwise the reason not to pack."""
    have = memory.available_bytes()
    if have is None or need + pool <= PACKING_HEADROOM * have:
        return None
    return (f"the packed copy needs {size_text(need)} and the KV pool {size_text(pool)}, but only "
            f"{size_text(have)} is available; decodes and short prefills run slower on plain linears "
            f"(ComputeConfig(packed_linears=False) asks for this and silences the warning)")


def size_text(n: int) -> str:
    """``n`` bytes in GiB or MiB, for messages."""
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
