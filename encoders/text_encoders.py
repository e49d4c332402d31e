"""Text-encoder adapters (umT5, T5, CLIP) whose outputs go through the encoder-output store.

An adapter tokenizes a prompt exactly as its pipeline does, keys the result, and runs the encoder only on a
miss. ``key = store_key(encoder fingerprint, content digest, salt)`` where

* the encoder fingerprint is ``fingerprint.module_fingerprint`` of the model with the adapter recipe (which
  outputs, masked or not, trimmed or not): other weights, another dtype, attention kernel (sdpa and eager round
  differently) or device never share an entry;
* the content digest covers the padded token ids fed to the encoder, the attention mask, the max length and the
  output selector (the CLIP hidden layer), so equal text at different max lengths never collides and a prompt
  is keyed on its own: a negative prompt's entry is independent of the positive prompt beside it. A selector
  the adapter does not read is refused, since it would key equal outputs apart. It is BLAKE2b-256
  (``names.content_hasher``), like every digest of request content; a hit is also verified against the
  stored token ids.
* The model and tokenizer fingerprints stay xxh3_128: they digest weights, configs and vocabularies the server
  loaded, not request content, so no request can aim a collision at them, and hashing gigabytes of weights with
  BLAKE2b would take many times longer at every change.
* The salt is per call (``encode(..., salt=)``; checked and bounded by ``names.Namer.salt_bytes``): one adapter
  serves every tenant, and two salts share no store entry, no position bias and no tokenization memo entry.

Invariants:

* A ``TokenizedPrompt`` holds exactly ``max_length`` ids: a max length too short for the tokenizer's special
  tokens (CLIP's two), which the tokenizer would answer untruncated, is refused with ``InvalidRequest``.
* One prompt is one encoder forward of batch 1, the same shape whether the store is on or off, so the store
  changes which forwards run, never their bits. With a store, a T5 or umT5 adapter also takes the encoder's
  relative position biases from it (``position_bias.py``, ``position_biases=False`` to keep prompt outputs
  only): where a bias comes from changes, its values do not.
* Outputs are what the pipeline holds right after its encoder call (cast as the pipeline casts, trimmed where
  it trims) and are checked against the adapter's ``OutputSpec`` before they are stored; a tensor of another
  shape or dtype is refused with ``StoreEntryRejected`` and nothing is stored.
* A hit is used only after the token ids stored with the entry equal the request's (the design's
  "hashes nominate, ids confirm"); on a mismatch the adapter encodes without the store.
* The fingerprint and the declared dtype follow the model (``fingerprint.LiveFingerprint``): taken again at the
  next encode after a weight or buffer is replaced, moved or cast (``load_state_dict``, ``.to(...)``), written in
  place through autograd's view (``weight.mul_(...)`` under ``no_grad``), or a config attribute changes (the
  attention or experts kernel: ``set_attn_implementation``). A write through ``.data``, a replaced or added
  submodule, tensor or nested config, and a config value edited in place are not seen by themselves: call
  ``refresh()`` after them (after fusing adapter weights through ``.data`` too). None of these may run
  concurrently with an encode.

Tokenizing is memoized on the store path, so a hit costs dictionary lookups, not a tokenization
(``TokenizationMemo``): a bounded LRU from (tokenizer fingerprint, tokenizer settings, call arguments, max
length, exact text, salt) to the ``TokenizedPrompt`` the tokenizer returned for it; the salt keeps one tenant
from timing whether another sent a prompt. The tokenizer fingerprint digests the tokenizer's serialized
pipeline (vocabulary, normalizer, pre-tokenizer, model, post-processor, added tokens); it is recomputed
whenever the tokenizer's size, added-token table (each token with its flags), post-processor, special tokens,
bos/eos flags or backend object change (``add_tokens`` for textual inversion, ``add_special_tokens``,
``add_eos_token = False`` ...), and the settings that shape ids (padding and truncation
side, pad token, ``split_special_tokens``) are read on every call. Editing the backend's other components in
place (``backend_tokenizer.normalizer = ...``) is not seen: call the adapter's ``refresh()`` after it.
Memoized tensors are shared, never modified. With ``store=None`` every prompt is tokenized, as the pipeline
tokenizes it.
"""

from __future__ import annotations

import abc
import contextlib
import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping

import numpy as np
import torch
import xxhash

from mmcache.checks import positive_int, unicode_text
from mmcache.errors import InvalidRequest
from mmcache.names import TOKEN_DTYPE, Namer, canonical_encoding, content_hasher
from mmcache.store import EncoderOutputStore, Lease, OutputSpec, store_key

from .fingerprint import LiveFingerprint, module_fingerprint
from .position_bias import PositionBiases

ADAPTER_VERSION = 1
# The longest max_length a T5-family adapter takes unless told otherwise: eight times the 512 tokens Wan and SD3
# encode. Every prompt is padded to max_length and the encoder attends over all of it (memory grows with its
# square), so a far larger value is a mistake that would exhaust memory, not a request to serve.
T5_MAX_LENGTH = 4096
# The tokenizer call every adapter makes (the pipelines' own); part of every memo key.
_TOKENIZER_CALL = (("padding", "max_length"), ("truncation", True), ("add_special_tokens", True))
# Parts of a fast tokenizer's serialized form that each call rewrites (set_truncation_and_padding), not content.
_PER_CALL_BACKEND_KEYS = ("padding", "truncation")


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt as its encoder sees it: ``input_ids`` and ``attention_mask`` of length ``max_length``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_length: int

    @cached_property
    def length(self) -> int:
        """Real tokens (special tokens included, padding excluded)."""
        return int(self.attention_mask.sum())

    def token_bytes(self) -> bytes:
        """The ids (little-endian int32) then the mask (uint8): what an entry's hit is verified against."""
        return self._token_bytes

    @cached_property
    def _token_bytes(self) -> bytes:  # computed once: a memoized prompt is verified on every hit
        return (self.input_ids.numpy().astype(TOKEN_DTYPE).tobytes()
                + self.attention_mask.numpy().astype(np.uint8).tobytes())

    def digest(self, selector: Mapping) -> bytes:
        """The content digest of this prompt under ``selector``: BLAKE2b-256 over both and the token bytes."""
        h = content_hasher(b"mmcache-prompt")
        h.update(canonical_encoding({"max_length": self.max_length, "selector": dict(selector)}))
        h.update(self.token_bytes())
        return h.digest()


def _check_text(text: object, max_length: object) -> None:
    if not isinstance(text, str):
        raise InvalidRequest(f"a prompt must be a str, got {type(text).__name__}")
    if not unicode_text(text):
        raise InvalidRequest("a prompt must be valid Unicode text; this one holds a lone surrogate")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length <= 0:
        raise InvalidRequest(f"max_length must be a positive int, got {max_length!r}")


_TOKENIZER_LOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TOKENIZER_LOCKS_GUARD = threading.Lock()
_UNWEAKABLE_LOCK = threading.Lock()  # for a tokenizer object that takes no weak reference


def tokenizer_lock(tokenizer) -> threading.Lock:
    """The lock of one tokenizer object. A fast tokenizer's call first sets its shared backend's padding and
    truncation, then encodes: two threads calling it with other lengths in between get each other's settings
    (wrong ids, of the right length). Per object, not per adapter: SD3 hands one CLIP tokenizer to two."""
    with _TOKENIZER_LOCKS_GUARD:
        try:
            lock = _TOKENIZER_LOCKS.get(tokenizer)
            if lock is None:
                lock = _TOKENIZER_LOCKS[tokenizer] = threading.Lock()
            return lock
        except TypeError:
            return _UNWEAKABLE_LOCK


def tokenize(tokenizer, text: str, max_length: int) -> TokenizedPrompt:
    """``text`` as the pipelines tokenize one prompt: padded to ``max_length``, truncated to it, special tokens
    added. Calls on one tokenizer object are serialised (``tokenizer_lock``)."""
    _check_text(text, max_length)
    with tokenizer_lock(tokenizer):
        enc = tokenizer(text, max_length=max_length, return_attention_mask=True, return_tensors="pt",
                        **dict(_TOKENIZER_CALL))
    # A tokenizer cannot truncate below the special tokens it adds (CLIP's two): it then returns the prompt
    # untruncated, which would be keyed and encoded as a prompt of max_length tokens.
    if enc.input_ids.shape[-1] != max_length:
        raise InvalidRequest(f"max_length {max_length} leaves no room for the tokenizer's special tokens: it "
                             f"returned {enc.input_ids.shape[-1]} ids")
    return TokenizedPrompt(enc.input_ids[0], enc.attention_mask[0], max_length)


def tokenizer_fingerprint(tokenizer) -> str | None:
    """Hex xxh3_128 over the tokenizer's class and its fast backend's serialized pipeline (vocabulary,
    normalizer, pre-tokenizer, model, post-processor, added tokens), less the padding and truncation each call
    sets; ``None`` for a tokenizer without a fast backend, which is then never memoized."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    content = {k: v for k, v in json.loads(backend.to_str()).items() if k not in _PER_CALL_BACKEND_KEYS}
    h = xxhash.xxh3_128()
    h.update(canonical_encoding({"class": type(tokenizer).__qualname__, "version": ADAPTER_VERSION}))
    h.update(json.dumps(content, sort_keys=True, ensure_ascii=False).encode("utf-8"))
    return h.hexdigest()


def _content_state(tokenizer) -> tuple:
    """What changes the tokenizer's content through its own API; a change re-fingerprints it. Read on every call:
    about 2 us plus 0.4 us per added token (the table is copied out of the backend; AddedToken equality compares
    every flag). The post-processor is compared serialized, since ``add_bos_token = True`` on a T5 tokenizer
    rewrites it (dropping ``</s>``) while the attribute reads back False."""
    backend = tokenizer.backend_tokenizer
    post = backend.post_processor
    return (backend, len(tokenizer), getattr(tokenizer, "add_bos_token", None),
            getattr(tokenizer, "add_eos_token", None), tokenizer.bos_token, tokenizer.eos_token,
            backend.get_added_tokens_decoder(), None if post is None else post.__getstate__())


def _call_state(tokenizer) -> tuple:
    """Attributes the tokenizer reads on every call that shape the ids; part of every memo key."""
    return (tokenizer.padding_side, tokenizer.truncation_side, tokenizer.pad_token_id, tokenizer.pad_token,
            tokenizer.split_special_tokens)


class TokenizationMemo:
    """Bounded LRU of tokenizations: ``memo(text, max_length, salt)`` returns exactly what ``tokenize`` returns.

    The key is (tokenizer fingerprint, ``_call_state``, ``_TOKENIZER_CALL``, max length, exact text, salt bytes):
    the text itself, not a digest of it, so two prompts never share an entry, and the salt, so two tenants never
    share one either (a hit is faster than a tokenization, so a shared entry would tell one tenant another's
    prompts). At most ``entries`` prompts are kept, and none longer than ``max_text_chars`` characters (those are
    tokenized every time); an entry costs about ``21 * max_length + 4 * len(text) + len(salt)`` bytes (int64 ids
    and mask, the verified token bytes, the text, the salt), and the least recently used entries are dropped
    while the sum passes ``max_bytes`` (32 MiB: all 1024 entries at Wan's text length 512, about 350 at T5's
    longest, 4096). Safe to call from several threads.
    """

    def __init__(self, tokenizer, entries: int = 1024, max_text_chars: int = 8192, max_bytes: int = 32 * 2**20):
        if not callable(tokenizer):
            raise InvalidRequest(f"a tokenizer must be callable, got {type(tokenizer).__name__}")
        if isinstance(entries, bool) or not isinstance(entries, int) or entries < 0:
            raise InvalidRequest(f"entries must be an int >= 0, got {entries!r}")
        if isinstance(max_text_chars, bool) or not isinstance(max_text_chars, int) or max_text_chars < 0:
            raise InvalidRequest(f"max_text_chars must be an int >= 0, got {max_text_chars!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidRequest(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.bytes = 0  # the estimated size of the entries held (see the class docstring)
        self.tokenizer = tokenizer
        self.entries = entries
        self.max_text_chars = max_text_chars
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        self._memo: OrderedDict[tuple, TokenizedPrompt] = OrderedDict()
        self._content: tuple = ()
        self._fingerprint: str | None = None
        self.fingerprint()  # now, so that the first request does not pay for it

    def fingerprint(self) -> str | None:
        """The tokenizer's fingerprint, recomputed when its ``_content_state`` has changed since the last call."""
        if getattr(self.tokenizer, "backend_tokenizer", None) is None:
            return None
        state = _content_state(self.tokenizer)
        with self._lock:
            if state != self._content:
                self._content, self._fingerprint = state, tokenizer_fingerprint(self.tokenizer)
            return self._fingerprint

    def refresh(self) -> None:
        """Fingerprint the tokenizer again at the next call (after an edit ``_content_state`` cannot see)."""
        with self._lock:
            self._content = ()

    def __len__(self) -> int:
        return len(self._memo)

    def __call__(self, text: str, max_length: int, salt: bytes | str | None = b"") -> TokenizedPrompt:
        _check_text(text, max_length)
        salt = Namer.salt_bytes(salt)
        fingerprint = self.fingerprint()
        if fingerprint is None or self.entries == 0 or len(text) > self.max_text_chars:
            return tokenize(self.tokenizer, text, max_length)
        key = (fingerprint, _call_state(self.tokenizer), _TOKENIZER_CALL, max_length, text, salt)
        with self._lock:
            tokens = self._memo.get(key)
            if tokens is not None:
                self._memo.move_to_end(key)
                self.hits += 1
                return tokens
        tokens = tokenize(self.tokenizer, text, max_length)  # outside the lock: other prompts' hits go on
        size = _memo_bytes(key)
        if size > self.max_bytes:
            return tokens
        with self._lock:
            self.misses += 1
            if key not in self._memo:
                self.bytes += size
            self._memo[key] = tokens
            self._memo.move_to_end(key)
            while len(self._memo) > self.entries or self.bytes > self.max_bytes:
                old, _ = self._memo.popitem(last=False)
                self.bytes -= _memo_bytes(old)
        return tokens


def _memo_bytes(key: tuple) -> int:
    """An entry's estimated size from its key (max length, text, salt): see ``TokenizationMemo``."""
    return 21 * key[3] + 4 * len(key[4]) + len(key[5])


class TextEncoderAdapter(abc.ABC):
    """Shared tokenizing, keying and store path; subclasses say what runs and what comes out."""

    selectors: tuple[str, ...] = ()  # the output selectors ``forward`` reads; any other name is refused

    def __init__(self, tokenizer, model: torch.nn.Module, recipe: Mapping, max_length_limit: int):
        if not callable(tokenizer):
            raise InvalidRequest(f"a text encoder adapter needs a tokenizer, got {type(tokenizer).__name__}")
        if not positive_int(max_length_limit):
            raise InvalidRequest(f"max_length_limit must be an int >= 1, got {max_length_limit!r}")
        self.tokenizer = tokenizer
        self.model = model
        self.max_length_limit = max_length_limit  # encode refuses a longer max_length
        # (fingerprint, the dtype it saw: what every output is declared as), taken again when the model changes
        self._state = LiveFingerprint(model, lambda: (module_fingerprint(model, recipe), model.dtype))
        self._state()  # now, so that the first request does not pay for it
        self.memo = TokenizationMemo(tokenizer)

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint as it is now (``LiveFingerprint``)."""
        return self._state()[0]

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype when its fingerprint was taken: what every output is declared as."""
        return self._state()[1]

    def refresh(self) -> None:
        """Take the model's and the tokenizer's fingerprints again at the next encode: after a change neither can
        see (a write through ``.data``, a replaced submodule, a tokenizer backend component edited in place)."""
        self._state.refresh()
        self.memo.refresh()

    def tokenize(self, text: str, max_length: int) -> TokenizedPrompt:
        """A fresh tokenization (the store-off path, as the pipeline tokenizes)."""
        self._check_length(text, max_length)
        return tokenize(self.tokenizer, text, max_length)

    def _check_length(self, text: object, max_length: object) -> None:
        _check_text(text, max_length)
        if max_length > self.max_length_limit:
            raise InvalidRequest(f"max_length {max_length} exceeds this encoder's limit of {self.max_length_limit}")

    def key(self, tokens: TokenizedPrompt, selector: Mapping | None = None, salt: bytes | str | None = b"") -> bytes:
        if not isinstance(tokens, TokenizedPrompt):
            raise InvalidRequest(f"tokens must be a TokenizedPrompt, got {type(tokens).__name__}")
        return self._key(self.fingerprint, tokens, self.check_selector(selector), salt)

    @staticmethod
    def _key(fingerprint: str, tokens: TokenizedPrompt, selector: dict, salt: bytes | str | None) -> bytes:
        return store_key(fingerprint, tokens.digest(selector), salt)

    def check_selector(self, selector: Mapping | None) -> dict:
        """``selector`` as a dict (``{}`` for None); ``InvalidRequest`` for a name this adapter does not use, which
        would otherwise key equal outputs apart."""
        if selector is None:
            return {}
        if not isinstance(selector, Mapping):
            raise InvalidRequest(f"an output selector must be a mapping, got {type(selector).__name__}")
        unknown = sorted(str(name) for name in selector if name not in self.selectors)
        if unknown:
            raise InvalidRequest(f"{type(self).__name__} has no output selector {', '.join(unknown)}; "
                                 f"it takes {list(self.selectors)}")
        return dict(selector)

    @abc.abstractmethod
    def spec(self, tokens: TokenizedPrompt, selector: Mapping, dtype: torch.dtype) -> OutputSpec:
        """What ``forward`` returns for ``tokens`` from the model in ``dtype``: names, shapes, dtypes."""

    @abc.abstractmethod
    def forward(self, tokens: TokenizedPrompt, selector: Mapping) -> dict[str, torch.Tensor]:
        """One encoder forward of batch 1; the outputs as the pipeline holds them after its encoder call."""

    def encode(self, text: str, max_length: int, store: EncoderOutputStore | None = None,
               salt: bytes | str | None = b"", kind: str = "output", **selector) -> Lease:
        """A held lease on the encoder outputs for ``text``; release it when the request is done with them.
        ``kind`` is the store entry's kind (what the store's per-kind metrics count a lookup under).

        With ``store=None`` the prompt is tokenized afresh, the encoder runs and the lease holds nothing (the
        store-off path is this same code).
        """
        self._check_length(text, max_length)
        if store is not None and not isinstance(store, EncoderOutputStore):
            raise InvalidRequest(f"store must be an EncoderOutputStore or None, got {type(store).__name__}")
        selector = self.check_selector(selector)
        salt = Namer.salt_bytes(salt)  # refused before anything is tokenized, run or held
        tokens = self.tokenize(text, max_length) if store is None else self.memo(text, max_length, salt)
        fingerprint, dtype = self._state()  # one look at the model per call: key and spec from the same state
        key = self._key(fingerprint, tokens, selector, salt)
        spec = self.spec(tokens, selector, dtype)

        def compute():
            with self._serving(store, fingerprint, salt, tokens):
                outputs = self.forward(tokens, selector)
            return outputs, {"tokens": tokens.token_bytes(), "length": tokens.length}

        if store is None:
            outputs, meta = compute()
            spec.check(key, outputs)
            return Lease(key, outputs, meta, hit=False)
        lease = store.get_or_compute(key, compute, spec, kind=kind)
        if lease.meta.get("tokens") != tokens.token_bytes():
            lease.release()  # a 128-bit key collision: never use another prompt's outputs
            outputs, meta = compute()
            spec.check(key, outputs)
            return Lease(key, outputs, meta, hit=False, bypassed=True)
        return lease

    def _serving(self, store: EncoderOutputStore | None, fingerprint: str, salt, tokens: TokenizedPrompt):
        """What the store serves inside one forward besides its outputs (nothing here; T5's position biases)."""
        return contextlib.nullcontext()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


@dataclass(frozen=True)
class T5Recipe:
    """How a pipeline runs a T5-family encoder. Wan (umT5): mask passed, output trimmed to the real length.
    SD3 (T5): no mask, all ``max_length`` positions kept."""

    attention_mask: bool
    trim_to_length: bool

    def __post_init__(self):
        for name in ("attention_mask", "trim_to_length"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"T5Recipe.{name} must be a bool, got {getattr(self, name)!r}")


class T5EncoderAdapter(TextEncoderAdapter):
    """``T5EncoderModel`` / ``UMT5EncoderModel``: one output, ``hidden`` = last hidden state. Relative position
    buckets set no length limit of their own; ``max_length_limit`` (default ``T5_MAX_LENGTH``) does."""

    def __init__(self, tokenizer, model, recipe: T5Recipe, max_length_limit: int = T5_MAX_LENGTH,
                 position_biases: bool = True):
        if not isinstance(recipe, T5Recipe):
            raise InvalidRequest(f"recipe must be a T5Recipe, got {type(recipe).__name__}")
        if not isinstance(position_biases, bool):
            raise InvalidRequest(f"position_biases must be a bool, got {position_biases!r}")
        super().__init__(tokenizer, model, {"kind": "t5", "attention_mask": recipe.attention_mask,
                                            "trim_to_length": recipe.trim_to_length}, max_length_limit)
        self.recipe = recipe
        self.position_biases = PositionBiases(model) if position_biases else None

    def _serving(self, store, fingerprint, salt, tokens):
        if store is None or self.position_biases is None:
            return contextlib.nullcontext()
        return self.position_biases.serving(store, fingerprint, salt, tokens.max_length)

    def spec(self, tokens, selector, dtype) -> OutputSpec:
        rows = tokens.length if self.recipe.trim_to_length else tokens.max_length
        return OutputSpec({"hidden": ((rows, self.model.config.d_model), dtype)})

    def forward(self, tokens, selector):
        ids = tokens.input_ids[None].to(self.device)
        with torch.no_grad():
            if self.recipe.attention_mask:
                out = self.model(ids, tokens.attention_mask[None].to(self.device)).last_hidden_state
            else:
                out = self.model(ids)[0]
        hidden = out.to(dtype=self.model.dtype)[0]
        # A trimmed row slice would keep all max_length rows alive while the store counts only its own bytes.
        return {"hidden": hidden[: tokens.length].clone() if self.recipe.trim_to_length else hidden}


class CLIPEncoderAdapter(TextEncoderAdapter):
    """``CLIPTextModelWithProjection`` as SD3 runs it (no mask): ``hidden`` = the selected hidden state
    (``hidden_layer``, -2 by default, ``-(clip_skip + 2)`` with clip_skip) and ``pooled`` = the projected
    pooled output. Its learned position embeddings limit max_length to ``max_position_embeddings`` (77)."""

    selectors = ("hidden_layer",)

    def __init__(self, tokenizer, model):
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if not isinstance(model, torch.nn.Module) or limit is None:
            raise InvalidRequest(f"CLIPEncoderAdapter needs a CLIP text model, got {type(model).__name__}")
        super().__init__(tokenizer, model, {"kind": "clip-with-projection"}, limit)

    def encode(self, text, max_length, store=None, salt=b"", hidden_layer: int = -2, **selector) -> Lease:
        return super().encode(text, max_length, store, salt, hidden_layer=hidden_layer, **selector)

    def check_selector(self, selector: Mapping | None) -> dict:
        selector = super().check_selector(selector)
        if "hidden_layer" in selector:
            hidden_layer = selector["hidden_layer"]
            layers = self.model.config.num_hidden_layers + 1  # hidden_states holds the embeddings and every layer
            if isinstance(hidden_layer, bool) or not isinstance(hidden_layer, int) or not -layers <= hidden_layer < 0:
                raise InvalidRequest(f"hidden_layer must be an int in [{-layers}, -1], got {hidden_layer!r}")
        return selector

    def spec(self, tokens, selector, dtype) -> OutputSpec:
        cfg = self.model.config
        return OutputSpec({"hidden": ((tokens.max_length, cfg.hidden_size), dtype),
                           "pooled": ((cfg.projection_dim,), dtype)})

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
        for module in modules:
            if not isinstance(module, torch.nn.Module):
                raise InvalidRequest(f"ForwardCounter counts torch modules, got {type(module).__name__}")
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
