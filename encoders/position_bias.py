"""Relative position biases of T5-family encoders, served from the encoder-output store.

T5 and umT5 add a relative position bias to their attention scores: a ``(1, heads, q, k)`` tensor made from the
layer's bias table and the two lengths alone, never from the prompt. umT5 makes one per layer and forward, T5
one per forward (layer 0's, handed down to the other layers), and the pipelines pad every prompt to one length
(Wan to 512), so every forward makes the same tensors again: it buckets the q x k relative positions, gathers
the table into a view whose heads are its innermost dimension in memory, and adds that strided view to the
scores of every layer. That was 39% of the bench umT5's forward and 21-34% of a umT5-XXL layer's in bfloat16 on
the development CPU (RESULTS.md, diffusion section).

``PositionBiases(model)`` serves them from the store: inside ``with biases.serving(store, fingerprint, salt,
length):`` the ``compute_bias`` of every attention module that owns a bias table returns the stored tensor,
which the module's own ``compute_bias`` computed the first time (the store keeps a contiguous copy).

Invariants:

* Outputs are bit-identical to the model's own forward: a stored bias holds exactly the values the module's
  ``compute_bias`` returned, and the attention only adds it to the scores, element by element, where the memory
  layout of an operand changes no bit (the tests compare every output with the model's own forward).
* Key = ``store_key(encoder fingerprint, digest(module path, query length, key length, device), salt)``. The
  fingerprint covers the bias tables and the bucket settings (state dict and config), so a changed table or
  setting never reuses an old bias; different salts share no entry, as for every other output. The salt is the
  request's (``serving``'s argument, passed on by the adapter's ``encode``), so one model serves every tenant.
* Bias entries are of kind ``"position_bias"`` (``KIND``): ``store.metrics.kinds["output"]`` still counts
  prompt outputs alone.
* Every bias entry a forward uses is held from its first use to the end of the ``serving`` block, then released,
  also when the forward raises: the store never evicts a bias in use, and a failed forward holds nothing after.
* Biases are served only while all of one forward's biases take at most a quarter of the store's budget
  (``BUDGET_SHARE``): a small store keeps its room for prompt outputs, and falls back to the module's own
  ``compute_bias`` rather than churning its entries every forward.
* Only the thread inside ``serving`` is served, and only for ``past_seen_tokens == 0`` (an encoder forward): any
  other call of ``compute_bias`` (another thread running the same model, a decoder step with a cache) runs the
  module's own.
* The model is left as found: while at least one thread serves a module, its ``compute_bias`` is an instance
  attribute (``_Dispatch``); when the last one leaves it is removed, or the caller's own instance attribute put
  back. So a model can be copied and saved between forwards as before.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Iterator

import torch

from mmcache.names import canonical_encoding
from mmcache.store import EncoderOutputStore, Lease, OutputSpec, store_key

BUDGET_SHARE = 4  # biases are served while one forward's biases take at most 1 / BUDGET_SHARE of the budget
KIND = "position_bias"  # the store entries' kind: the store's metrics count them apart from prompt outputs
_COMPUTE_BIAS_PARAMETERS = ("query_length", "key_length", "device", "past_seen_tokens")
_INSTALL_LOCK = threading.Lock()  # installing and removing a module's dispatch
_SERVED_CLASSES: dict[type, bool] = {}  # class -> whether its compute_bias is served (_served_class)


def _served_class(cls: type) -> bool:
    """Whether ``cls.compute_bias`` takes the arguments transformers' T5 and umT5 attention pass (read once per
    class): a class whose method has another signature is never served, so a changed library falls back to its
    own code instead of being called wrongly."""
    served = _SERVED_CLASSES.get(cls)
    if served is None:
        method = getattr(cls, "compute_bias", None)
        try:
            names = tuple(inspect.signature(method).parameters)[1:] if callable(method) else ()
        except (TypeError, ValueError):
            names = ()
        served = _SERVED_CLASSES[cls] = names == _COMPUTE_BIAS_PARAMETERS
    return served


def bias_owners(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(path, module)`` of every attention module in ``model`` that owns a relative position bias table and
    whose ``compute_bias`` has the signature served here. Attributes are read from each module's own tables:
    through ``nn.Module.__getattr__`` a missing one costs an exception per module."""
    return [(path, m) for path, m in model.named_modules()
            if m.__dict__.get("has_relative_attention_bias") is True
            and isinstance(m._modules.get("relative_attention_bias"), torch.nn.Embedding)
            and _served_class(type(m))]


class _Serving:
    """One thread's serving of one forward: where biases come from, and the leases it holds."""

    def __init__(self, owner: "PositionBiases", store: EncoderOutputStore, fingerprint: str, salt,
                 paths: dict[int, str]):
        self.owner, self.store, self.fingerprint, self.salt, self.paths = owner, store, fingerprint, salt, paths
        self.leases: list[Lease] = []

    def bias(self, module: torch.nn.Module, own, query_length: int, key_length: int,
             device: torch.device | None) -> torch.Tensor:
        table = module.relative_attention_bias.weight
        device = torch.device(device) if device is not None else table.device
        digest = canonical_encoding({"relative_position_bias": self.paths[id(module)], "query_length": query_length,
                                     "key_length": key_length, "device": str(device)})
        key = store_key(self.fingerprint, digest, self.salt)
        spec = OutputSpec({"bias": ((1, table.shape[1], query_length, key_length), table.dtype)})

        def compute():
            self.owner._count(computed=1)
            return {"bias": own(query_length, key_length, device, 0)}, {}

        lease = self.store.get_or_compute(key, compute, spec, kind=KIND)
        self.leases.append(lease)
        self.owner._count(served=1)
        return lease.outputs["bias"]


class _Dispatch:
    """A module's ``compute_bias`` while some thread serves it: that thread's ``_Serving`` answers, every other
    call goes to ``own`` (the module's method as it was before)."""

    def __init__(self, module: torch.nn.Module, own, kept):
        self.module, self.own, self.kept = module, own, kept  # kept: the caller's instance attribute, if any
        self.users = 0
        self.local = threading.local()

    def __call__(self, query_length, key_length, device=None, past_seen_tokens=0):
        serving = getattr(self.local, "serving", None)
        if (serving is None or isinstance(past_seen_tokens, torch.Tensor) or past_seen_tokens != 0
                or not isinstance(query_length, int) or not isinstance(key_length, int)):
            return self.own(query_length, key_length, device, past_seen_tokens)
        return serving.bias(self.module, self.own, query_length, key_length, device)


_MISSING = object()


def _install(module: torch.nn.Module) -> _Dispatch:
    with _INSTALL_LOCK:
        dispatch = module.__dict__.get("compute_bias")
        if not isinstance(dispatch, _Dispatch):
            kept = module.__dict__.get("compute_bias", _MISSING)
            dispatch = _Dispatch(module, module.compute_bias, kept)
            module.__dict__["compute_bias"] = dispatch
        dispatch.users += 1
        return dispatch


def _remove(dispatch: _Dispatch) -> None:
    with _INSTALL_LOCK:
        dispatch.users -= 1
        if dispatch.users == 0:
            if dispatch.kept is _MISSING:
                del dispatch.module.__dict__["compute_bias"]
            else:
                dispatch.module.__dict__["compute_bias"] = dispatch.kept


class PositionBiases:
    """Serves the relative position biases of one T5-family model from a store (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._owners: tuple[str, list] | None = None  # (the fingerprint they were found at, bias_owners)
        self.served = 0  # compute_bias calls answered from a store
        self.computed = 0  # of those, the ones that computed the bias (a store miss)
        self._lock = threading.Lock()

    def _count(self, served: int = 0, computed: int = 0) -> None:
        with self._lock:
            self.served += served
            self.computed += computed

    def forward_bytes(self, length: int, owners: list | None = None) -> int:
        """What one forward's biases take at ``length`` tokens (query and key length alike, as in an encoder)."""
        owners = bias_owners(self.model) if owners is None else owners
        return sum(m.relative_attention_bias.embedding_dim * length * length
                   * m.relative_attention_bias.weight.element_size() for _, m in owners)

    def _owners_at(self, fingerprint: str) -> list:
        """``bias_owners`` of the model, found again whenever its fingerprint changes (a walk of every module
        costs about as much as the rest of a hit). Serving stays exact with a stale list, which the fingerprint
        misses only after changes it needs ``refresh()`` for: a module no longer in the model is never called,
        and a new one runs its own ``compute_bias``."""
        found = self._owners
        if found is None or found[0] != fingerprint:
            found = self._owners = (fingerprint, bias_owners(self.model))
        return found[1]

    @contextlib.contextmanager
    def serving(self, store: EncoderOutputStore, fingerprint: str, salt, length: int) -> Iterator[bool]:
        """Serve this thread's ``compute_bias`` calls from ``store`` for the block; yields whether it does (no
        bias owner, or biases over ``1 / BUDGET_SHARE`` of the budget: the block runs the model's own code)."""
        owners = self._owners_at(fingerprint)
        if not owners or self.forward_bytes(length, owners) * BUDGET_SHARE > store.budget_bytes:
            yield False
            return
        serving = _Serving(self, store, fingerprint, salt, {id(m): path for path, m in owners})
        dispatches: list[_Dispatch] = []
        outer: list = []
        try:
            for _, module in owners:
                dispatch = _install(module)
                dispatches.append(dispatch)
                outer.append(getattr(dispatch.local, "serving", None))
                dispatch.local.serving = serving
            yield True
        finally:
            for dispatch, before in zip(dispatches, outer):
                dispatch.local.serving = before
                _remove(dispatch)
            for lease in serving.leases:
                lease.release()
