"""Vision-tower adapters for transformers VLMs: image -> features at the placeholder tokens, through the store.

``LlavaVisionAdapter`` serves ``LlavaForConditionalGeneration`` (a CLIP or SigLIP tower and the projector);
``Qwen2VLVisionAdapter`` serves ``Qwen2VLForConditionalGeneration`` (its tower with the patch merger). Both call
the model's own ``get_image_features``, the code its forward runs for ``pixel_values``, so the features are
the rows the model itself would substitute.

Invariants:

* ``preprocess_params`` holds every parameter that changes an image's embedding: the image processor's full
  configuration, its class and the transformers version, and the decode rule (``media.DECODE_PARAMS``). The
  media digest is ``names.media_digest(bytes as sent, preprocess_params)``.
* ``fingerprint`` is a digest of the adapter kind, the tower and projector configuration, the attention and
  experts implementations of every config the tower modules run on (``fingerprint.module_kernels``:
  transformers leaves them out of the config's JSON, yet sdpa and eager features differ in their last bits),
  their weights (``fingerprint.weights_digest``: every tensor's name, dtype, shape and bytes), the device type and
  ``preprocess_params``. The language model's attention is not part of it (the engine routes it through its
  paged backend when it attaches; the features do not depend on it).
* The fingerprint, ``preprocess_params`` and the declared dtype follow the model and the image processor
  (``fingerprint.LiveFingerprint`` over the tower modules): they are taken again at the next encode after a
  tower weight or buffer is replaced, moved or cast, written in place through autograd's view, a tower config
  or top-level config attribute changes (``set_attn_implementation`` on the tower, ``vision_feature_layer``) or
  an image processor attribute is set. A write through ``.data``, a replaced submodule and a value edited in
  place (a list or dict changed, not set) are not seen by themselves: call ``refresh()`` after them. None of
  these may run concurrently with an encode.
* Store key = ``store_key(fingerprint, media digest, salt)``. The tower runs only on a store miss, once per key
  at a time; a hit decodes nothing. Decode or encode failures store nothing. Nothing verifies a hit against the
  image, so the media digest and the key are BLAKE2b-256 (``names.content_hasher``): a sender cannot make two
  images share features. The fingerprint stays xxh3_128: it digests the server's own weights and settings,
  which no request chooses, and weights are hashed far faster than with BLAKE2b.
* An image is decoded and preprocessed under its reservation of the limits' decode budget (``media.decoding``);
  its full-size pixels do not outlive the reservation, and the tower runs after it ends.
* Every ``EncodedImage`` holds a lease on its entry until ``release``; ``encode_all`` either returns one held
  image per item or, on any failure, releases every lease it took before re-raising.
* Bad arguments are refused before anything is read, stored or held: ``encode_all`` takes a list or tuple (one
  bytes object or path is not read as many items), ``digest`` and ``key`` take a ``RawImage`` or bytes-like
  data (never an int or a list, which ``bytes()`` would turn into other bytes), and the salt is checked first.
* Output: ``features`` is ``Tensor[num_placeholders, text_hidden]`` in the tower's dtype; ``meta`` holds
  ``num_placeholders`` and, for Qwen2-VL, ``grid_thw`` (patch units, the processor's convention).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

import torch
import transformers
import xxhash
from torch import nn

from mmcache.errors import InvalidRequest, MediaDecodeError
from mmcache.names import Namer, canonical_encoding, media_digest
from mmcache.store import EncoderOutputStore, Lease, OutputSpec, store_key

from .media import DECODE_PARAMS, ImageLimits, RawImage, decoding, read_image
from .fingerprint import LiveFingerprint, module_configs, module_kernels, weights_digest

ADAPTER_VERSION = 1


@dataclass
class EncodedImage:
    """One image's encoder output as used by one request; its store entry stays held until ``release``."""

    digest: bytes
    key: bytes
    lease: Lease

    @property
    def features(self) -> torch.Tensor:
        """``Tensor[num_placeholders, text_hidden]``; shared with the store, never modify it in place."""
        return self.lease.outputs["features"]

    @property
    def num_placeholders(self) -> int:
        return int(self.lease.meta["num_placeholders"])

    @property
    def grid_thw(self) -> tuple[int, int, int] | None:
        grid = self.lease.meta.get("grid_thw")
        return None if grid is None else tuple(int(x) for x in grid)

    @property
    def hit(self) -> bool:
        return self.lease.hit

    def release(self) -> None:
        self.lease.release()


def preprocessor_params(image_processor: Any) -> dict:
    """Everything about ``image_processor`` that changes its output, as a canonical-encodable dict."""
    if not callable(image_processor) or not callable(getattr(image_processor, "to_dict", None)):
        raise InvalidRequest(f"an image processor must be a transformers image processor, got "
                             f"{type(image_processor).__name__}")
    params = {k: _plain(v) for k, v in image_processor.to_dict().items()}
    params["processor_class"] = f"{type(image_processor).__module__}.{type(image_processor).__qualname__}"
    params["processor_version"] = transformers.__version__
    params.update(DECODE_PARAMS)
    return params


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return _plain(value.value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def config_dict(config: transformers.PretrainedConfig) -> dict:
    return json.loads(config.to_json_string(use_diff=False))


class VisionAdapter(ABC):
    """Base of the tower adapters: digests, store keys and the store round trip. Subclasses run the tower."""

    kind = ""

    def __init__(self, model: nn.Module, image_processor: Any, store: EncoderOutputStore,
                 limits: ImageLimits = ImageLimits()):
        if not isinstance(model, nn.Module):
            raise InvalidRequest(f"a vision adapter needs a torch model, got {type(model).__name__}")
        if not isinstance(store, EncoderOutputStore):
            raise InvalidRequest(f"a vision adapter needs an EncoderOutputStore, got {type(store).__name__}")
        if not isinstance(limits, ImageLimits):
            raise InvalidRequest(f"limits must be ImageLimits, got {type(limits).__name__}")
        self.model = model
        self.image_processor = image_processor
        self.store = store
        self.limits = limits
        preprocessor_params(image_processor)  # refuses what is not an image processor, before anything is taken
        # (fingerprint, preprocess params, output spec), taken again when the tower, its configs or the image
        # processor change (``fingerprint.LiveFingerprint``)
        self._state = LiveFingerprint(self._tower_modules(), self._describe, watched=self._watched)
        self._state()  # now, so that the first request does not pay for it

    def _watched(self) -> list[object]:
        """What the fingerprint reads besides the tower's tensors: each tower module's config and the configs
        nested in it, the model's top-level config (its own attributes: the language model's nested config is
        not followed, the engine sets its attention when it attaches) and the image processor."""
        towers = [cfg for m in self._tower_modules() for cfg in module_configs(m).values()]
        return [*towers, self.model.config, self.image_processor]

    def _describe(self) -> tuple[str, dict, OutputSpec]:
        params = preprocessor_params(self.image_processor)
        description = {
            "adapter": self.kind,
            "adapter_version": ADAPTER_VERSION,
            "config": self._tower_config(),
            # the configs the tower modules run on (a transformers sub-model carries one; the projector has
            # none), not the whole model's: the engine sets the language model's attention when it attaches,
            # which must not key the same tower's features apart
            "kernels": [module_kernels(m) for m in self._tower_modules()],
            "weights": weights_digest(self._tower_modules()),
            "device": next(self.model.parameters()).device.type,
            "preprocess": params,
        }
        spec = OutputSpec({"features": ((None, self.text_hidden), self.tower_dtype)})
        return xxhash.xxh3_128_hexdigest(canonical_encoding(description)), params, spec

    @property
    def fingerprint(self) -> str:
        """The tower's fingerprint as it is now (taken again after a change; see the module docstring)."""
        return self._state()[0]

    @property
    def preprocess_params(self) -> dict:
        """The image processor's parameters as they are now: what every media digest is taken with."""
        return self._state()[1]

    @property
    def spec(self) -> OutputSpec:
        """The features' declared shape and dtype (the tower's dtype when the fingerprint was taken)."""
        return self._state()[2]

    def refresh(self) -> None:
        """Take the fingerprint again at the next encode: after a change it cannot see by itself (a write through
        ``.data``, a replaced submodule, a config or processor value edited in place)."""
        self._state.refresh()

    @property
    @abstractmethod
    def tower(self) -> nn.Module:
        """The vision tower module (its forward runs once per encoded miss)."""

    @property
    def text_hidden(self) -> int:
        return self.model.config.text_config.hidden_size

    @property
    def tower_dtype(self) -> torch.dtype:
        return next(self.tower.parameters()).dtype

    @staticmethod
    @abstractmethod
    def tower_pixels(image_processor: Any) -> int | None:
        """The most pixels ``image_processor`` hands the tower for one image (None: it does not say): what the
        server's default pixel limit is derived from (``media.photo_pixel_limit``)."""

    @abstractmethod
    def _tower_modules(self) -> list[nn.Module]:
        """The modules whose weights the features depend on (tower and projector)."""

    @abstractmethod
    def _tower_config(self) -> dict:
        """The configuration the features depend on, as plain JSON values."""

    @abstractmethod
    def _features(self, batch) -> tuple[torch.Tensor, dict]:
        """Run the tower on the image processor's output for one image: ``(Tensor[n, text_hidden], meta)``."""

    def digest(self, raw: RawImage | bytes) -> bytes:
        """The media digest of an image's bytes as sent (``RawImage`` or bytes-like); ``InvalidRequest`` for
        anything else (a path or data URL must be read first: ``media.read_image``)."""
        return self._digest(raw, self.preprocess_params)

    @staticmethod
    def _digest(raw: RawImage | bytes, params: dict) -> bytes:
        if isinstance(raw, RawImage):
            data = raw.data
        elif isinstance(raw, (bytes, bytearray, memoryview)):
            data = bytes(raw)
        else:
            raise InvalidRequest(f"an image digest is taken over a RawImage or bytes, got {type(raw).__name__}")
        return media_digest(data, params)

    def key(self, raw: RawImage | bytes, salt: bytes | str | None = b"") -> bytes:
        fingerprint, params, _ = self._state()
        return store_key(fingerprint, self._digest(raw, params), salt)

    def encode(self, image: object, *, salt: bytes | str | None = b"", index: int = 0) -> EncodedImage:
        """Held features of ``image`` (bytes, path, data URL or ``RawImage``); the tower runs on a store miss.

        Raises ``MediaDecodeError`` (naming item ``index``) for unreadable input; nothing is stored or held then.
        """
        Namer.salt_bytes(salt)  # refused before the image is read
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise InvalidRequest(f"index must be an int >= 0, got {index!r}")
        raw = read_image(image, index, self.limits)
        fingerprint, params, spec = self._state()
        digest = self._digest(raw, params)
        return self._acquire(raw, digest, store_key(fingerprint, digest, salt), spec)

    def encode_all(self, images: Sequence[object], *, salt: bytes | str | None = b"") -> list[EncodedImage]:
        """``encode`` for each item in request order (index = position in ``images``); repeated bytes share one
        ``EncodedImage``. On any failure every lease taken so far is released before the error propagates."""
        if not isinstance(images, (list, tuple)):  # one bytes object or path would read as many items
            raise InvalidRequest(f"images must be a list of images, got {type(images).__name__}")
        Namer.salt_bytes(salt)  # refused even when there is no image to key
        fingerprint, params, spec = self._state()  # one state for the whole request
        out: list[EncodedImage] = []
        by_key: dict[bytes, EncodedImage] = {}
        try:
            for index, image in enumerate(images):
                raw = read_image(image, index, self.limits)
                digest = self._digest(raw, params)
                key = store_key(fingerprint, digest, salt)
                if key not in by_key:
                    by_key[key] = self._acquire(raw, digest, key, spec)
                out.append(by_key[key])
        except BaseException:
            for encoded in by_key.values():
                encoded.release()
            raise
        return out

    def _acquire(self, raw: RawImage, digest: bytes, key: bytes, spec: OutputSpec) -> EncodedImage:
        lease = self.store.get_or_compute(key, lambda: self._compute(raw), spec)
        return EncodedImage(digest, key, lease)

    def _compute(self, raw: RawImage) -> tuple[dict, dict]:
        batch = self._preprocess(raw)
        with torch.no_grad():
            features, meta = self._features(batch)
        return {"features": features}, meta

    def _preprocess(self, raw: RawImage):
        """The image processor's tensors of ``raw``, made under its decode budget reservation (the processor works
        on the full-size pixels, which end with the reservation)."""
        with decoding(raw, self.limits) as pixels:
            try:
                return self.image_processor(images=[pixels], return_tensors="pt")
            except ValueError as e:  # a decodable image the model's processor will not take (Qwen2-VL: aspect > 200)
                raise MediaDecodeError(raw.ref, f"the model's image processor refused it: {e}") from e


class LlavaVisionAdapter(VisionAdapter):
    """``LlavaForConditionalGeneration``: tower hidden states at ``vision_feature_layer`` (CLS dropped under the
    ``default`` strategy) through the projector; a fixed number of placeholders per image."""

    kind = "llava"

    @property
    def tower(self) -> nn.Module:
        return self.model.model.vision_tower

    @staticmethod
    def tower_pixels(image_processor: Any) -> int | None:
        """CLIP: the centre crop; SigLIP: the fixed size; a shortest-edge resize without a crop: its square."""
        crop = getattr(image_processor, "crop_size", None) or {}
        size = getattr(image_processor, "size", None) or {}
        if getattr(image_processor, "do_center_crop", False) and crop.get("height") and crop.get("width"):
            return int(crop["height"]) * int(crop["width"])
        if size.get("height") and size.get("width"):
            return int(size["height"]) * int(size["width"])
        return int(size["shortest_edge"]) ** 2 if size.get("shortest_edge") else None

    def _tower_modules(self) -> list[nn.Module]:
        return [self.model.model.vision_tower, self.model.model.multi_modal_projector]

    def _tower_config(self) -> dict:
        c = self.model.config
        return {
            "vision": config_dict(c.vision_config),
            "vision_feature_layer": c.vision_feature_layer,
            "vision_feature_select_strategy": c.vision_feature_select_strategy,
            "projector_hidden_act": c.projector_hidden_act,
            "multimodal_projector_bias": c.multimodal_projector_bias,
            "text_hidden": c.text_config.hidden_size,
        }

    def _features(self, batch) -> tuple[torch.Tensor, dict]:
        pixel_values = batch["pixel_values"].to(next(self.tower.parameters()).device, self.tower_dtype)
        out = self.model.model.get_image_features(pixel_values=pixel_values, return_dict=True)
        features = out.pooler_output[0]
        return features, {"num_placeholders": int(features.shape[0])}


class Qwen2VLVisionAdapter(VisionAdapter):
    """``Qwen2VLForConditionalGeneration``: the tower over the image's patches, merged ``merge x merge``; an image
    of grid (t, h, w) patches gets ``t*h*w / merge**2`` placeholders."""

    kind = "qwen2_vl"

    @property
    def tower(self) -> nn.Module:
        return self.model.model.visual

    @property
    def spatial_merge_size(self) -> int:
        return int(self.model.config.vision_config.spatial_merge_size)

    @staticmethod
    def tower_pixels(image_processor: Any) -> int | None:
        """The processor's ``max_pixels`` (its ``size["longest_edge"]`` counts pixels, not an edge)."""
        size = getattr(image_processor, "size", None) or {}
        most = size.get("longest_edge") or getattr(image_processor, "max_pixels", None)
        return int(most) if most else None

    def _tower_modules(self) -> list[nn.Module]:
        return [self.model.model.visual]

    def _tower_config(self) -> dict:
        return {"vision": config_dict(self.model.config.vision_config),
                "text_hidden": self.model.config.text_config.hidden_size}

    def _features(self, batch) -> tuple[torch.Tensor, dict]:
        device = next(self.tower.parameters()).device
        grid = batch["image_grid_thw"].to(device)
        out = self.model.model.get_image_features(batch["pixel_values"].to(device), grid, return_dict=True)
        features = out.pooler_output[0]
        return features, {"num_placeholders": int(features.shape[0]), "grid_thw": [int(x) for x in grid[0]]}
