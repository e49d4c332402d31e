"""Encoder fingerprints: which model computed a stored output, and when that is looked at again.

The text-encoder adapters, the vision adapters and the audio codec key every store entry with their encoder's
fingerprint, so these rules are theirs:

* ``module_fingerprint`` covers the caller's recipe, the module class, the device type(s) of its tensors, every
  config the module or a submodule runs on (``module_configs``), the attention and experts kernel of each
  (``kernel_implementations``) and every state-dict tensor (name, dtype, shape, bytes). Other weights, another
  dtype, kernel or device never share a fingerprint, and the same state gives the same string in every process.
  ``weights_digest`` is the weights part alone, over several modules, as a vision adapter's fingerprint uses it.
* Store keys are built from these strings: changing what they cover changes every key (``FINGERPRINT_VERSION``).
* They are xxh3_128, not BLAKE2b: they digest the server's own weights and configs, which no request chooses,
  and hash gigabytes many times faster.
* ``LiveFingerprint`` decides when one is taken again: at the first call after a tensor of the module is replaced,
  moved, cast or written in place through autograd, or a watched config attribute changes. A write through
  ``.data``, a replaced submodule and a value edited in place are not seen: call ``refresh()`` after them.
"""

from __future__ import annotations

import json
import threading
from operator import attrgetter
from typing import Callable, Generic, Mapping, Sequence, TypeVar

import torch
import xxhash

from mmcache.errors import InvalidRequest
from mmcache.names import canonical_encoding

# Part of every module fingerprint: bump it when what a fingerprint covers changes, so old keys are not reused.
FINGERPRINT_VERSION = 1
# Config entries that name where or with what version a model was saved, not what it computes.
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")


def nested_configs(config: object) -> dict[str, object]:
    """``config`` and every config nested in it (``text_config``, ``vision_config``, ... found by walking its
    attributes, not by a list of names), keyed by attribute path, ``""`` for ``config`` itself; a config reachable
    under two names (an alias) is listed once. Empty for None or an object that is not a transformers config."""
    out: dict[str, object] = {}
    seen: set[int] = set()

    def walk(cfg: object, path: str) -> None:
        if id(cfg) in seen:
            return
        seen.add(id(cfg))
        out[path] = cfg
        for name, value in sorted(getattr(cfg, "__dict__", {}).items()):
            if hasattr(value, "_attn_implementation") and hasattr(value, "to_dict"):
                walk(value, f"{path}.{name}" if path else name)

    if config is not None and hasattr(config, "_attn_implementation"):
        walk(config, "")
    return out


def module_configs(module: torch.nn.Module) -> dict[str, object]:
    """Every distinct config reachable from ``module``: the ``config`` of the module and of each submodule, and
    the configs nested in each (``nested_configs``), keyed ``"<module path>:<attribute path>"``; a config object
    reachable twice is listed once, at its first path. A submodule may run on a config of its own, not the
    top-level one: Mimi's encoder keeps a copy, whose attention kernel is set apart from the model's."""
    out: dict[str, object] = {}
    seen: set[int] = set()
    for path, sub in module.named_modules():
        for attribute, cfg in nested_configs(getattr(sub, "config", None)).items():
            if id(cfg) not in seen:
                seen.add(id(cfg))
                out[f"{path}:{attribute}"] = cfg
    return out


def kernel_implementations(config: object) -> dict[str, dict[str, str | None]]:
    """The kernels chosen for ``config`` and for every config nested in it (``nested_configs``), keyed by attribute
    path: ``{"attention": ..., "experts": ...}``, the attention implementation (``sdpa``, ``eager``,
    ``flash_attention_2``, ...) and the mixture-of-experts one (``eager``, ``grouped_mm``, ``batched_mm``, ...),
    None where unset.

    transformers keeps both in private attributes (``_attn_implementation``, ``_experts_implementation``) that
    ``to_dict`` and ``to_json_string`` leave out; yet the kernels round differently, so outputs of the same
    weights differ in their last bits and a fingerprint must hold them."""
    def chosen(cfg: object, attribute: str) -> str | None:
        value = getattr(cfg, attribute, None)
        return None if value is None else str(value)

    return {path: {"attention": chosen(cfg, "_attn_implementation"), "experts": chosen(cfg, "_experts_implementation")}
            for path, cfg in nested_configs(config).items()}


def module_kernels(module: torch.nn.Module) -> dict[str, dict[str, str | None]]:
    """The attention and experts kernels of each config ``module`` runs on (``module_configs``), by its path."""
    return {path: kernel_implementations(cfg)[""] for path, cfg in module_configs(module).items()}


def module_fingerprint(model: torch.nn.Module, recipe: Mapping) -> str:
    """Hex xxh3_128 over the recipe, the model class, the device type(s) of its tensors, its config and every
    other config a submodule runs on (``module_configs``), the attention and experts implementations of each
    (``kernel_implementations``) and every state-dict tensor (name, dtype, shape, bytes). About one second per
    10 GB of weights: taken when a ``LiveFingerprint`` sees the module change, not per call."""
    if not isinstance(model, torch.nn.Module):
        raise InvalidRequest(f"a fingerprinted module must be a torch module, got {type(model).__name__}")
    if not isinstance(recipe, Mapping):
        raise InvalidRequest(f"an adapter recipe must be a mapping, got {type(recipe).__name__}")
    tensors = model.state_dict()
    config = getattr(model, "config", None)
    configs = module_configs(model)
    h = xxhash.xxh3_128()
    h.update(canonical_encoding({"recipe": dict(recipe), "class": type(model).__qualname__,
                                 "version": FINGERPRINT_VERSION,
                                 "device": sorted({t.device.type for t in tensors.values()}),
                                 "kernels": module_kernels(model)}))
    # the top-level config (its nested ones are in its dict), then each config a submodule keeps of its own
    for path, cfg in [("", config), *((p, c) for p, c in configs.items() if not p.startswith(":"))]:
        if cfg is not None:
            values = {k: v for k, v in cfg.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
            h.update(canonical_encoding(path))
            h.update(json.dumps(values, sort_keys=True, default=str).encode("utf-8"))
    for name, tensor in tensors.items():
        _hash_tensor(h, [name], tensor)
    return h.hexdigest()


def weights_digest(modules: Sequence[torch.nn.Module]) -> str:
    """xxh3_128 hex over every tensor (module index, name, dtype, shape, bytes) of ``modules``' state dicts, in
    order: the weights part of a vision adapter's fingerprint.

    Why apart from ``module_fingerprint``: vision keys, already stored, hash tower and projector as one list."""
    if not isinstance(modules, (list, tuple)) or not all(isinstance(m, torch.nn.Module) for m in modules):
        raise InvalidRequest("weights_digest takes a list of torch modules")
    h = xxhash.xxh3_128()
    for i, module in enumerate(modules):
        for name, tensor in module.state_dict().items():
            _hash_tensor(h, [i, name], tensor)
    return h.hexdigest()


def _hash_tensor(h: xxhash.xxh3_128, header: list, tensor: torch.Tensor) -> None:
    """Feed ``h`` the header with the tensor's dtype and shape appended, then the tensor's bytes."""
    h.update(canonical_encoding([*header, str(tensor.dtype), list(tensor.shape)]))
    h.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


T = TypeVar("T")
_VERSION, _DTYPE, _DEVICE = attrgetter("_version"), attrgetter("dtype"), attrgetter("device")


class LiveFingerprint(Generic[T]):
    """``take()`` (a module's fingerprint, or a record holding one) kept while the module's state token is the one
    it was taken at, and taken again at the first call that sees another: shared by the text-encoder adapters,
    the codec and the vision adapters (which follow several modules: tower and projector).

    The token holds, for every parameter and buffer of the module (or of each module of a list) looked up where
    its module keeps it (``module._parameters`` / ``_buffers``), its identity, version counter, storage address,
    dtype and device, then a copy of the attributes of each watched object: by default every config the module
    and its submodules run on (``module_configs``; the attention and experts kernels are among them, in
    ``_attn_implementation_internal`` ...), or what ``watched()`` returns (a vision adapter's tower configs, the
    top-level config without the language model's, the image processor). So a tensor replaced
    (``load_state_dict(assign=True)``, ``p.data = ...``, ``.to(dtype or device)``), written in place through
    autograd's view of it (``mul_`` under ``no_grad``, ``load_state_dict``), another kernel
    (``set_attn_implementation``) or another config value takes it again. Where the tensors and configs live is
    found at the first call and again after each change seen; alone, these are not seen, so call ``refresh``
    after them: a write through ``.data`` (``p.data.mul_(...)`` bumps no version counter), a submodule, tensor or
    nested config replaced or added (not where the token looks), a config value changed in place (a list
    edited), and a storage freed and another of the same dtype allocated at its address between two calls
    (``.to(bfloat16)`` then ``.to(float32)``).

    A call costs about half a microsecond to a microsecond and a half per tensor, by machine, and one per config
    (``take`` aside): a look at a few hundred tensors, not a hash of gigabytes. The config attributes are read
    from ``__dict__``: through transformers' ``__getattribute__``, ``kernel_implementations`` costs tens of
    microseconds. Thread-safe: the token and what was taken at it are replaced as one pair, never kept when a
    ``refresh`` came while ``take`` ran; two threads seeing one change may both take it.
    """

    def __init__(self, module: torch.nn.Module | Sequence[torch.nn.Module], take: Callable[[], T],
                 watched: Callable[[], Sequence[object]] | None = None):
        modules = [module] if isinstance(module, torch.nn.Module) else module
        if (not isinstance(modules, (list, tuple)) or not modules
                or not all(isinstance(m, torch.nn.Module) for m in modules)):
            raise InvalidRequest(f"a fingerprinted module must be a torch module or a non-empty list of them, got "
                                 f"{type(module).__name__}")
        self.modules = list(modules)
        self._take = take
        self._watched = watched or (lambda: [cfg for m in self.modules for cfg in module_configs(m).values()])
        self._lock = threading.Lock()
        # ([(module._parameters or module._buffers, name) of every tensor], [every config]), or None: find them
        self._places: tuple[list, list] | None = None
        self._held: tuple | None = None  # (token, what take returned at it)
        self._refreshes = 0

    def __call__(self) -> T:
        with self._lock:
            held, refreshes = self._held, self._refreshes
        token = self.token()
        if held is not None and held[0] == token:
            return held[1]
        self._find()  # the module changed: where its tensors and configs live may have too
        token = self.token()
        taken = self._take()  # outside the lock: seconds on a large model, while other modules' calls go on
        with self._lock:
            if self._refreshes == refreshes:
                self._held = (token, taken)
        return taken

    def refresh(self) -> None:
        """Find the tensors and configs again and take the fingerprint again at the next call (after changes the
        token cannot see)."""
        with self._lock:
            self._held, self._places = None, None
            self._refreshes += 1

    def token(self) -> tuple:
        """The module's state as compared at each call (see the class docstring)."""
        places = self._places
        try:
            return self._token(*(self._find() if places is None else places))
        except (KeyError, AttributeError):  # a tensor deleted from its module, or set to None: find them again
            return self._token(*self._find())

    def _find(self) -> tuple[list, list]:
        modules = {id(m): m for root in self.modules for m in root.modules()}  # a module two roots share: once
        slots = [(table, name) for module in modules.values() for table in (module._parameters, module._buffers)
                 for name, t in table.items() if t is not None]
        watched = list({id(o): o for o in self._watched()}.values())  # each object once, in order
        self._places = places = (slots, watched)
        return places

    @staticmethod
    def _token(slots: list, configs: list) -> tuple:
        tensors = [table[name] for table, name in slots]
        return (*map(id, tensors), *map(_VERSION, tensors), *map(torch.Tensor.data_ptr, tensors),
                *map(_DTYPE, tensors), *map(_DEVICE, tensors), *(dict(vars(obj)) for obj in configs))

