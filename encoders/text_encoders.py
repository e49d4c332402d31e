"""Text-encoder adapters (umT5, T5, CLIP) whose outputs go through the encoder-output store.

An adapter tokenizes a prompt exactly as its pipeline does, keys the result, and runs the encoder only on a
miss. ``key = store_key(encoder fingerprint, content digest, salt)`` where

* the encoder fingerprint digests the adapter recipe (which outputs, masked or not, trimmed or not), the model
  class, its config, its dtype and every tensor of its state dict, so other weights never share an entry;
* the content digest covers the padded token ids fed to the encoder, the attention mask, the max length and the
  output selector (the CLIP hidden layer), so equal text at different max lengths never collides and a prompt
  is keyed on its own: a negative prompt's entry is independent of the positive prompt beside it.

Invariants:

* One prompt is one encoder forward of batch 1, the same shape whether the store is on or off, so the store
  changes which forwards run, never their bits.
* Outputs are what the pipeline holds right after its encoder call (cast as the pipeline casts, trimmed where
  it trims) and are checked against the adapter's ``OutputSpec`` before they are stored; a tensor of another
  shape or dtype is refused with ``StoreEntryRejected`` and nothing is stored.
* A hit is used only after the token ids stored with the entry equal the request's (the design's
  "hashes nominate, ids confirm"); on a mismatch the adapter encodes without the store.
* The model's weights must not change while an adapter holds its fingerprint: after loading or fusing adapter
  weights, build a new adapter.
"""

from __future__ import annotations

import abc
import json
import time
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch
import xxhash

from mmcache.errors import InvalidRequest
from mmcache.names import TOKEN_DTYPE, canonical_encoding
from mmcache.store import EncoderOutputStore, Lease, OutputSpec, store_key

ADAPTER_VERSION = 1
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash")


def module_fingerprint(model: torch.nn.Module, recipe: Mapping) -> str:
    """Hex xxh3_128 over the recipe, the model class, its config and every state-dict tensor (name, dtype,
    shape, bytes). Computed once per adapter; about one second per 10 GB of weights."""
    h = xxhash.xxh3_128()
    h.update(canonical_encoding({"recipe": dict(recipe), "class": type(model).__qualname__,
                                 "version": ADAPTER_VERSION}))
    config = getattr(model, "config", None)
    if config is not None:
        cfg = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
        h.update(json.dumps(cfg, sort_keys=True, default=str).encode("utf-8"))
    for name, t in model.state_dict().items():
        h.update(canonical_encoding([name, str(t.dtype), list(t.shape)]))
        h.update(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt as its encoder sees it: ``input_ids`` and ``attention_mask`` of length ``max_length``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_length: int

    @property
    def length(self) -> int:
        """Real tokens (special tokens included, padding excluded)."""
        return int(self.attention_mask.sum())

    def token_bytes(self) -> bytes:
        """The ids (little-endian int32) then the mask (uint8): what an entry's hit is verified against."""
        return (self.input_ids.numpy().astype(TOKEN_DTYPE).tobytes()
                + self.attention_mask.numpy().astype(np.uint8).tobytes())

    def digest(self, selector: Mapping) -> bytes:
        h = xxhash.xxh3_128()
        h.update(canonical_encoding({"max_length": self.max_length, "selector": dict(selector)}))
        h.update(self.token_bytes())
        return h.digest()


def _check_text(text: object, max_length: object) -> None:
    if not isinstance(text, str):
        raise InvalidRequest(f"a prompt must be a str, got {type(text).__name__}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
        raise InvalidRequest(f"max_length must be a positive int, got {max_length!r}")


class TextEncoderAdapter(abc.ABC):
    """Shared tokenizing, keying and store path; subclasses say what runs and what comes out."""

    def __init__(self, tokenizer, model: torch.nn.Module, recipe: Mapping):
        self.tokenizer = tokenizer
        self.model = model
        self.fingerprint = module_fingerprint(model, recipe)

    def tokenize(self, text: str, max_length: int) -> TokenizedPrompt:
        _check_text(text, max_length)
        enc = self.tokenizer(text, padding="max_length", max_length=max_length, truncation=True,
                             add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        return TokenizedPrompt(enc.input_ids[0], enc.attention_mask[0], max_length)

    def key(self, tokens: TokenizedPrompt, selector: Mapping | None = None, salt: bytes | str | None = b"") -> bytes:
        return store_key(self.fingerprint, tokens.digest(selector or {}), salt)

    @abc.abstractmethod
    def spec(self, tokens: TokenizedPrompt, selector: Mapping) -> OutputSpec:
        """What ``forward`` returns for ``tokens``: names, shapes, dtypes."""

    @abc.abstractmethod
    def forward(self, tokens: TokenizedPrompt, selector: Mapping) -> dict[str, torch.Tensor]:
        """One encoder forward of batch 1; the outputs as the pipeline holds them after its encoder call."""

    def encode(self, text: str, max_length: int, store: EncoderOutputStore | None = None,
               salt: bytes | str | None = b"", **selector) -> Lease:
        """A held lease on the encoder outputs for ``text``; release it when the request is done with them.

        With ``store=None`` the encoder runs and the lease holds nothing (the store-off path is this same code).
        """
        tokens = self.tokenize(text, max_length)
        key = self.key(tokens, selector, salt)
        spec = self.spec(tokens, selector)

        def compute():
            return self.forward(tokens, selector), {"tokens": tokens.token_bytes(), "length": tokens.length}

        if store is None:
            outputs, meta = compute()
            spec.check(key, outputs)
            return Lease(key, outputs, meta, hit=False)
        lease = store.get_or_compute(key, compute, spec)
        if lease.meta.get("tokens") != tokens.token_bytes():
            lease.release()  # a 128-bit key collision: never use another prompt's outputs
            outputs, meta = compute()
            spec.check(key, outputs)
            return Lease(key, outputs, meta, hit=False, bypassed=True)
        return lease

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


@dataclass(frozen=True)
class T5Recipe:
    """How a pipeline runs a T5-family encoder. Wan (umT5): mask passed, output trimmed to the real length.
    SD3 (T5): no mask, all ``max_length`` positions kept."""

    attention_mask: bool
    trim_to_length: bool


class T5EncoderAdapter(TextEncoderAdapter):
    """``T5EncoderModel`` / ``UMT5EncoderModel``: one output, ``hidden`` = last hidden state."""

    def __init__(self, tokenizer, model, recipe: T5Recipe):
        super().__init__(tokenizer, model, {"kind": "t5", "attention_mask": recipe.attention_mask,
                                            "trim_to_length": recipe.trim_to_length})
        self.recipe = recipe

    def spec(self, tokens, selector) -> OutputSpec:
        rows = tokens.length if self.recipe.trim_to_length else tokens.max_length
        return OutputSpec({"hidden": ((rows, self.model.config.d_model), self.model.dtype)})

    def forward(self, tokens, selector):
        ids = tokens.input_ids[None].to(self.device)
        with torch.no_grad():
            if self.recipe.attention_mask:
                out = self.model(ids, tokens.attention_mask[None].to(self.device)).last_hidden_state
            else:
                out = self.model(ids)[0]
        hidden = out.to(dtype=self.model.dtype)[0]
        return {"hidden": hidden[: tokens.length] if self.recipe.trim_to_length else hidden}


class CLIPEncoderAdapter(TextEncoderAdapter):
    """``CLIPTextModelWithProjection`` as SD3 runs it (no mask): ``hidden`` = the selected hidden state
    (``hidden_layer``, -2 by default, ``-(clip_skip + 2)`` with clip_skip) and ``pooled`` = the projected
    pooled output."""

    def __init__(self, tokenizer, model):
        super().__init__(tokenizer, model, {"kind": "clip-with-projection"})

    def encode(self, text, max_length, store=None, salt=b"", hidden_layer: int = -2) -> Lease:
        layers = self.model.config.num_hidden_layers + 1  # hidden_states holds the embeddings and every layer
        if isinstance(hidden_layer, bool) or not isinstance(hidden_layer, int) or not -layers <= hidden_layer < 0:
            raise InvalidRequest(f"hidden_layer must be an int in [{-layers}, -1], got {hidden_layer!r}")
        return super().encode(text, max_length, store, salt, hidden_layer=hidden_layer)

    def spec(self, tokens, selector) -> OutputSpec:
        cfg = self.model.config
        return OutputSpec({"hidden": ((tokens.max_length, cfg.hidden_size), self.model.dtype),
                           "pooled": ((cfg.projection_dim,), self.model.dtype)})

    def forward(self, tokens, selector):
        with torch.no_grad():
            out = self.model(tokens.input_ids[None].to(self.device), output_hidden_states=True)
        return {"hidden": out.hidden_states[selector["hidden_layer"]][0], "pooled": out[0][0]}


class ForwardCounter:
    """Counts real forward calls of modules, and the time spent inside them, through forward hooks (what
    benchmarks report as encoder calls and encoder forward time).

    ``with ForwardCounter(a, b) as c: ...`` then ``c.calls[i]``, ``c.seconds[i]`` (wall) and
    ``c.cpu_seconds[i]`` (the calling thread's CPU time) are module i's figures; the hooks are removed at exit.
    The modules must not call one another.
    """

    def __init__(self, *modules: torch.nn.Module):
        self.modules = modules
        self.calls = [0] * len(modules)
        self.seconds = [0.0] * len(modules)
        self.cpu_seconds = [0.0] * len(modules)
        self._started = [(0.0, 0.0)] * len(modules)
        self._handles: list = []

    @property
    def total(self) -> int:
        return sum(self.calls)

    def __enter__(self) -> "ForwardCounter":
        for i, module in enumerate(self.modules):
            self._handles.append(module.register_forward_pre_hook(lambda *_, i=i: self._start(i)))
            self._handles.append(module.register_forward_hook(lambda *_, i=i: self._stop(i)))
        return self

    def _start(self, i: int) -> None:
        self._started[i] = (time.perf_counter(), time.thread_time())

    def _stop(self, i: int) -> None:
        wall, cpu = self._started[i]
        self.calls[i] += 1
        self.seconds[i] += time.perf_counter() - wall
        self.cpu_seconds[i] += time.thread_time() - cpu

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
