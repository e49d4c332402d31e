"""Reference-audio encoding through the store: a voice-cloning pipeline's codec runs once per reference clip.

A voice-cloning model conditions every request on a recording of the voice to clone. transformers' CSM
(``CsmForConditionalGeneration``) turns each clip of its prompt into codebook frames with its Mimi codec,
``codec_model.encode``, inside ``generate``, on every request; a server whose requests share a reference voice
encodes that clip again each time. ``CachedCodecEncode`` replaces ``encode`` on that one codec instance (the
pipeline's code is unchanged) with a lookup in the encoder-output store.

``key = store_key(fingerprint, content digest, salt)`` where

* ``fingerprint`` = ``fingerprint.module_fingerprint`` of the codec: its class, configuration and the copy
  its encoder runs on, their attention implementations, device type and every weight, with this adapter's
  recipe. Taking it drops the codebooks' cached centroids (``_embed``), which transformers' Mimi computes at
  first use and never again, so codes filed under new weights are computed with them;
* the content digest is ``names.media_digest`` over the bytes of the waveform tensor ``encode`` receives, with
  its dtype and shape, the padding mask's bytes, ``num_quantizers``, the autocast dtype when autocast is on
  (it changes the codes) and the request's preprocessing descriptor when it has one (a reference resampled by
  ``audio.decode_clip``: the resampler, its settings and rates): the key names the samples the codec computes
  on and how they were made, so any change before the codec (another file, gain, resampling, padding) changes
  the key, and a clip that needed no resampling keys exactly as without a descriptor.

Invariants:

* Only the plain call is served from the store: ``encode(input_values, padding_mask=None,
  num_quantizers=None)`` on a codec whose config (and its encoder's own copy) asks for no cache, streaming
  state, hidden states or attentions and returns a ``ModelOutput``. Any other call (streaming state, extra
  positional or keyword arguments, as ``MimiModel.forward`` makes) runs the original ``encode`` unchanged
  (``passthrough`` counts it). ``num_quantizers=None`` and the codec's full count are one key.
* Store on and store off give bit-identical codes: an entry holds the codes one ``encode`` of the same tensor
  returned, checked against the declared output (``int64 [batch, quantizers, frames]``), and every call returns
  a copy, so a caller cannot change a stored entry. No lease outlives the call; a failing encode stores nothing.
* Bad input (not a floating-point tensor ``[batch, channels, samples]`` with samples, on the codec's device
  type, in its dtype unless autocast is on) is refused with ``InvalidRequest`` before anything runs or is stored.
* The fingerprint follows the codec through ``fingerprint.LiveFingerprint``, as the text encoders' does: it is
  taken again whenever a weight tensor was replaced, moved or cast (its identity, storage, dtype or device) or
  written in place through autograd's view (its version counter, as ``load_state_dict`` writes), when an
  attention kernel changed, and when the configuration changed (compared at every ``attach``); after a write
  through ``.data`` or a replaced submodule, which those cannot see, call ``refresh``.
* ``attach`` patches the codec instance and ``detach`` puts back what was there; one attach per codec at a
  time (a second is refused): a server handling requests concurrently attaches once, not per request.
* The salt is per call, not per instance: ``with enc.salted(salt, preprocessing=clip.preprocessing):`` around
  a request's ``generate`` keys every ``encode`` inside it with that salt and descriptor (neither outside such a
  block). They live in a context variable, so each thread (and each asyncio task) sees only what it set: one
  attached codec serves every tenant at once, and two salts never share an entry. ``Namer.salt_bytes`` checks
  the salt (type, text, length) and ``canonical_encoding`` the descriptor on entry. Enter the block in the
  thread that runs ``generate`` (``asyncio.to_thread`` carries the caller's context there; a bare thread pool
  does not).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import threading
import time
from collections.abc import Iterator

import numpy as np
import torch
from transformers.models.mimi.modeling_mimi import MimiEncoderOutput

from mmcache.errors import InvalidRequest
from mmcache.names import Namer, canonical_encoding, media_digest
from mmcache.store import EncoderOutputStore, OutputSpec, store_key

from .fingerprint import LiveFingerprint, kernel_implementations, module_fingerprint

ADAPTER_VERSION = 1
_STATE_KEYWORDS = ("encoder_cache", "padding_cache", "use_streaming")


class CachedCodecEncode:
    """Callable standing in for ``codec.encode`` while attached (``with CachedCodecEncode(codec, store):``); its
    store entries are of ``kind`` (default ``"output"``; a server files them as ``"codec"``)."""

    def __init__(self, codec: torch.nn.Module, store: EncoderOutputStore | None, kind: str = "output"):
        from transformers import MimiModel

        if not isinstance(codec, MimiModel):
            raise InvalidRequest(f"the codec must be a transformers MimiModel (CSM's codec), got "
                                 f"{type(codec).__name__}")
        if store is not None and not isinstance(store, EncoderOutputStore):
            raise InvalidRequest(f"store must be an EncoderOutputStore or None, got {type(store).__name__}")
        if not isinstance(kind, str) or not kind:
            raise InvalidRequest(f"an entry kind must be a non-empty str, got {kind!r}")
        self.codec = codec
        self.store = store
        self.kind = kind  # the kind of the store entries it makes (the store's per-kind metrics count them apart)
        # (salt, preprocessing descriptor) of the calls in the current thread or task (``salted``); one variable
        # per instance, so two adapters (two codecs) keep theirs apart
        self._request: contextvars.ContextVar[tuple[bytes, object]] = contextvars.ContextVar(
            f"codec_request_{id(self)}", default=(b"", None))
        self.spec = OutputSpec({"audio_codes": ((None, None, None), torch.int64)})
        self._max_quantizers = codec.config.num_quantizers
        self._lock = threading.Lock()
        self._fingerprint = LiveFingerprint(codec, self._take_fingerprint)
        self._config: str | None = None  # the configuration when last attached
        self._replaced: list = []  # what ``encode`` was on the instance before each attach (a stack)
        self.calls = 0  # codec forwards run (misses, passthroughs and every call with the store off)
        self.hits = 0
        self.passthrough = 0
        self.encode_s = 0.0  # time inside encode, lookups included

    # ---- attaching -----------------------------------------------------------------------------------
    def attach(self) -> "CachedCodecEncode":
        """Serve ``codec.encode`` through the store until ``detach``. One attach per codec at a time: a server
        handling requests concurrently attaches once, not per request."""
        if isinstance(self.codec.__dict__.get("encode"), CachedCodecEncode):
            raise InvalidRequest("this codec's encode is already served through a store")
        self._replaced.append(self.codec.__dict__.get("encode", _ABSENT))
        config = self._config_state()
        if config != self._config:  # a configuration changed while detached is seen
            self.refresh()
            self._config = config
        self.codec.encode = self
        return self

    def detach(self) -> None:
        """Put back what ``encode`` was before ``attach`` (the class's method, or an earlier instance patch)."""
        if self.codec.__dict__.get("encode") is self and self._replaced:
            previous = self._replaced.pop()
            if previous is _ABSENT:
                del self.codec.encode
            else:
                self.codec.encode = previous

    def __enter__(self) -> "CachedCodecEncode":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    # ---- salts ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def salted(self, salt: bytes | str | None, *, preprocessing: object = None) -> Iterator["CachedCodecEncode"]:
        """Key every ``encode`` this thread (or asyncio task) makes inside the block with ``salt`` (a request's
        tenant) and ``preprocessing`` (how its reference samples were made, ``audio.DecodedAudio.preprocessing``;
        None: as they came). ``InvalidRequest`` for a salt ``Namer.salt_bytes`` refuses or a descriptor with no
        canonical encoding, before the block runs."""
        # a private, checked copy: a descriptor the caller changes inside the block cannot change the keys
        frozen = None if preprocessing is None else json.loads(canonical_encoding(preprocessing))
        token = self._request.set((Namer.salt_bytes(salt), frozen))
        try:
            yield self
        finally:
            self._request.reset(token)

    @property
    def salt(self) -> bytes:
        """The salt calls made here and now are keyed with (``salted``; empty outside any such block)."""
        return self._request.get()[0]

    # ---- keys ----------------------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """The codec's fingerprint, taken again when a weight tensor was replaced (in ``_parameters`` /
        ``_buffers``, or its storage through ``.data = ...`` or ``.to``), written in place through autograd's view
        of it (its version counter) or the attention kernel changed (``LiveFingerprint``), and at each ``attach``
        or ``refresh`` (the configuration is compared then). A write through ``.data`` (``p.data.copy_(...)``)
        bypasses the version counter: call ``refresh`` after one, as after replacing a submodule."""
        return self._fingerprint()

    def _take_fingerprint(self) -> str:
        """The codec's fingerprint, after dropping its derived state: each Mimi codebook caches its centroids
        (``_embed``, ``embed_sum / cluster_usage``) at first use and never again, so after new weights it would
        quantize with the old ones and file those codes under the new weights' key."""
        for module in self.codec.modules():
            if "_embed" in vars(module) and isinstance(module._embed, torch.Tensor | None):
                module._embed = None
        return module_fingerprint(self.codec, {"adapter": "codec-encode", "version": ADAPTER_VERSION})

    def _config_state(self) -> str:
        c, e = self.codec.config, self.codec.encoder.config
        return c.to_json_string() + e.to_json_string() + repr(kernel_implementations(c)) \
            + repr(kernel_implementations(e))

    def refresh(self) -> None:
        """Take the fingerprint again at the next call (after changes ``fingerprint`` cannot see)."""
        self._fingerprint.refresh()

    def key(self, input_values: torch.Tensor, padding_mask: torch.Tensor | None = None,
            num_quantizers: int | None = None, *, salt: bytes | str | None = None,
            preprocessing: object = None) -> bytes:
        """The store key ``encode`` files this input under: with ``salt`` and ``preprocessing``, each of which
        defaults (None) to the current ``salted`` block's."""
        current_salt, current_preprocessing = self._request.get()
        request = (current_salt if salt is None else Namer.salt_bytes(salt),
                   current_preprocessing if preprocessing is None else preprocessing)
        q = self._check(input_values, padding_mask, num_quantizers)
        return self._key(input_values, padding_mask, q, request)

    def _key(self, input_values: torch.Tensor, padding_mask: torch.Tensor | None, q: int,
             request: tuple[bytes, object]) -> bytes:
        """``key`` of input ``_check`` passed, ``q`` the quantizer count it returned, ``request`` the salt and
        preprocessing descriptor."""
        salt, preprocessing = request
        mask = None if padding_mask is None else media_digest(
            _bytes(padding_mask), {"shape": list(padding_mask.shape), "dtype": str(padding_mask.dtype)})
        params = {"dtype": str(input_values.dtype), "shape": list(input_values.shape),
                  "padding_mask": None if mask is None else mask.hex(), "num_quantizers": q,
                  "autocast": _autocast(input_values.device.type)}
        if preprocessing is not None:  # absent otherwise: a clip used as it came keys as it always did
            params["preprocessing"] = preprocessing
        return store_key(self.fingerprint, media_digest(_bytes(input_values), params), salt)

    def _check(self, input_values, padding_mask, num_quantizers) -> int:
        """Refuses malformed input; returns the number of quantizers the codec will use (None: all of them)."""
        t, channels = input_values, self.codec.config.audio_channels
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 3 and t.shape[0] > 0
                and t.shape[1] == channels and t.shape[2] > 0):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidRequest(f"codec input must be a floating-point tensor [batch, {channels}, samples], got {got}")
        weight = next(self.codec.parameters())
        mixed = t.dtype != weight.dtype and _autocast(weight.device.type) is None  # autocast casts both
        if mixed or t.device.type != weight.device.type:  # the convolution would raise
            raise InvalidRequest(f"codec input is {t.dtype} on {t.device.type}; the codec runs in {weight.dtype} on "
                                 f"{weight.device.type} (cast the waveform first)")
        m = padding_mask
        if m is not None and not (isinstance(m, torch.Tensor) and m.dim() >= 2 and m.shape[0] == t.shape[0]
                                  and m.shape[-1] == t.shape[-1]):
            raise InvalidRequest("padding_mask must be a tensor with the input's batch and sample sizes")
        q = self._max_quantizers if num_quantizers is None else num_quantizers
        if isinstance(q, bool) or not isinstance(q, (int, np.integer)) or not 1 <= q <= self._max_quantizers:
            raise InvalidRequest(f"num_quantizers must be an int in [1, {self._max_quantizers}] or None, got {q!r}")
        return int(q)

    # ---- the call ------------------------------------------------------------------------------------
    def __call__(self, input_values, padding_mask=None, num_quantizers=None, *args, **kwargs):
        original = type(self.codec).encode
        state = any(v is not None and v is not False for v in kwargs.values())  # an empty cache object is state
        if args or set(kwargs) - set(_STATE_KEYWORDS) or state or not self._plain_call():
            with self._lock:
                self.passthrough += 1
                self.calls += 1
            return original(self.codec, input_values, padding_mask, num_quantizers, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            if self.store is None:
                # nothing is keyed, but new weights drop the stale centroids here too (the first call, and the
                # first after a change, hash the weights: about 0.2 s for the published Mimi)
                self._fingerprint()
                q = self._check(input_values, padding_mask, num_quantizers)
                codes = self._run(original, input_values, padding_mask, q)["audio_codes"]
            else:
                q = self._check(input_values, padding_mask, num_quantizers)
                key = self._key(input_values, padding_mask, q, self._request.get())
                with self.store.get_or_compute(key, lambda: (self._run(original, input_values, padding_mask, q), {}),
                                               self.spec, kind=self.kind) as lease:
                    codes = lease.outputs["audio_codes"].clone()
                    if lease.hit:
                        with self._lock:
                            self.hits += 1
        finally:
            with self._lock:
                self.encode_s += time.perf_counter() - t0
        return MimiEncoderOutput(audio_codes=codes)

    def _run(self, original, input_values, padding_mask, num_quantizers: int) -> dict:
        with self._lock:
            self.calls += 1
        with torch.no_grad():
            out = original(self.codec, input_values, padding_mask=padding_mask, num_quantizers=num_quantizers,
                           return_dict=True)
        return {"audio_codes": out.audio_codes}

    def _plain_call(self) -> bool:
        """Whether a call with no state argument returns the codes alone: no cache, streaming state, hidden
        states or attentions, asked for by the codec's config or its encoder's own copy, and a ModelOutput."""
        configs = (self.codec.config, self.codec.encoder.config)
        if any(getattr(c, k, False) for c in configs
               for k in ("use_cache", "use_streaming", "output_hidden_states", "output_attentions")):
            return False
        return getattr(self.codec.config, "return_dict", True) is not False

    def stats(self) -> dict:
        return {"calls": self.calls, "hits": self.hits, "passthrough": self.passthrough, "encode_s": self.encode_s}


_ABSENT = object()


def _autocast(device_type: str) -> str | None:
    """The dtype autocast computes in on ``device_type`` now, or None when it is off: the codes depend on it."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return str(torch.get_autocast_dtype(device_type))


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())

