"""Reference-audio encoding through the store: a voice-cloning pipeline's codec runs once per reference clip.

A voice-cloning model conditions every request on a recording of the voice to clone. transformers' CSM
(``CsmForConditionalGeneration``) turns each clip of its prompt into codebook frames with its Mimi codec,
``codec_model.encode``, inside ``generate``, on every request; a server whose requests share a reference voice
encodes that clip again each time. ``CachedCodecEncode`` replaces ``encode`` on that one codec instance (the
pipeline's code is unchanged) with a lookup in the encoder-output store.

``key = store_key(fingerprint, content digest, salt)`` where

* ``fingerprint`` = ``text_encoders.module_fingerprint`` of the codec: its class, configuration, attention
  implementation, device type and every weight, with this adapter's recipe;
* the content digest is ``names.media_digest`` over the bytes of the waveform tensor ``encode`` receives, with
  its dtype and shape, the padding mask's bytes and ``num_quantizers``: the key names the samples the codec
  computes on, so any change before the codec (another file, gain, resampling, padding) changes the key.

Invariants:

* Only the plain call is served from the store: ``encode(input_values, padding_mask=None,
  num_quantizers=None)`` on a codec whose config returns no cache, hidden states or attentions. Any other
  call (streaming state, extra keywords) runs the original ``encode`` unchanged (``passthrough`` counts it).
* Store on and store off give bit-identical codes: an entry holds the codes one ``encode`` of the same tensor
  returned, checked against the declared output (``int64 [batch, quantizers, frames]``), and every call returns
  a copy, so a caller cannot change a stored entry. No lease outlives the call; a failing encode stores nothing.
* Bad input (not a floating-point tensor ``[batch, channels, samples]`` with samples) is refused with
  ``InvalidRequest`` before anything runs or is stored.
* The codec's weights must not change while it is attached (the fingerprint is taken once).
"""

from __future__ import annotations

import threading
import time

import torch
from transformers.models.mimi.modeling_mimi import MimiEncoderOutput

from mmcache.errors import InvalidRequest
from mmcache.names import Namer, media_digest
from mmcache.store import EncoderOutputStore, OutputSpec, store_key

from .text_encoders import module_fingerprint

ADAPTER_VERSION = 1
_STATE_KEYWORDS = ("encoder_cache", "padding_cache", "use_streaming")


class CachedCodecEncode:
    """Callable standing in for ``codec.encode`` while attached (``with CachedCodecEncode(codec, store):``)."""

    def __init__(self, codec: torch.nn.Module, store: EncoderOutputStore | None, *, salt: bytes | str | None = b""):
        from transformers import MimiModel

        if not isinstance(codec, MimiModel):
            raise InvalidRequest(f"the codec must be a transformers MimiModel (CSM's codec), got {type(codec).__name__}")
        if store is not None and not isinstance(store, EncoderOutputStore):
            raise InvalidRequest(f"store must be an EncoderOutputStore or None, got {type(store).__name__}")
        self.codec = codec
        self.store = store
        self.salt = Namer.salt_bytes(salt)
        self.fingerprint = module_fingerprint(codec, {"adapter": "codec-encode", "version": ADAPTER_VERSION})
        self.spec = OutputSpec({"audio_codes": ((None, None, None), torch.int64)})
        self._max_quantizers = codec.config.num_quantizers
        self._lock = threading.Lock()
        self.calls = 0  # codec forwards run (misses, passthroughs and every call with the store off)
        self.hits = 0
        self.passthrough = 0
        self.encode_s = 0.0  # time inside encode, lookups included

    # ---- attaching -----------------------------------------------------------------------------------
    def attach(self) -> "CachedCodecEncode":
        if isinstance(self.codec.__dict__.get("encode"), CachedCodecEncode):
            raise InvalidRequest("this codec's encode is already served through a store")
        self.codec.encode = self
        return self

    def detach(self) -> None:
        if self.codec.__dict__.get("encode") is self:
            del self.codec.encode

    def __enter__(self) -> "CachedCodecEncode":
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    # ---- keys ----------------------------------------------------------------------------------------
    def key(self, input_values: torch.Tensor, padding_mask: torch.Tensor | None = None,
            num_quantizers: int | None = None) -> bytes:
        self._check(input_values, padding_mask, num_quantizers)
        mask = None if padding_mask is None else media_digest(_bytes(padding_mask), {"shape": list(padding_mask.shape),
                                                                                       "dtype": str(padding_mask.dtype)})
        params = {"dtype": str(input_values.dtype), "shape": list(input_values.shape),
                  "padding_mask": None if mask is None else mask.hex(), "num_quantizers": num_quantizers}
        return store_key(self.fingerprint, media_digest(_bytes(input_values), params), self.salt)

    def _check(self, input_values, padding_mask, num_quantizers) -> None:
        t, channels = input_values, self.codec.config.audio_channels
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 3 and t.shape[0] > 0
                and t.shape[1] == channels and t.shape[2] > 0):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidRequest(f"codec input must be a floating-point tensor [batch, {channels}, samples], got {got}")
        m = padding_mask
        if m is not None and not (isinstance(m, torch.Tensor) and m.dim() >= 2 and m.shape[0] == t.shape[0]
                                  and m.shape[-1] == t.shape[-1]):
            raise InvalidRequest("padding_mask must be a tensor with the input's batch and sample sizes")
        q = num_quantizers
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or not 1 <= q <= self._max_quantizers):
            raise InvalidRequest(f"num_quantizers must be an int in [1, {self._max_quantizers}] or None, got {q!r}")

    # ---- the call ------------------------------------------------------------------------------------
    def __call__(self, input_values, padding_mask=None, num_quantizers=None, **kwargs):
        original = type(self.codec).encode
        if set(kwargs) - set(_STATE_KEYWORDS) or any(kwargs.values()) or not self._plain_outputs():
            with self._lock:
                self.passthrough += 1
                self.calls += 1
            return original(self.codec, input_values, padding_mask=padding_mask, num_quantizers=num_quantizers,
                            **kwargs)
        t0 = time.perf_counter()
        try:
            if self.store is None:
                self._check(input_values, padding_mask, num_quantizers)
                codes = self._run(original, input_values, padding_mask, num_quantizers)["audio_codes"]
            else:
                key = self.key(input_values, padding_mask, num_quantizers)
                with self.store.get_or_compute(
                        key, lambda: (self._run(original, input_values, padding_mask, num_quantizers), {}),
                        self.spec) as lease:
                    codes = lease.outputs["audio_codes"].clone()
                    if lease.hit:
                        with self._lock:
                            self.hits += 1
        finally:
            with self._lock:
                self.encode_s += time.perf_counter() - t0
        return MimiEncoderOutput(audio_codes=codes)

    def _run(self, original, input_values, padding_mask, num_quantizers) -> dict:
        with self._lock:
            self.calls += 1
        with torch.no_grad():
            out = original(self.codec, input_values, padding_mask=padding_mask, num_quantizers=num_quantizers)
        return {"audio_codes": out.audio_codes}

    def _plain_outputs(self) -> bool:
        c = self.codec.config
        return not any(getattr(c, k, False) for k in ("use_cache", "output_hidden_states", "output_attentions"))

    def stats(self) -> dict:
        return {"calls": self.calls, "hits": self.hits, "passthrough": self.passthrough, "encode_s": self.encode_s}


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())

