"""OpenAI-style chat messages (or token ids) plus images -> a ``MultimodalPrompt`` ready for a VLM engine.

``PromptBuilder`` pairs a chat template with a vision adapter. For each request it encodes the images through
the encoder-output store (the tower runs only for images the store does not hold), renders the token ids with
each image's placeholder run expanded, and returns what an engine needs: ``media`` (one ``MediaItem`` per
image for page names), ``embeds`` (features to substitute at the placeholders) and, for Qwen2-VL, the 3-D rotary
positions and their delta.

Message format (a list of ``{"role", "content"}`` dicts, roles ``system`` / ``user`` / ``assistant``):

* ``content`` is a string or a list of parts: ``{"type": "text", "text": str}``,
  ``{"type": "image_url", "image_url": {"url": data URL, file:// URL or path}}`` (``image_url`` may also be the
  URL string itself), or ``{"type": "image", "image": bytes | path | data URL}``. Images only in user messages.
* An assistant message may carry ``"token_ids"``: the answer exactly as generated. With them, each turn's
  prompt begins with the previous turn's prompt plus its answer (``chat_template``), so KV pages carry over.

Invariants:

* A prompt holds one store lease per distinct image until ``release`` (or the ``with`` block ends); a request
  that fails while being built (``MediaDecodeError``, ``InvalidRequest``) holds nothing afterwards.
* ``media[i].position == embeds[i][0]`` is the position of image ``i``'s first placeholder, and
  ``embeds[i][1].shape[0]`` equals its run length; media are in position order.
* Image indices in errors are the images' order in the request (0-based), counting every message.
* Bad arguments (images not a list or tuple, a bad salt or flag) are refused before any image is encoded.
* Nothing a request could be refused for after its images were encoded is left to after: more images than
  ``ImageLimits.max_images`` are refused before any is read, and the prompt's length with every placeholder run
  expanded is checked against ``max_tokens`` before any is encoded. The runs' lengths come from each image's
  header (``media.image_size``) and the model's geometry (``placeholder_count``), the rule the tower's output
  follows, so a refused request runs no tower and adds, evicts or holds no store entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from mmcache.checks import positive_int, unicode_text
from mmcache.errors import InvalidRequest, MediaDecodeError
from mmcache.names import MediaItem, Namer, as_token_array

from .chat_template import ROLES, ChatTemplate, ImagePart, ImageRun, Message, TextPart
from .media import RawImage, image_size, read_image
from .mrope import continuation_positions, mrope_positions
from .vision import EncodedImage, LlavaVisionAdapter, Qwen2VLVisionAdapter, VisionAdapter


@dataclass
class MultimodalPrompt:
    """A prompt's token ids with its images' placeholder runs expanded, and what to substitute at them.

    ``embeds`` tensors are the store's own (no copy): read them, never modify them in place.
    ``mrope_positions`` is ``LongTensor[3, len(token_ids)]`` for Qwen2-VL and None otherwise; a token at
    sequence position ``p >= len(token_ids)`` gets rotary position ``p + mrope_delta`` on all three axes.
    """

    token_ids: list[int]
    media: list[MediaItem]
    embeds: list[tuple[int, torch.Tensor]]
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0
    images: list[EncodedImage] = field(default_factory=list)  # per media item; repeated bytes share one

    def release(self) -> None:
        """Release the prompt's store leases (idempotent); the features stay valid as tensors."""
        for image in self.images:
            image.release()

    def __enter__(self) -> "MultimodalPrompt":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def embed(self, embedding: nn.Module, start: int = 0, end: int | None = None) -> torch.Tensor:
        """``Tensor[end-start, hidden]``: token embeddings of positions ``start..end-1`` with every feature row
        that falls in that range substituted (a prefill chunk may cut through an image run)."""
        if not isinstance(embedding, nn.Module) or not isinstance(getattr(embedding, "weight", None), torch.Tensor):
            raise InvalidRequest(f"embedding must be the model's token embedding, got {type(embedding).__name__}")
        end = len(self.token_ids) if end is None else end
        if not _position(start) or not _position(end) or not 0 <= start <= end <= len(self.token_ids):
            raise InvalidRequest(f"embedding range {start}..{end} outside the prompt of {len(self.token_ids)}")
        weight = embedding.weight
        ids = torch.tensor(self.token_ids[start:end], dtype=torch.long, device=weight.device)
        out = embedding(ids)
        for pos, features in self.embeds:
            lo, hi = max(start, pos), min(end, pos + features.shape[0])
            if lo < hi:
                out[lo - start:hi - start] = features[lo - pos:hi - pos].to(out.device, out.dtype)
        return out

    def positions(self, start: int, end: int) -> torch.Tensor:
        """Rotary positions ``LongTensor[3, end-start]`` of sequence positions ``start..end-1`` (prompt or
        generated); for a model without 3-D positions, the plain positions on all three rows."""
        n = len(self.token_ids)
        if not _position(start) or not _position(end) or not 0 <= start <= end:
            raise InvalidRequest(f"position range {start}..{end} is not a range of sequence positions")
        if self.mrope_positions is None:
            return continuation_positions(start, end - start, 0)
        head = self.mrope_positions[:, start:min(end, n)]
        past = max(start, n)  # the first generated position in the range, if any
        tail = continuation_positions(past, max(0, end - past), self.mrope_delta)
        return torch.cat([head, tail], dim=1) if tail.shape[1] else head.clone()


def parse_messages(messages: Sequence[Mapping[str, Any]]) -> tuple[list[Message], list[object]]:
    """Normalised messages and the image sources in request order; ``InvalidRequest`` for malformed input."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {'role', 'content'} objects")
    parsed: list[Message] = []
    images: list[object] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"message {i} is {type(message).__name__}, not an object")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:  # an array's `in` would raise, not compare
            raise InvalidRequest(f"message {i} has role {role!r}; expected one of {ROLES}")
        content = message.get("content")
        content = "" if content is None else content  # an assistant turn may carry only token_ids
        raw_parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(raw_parts, Sequence) or isinstance(raw_parts, (bytes, str)):
            raise InvalidRequest(f"message {i}: content must be a string or a list of parts")
        parts = _parse_parts(raw_parts, role, i, images)
        token_ids = message.get("token_ids")
        if token_ids is not None:
            if role != "assistant":
                raise InvalidRequest(f"message {i}: token_ids are accepted on assistant messages only")
            token_ids = tuple(int(t) for t in as_token_array(token_ids))
        parsed.append(Message(role, tuple(parts), token_ids))
    return parsed, images


def _parse_parts(raw_parts: Sequence, role: str, i: int, images: list[object]) -> list[TextPart | ImagePart]:
    """The parts of message ``i`` (of ``role``), each image's source appended to ``images`` in request order;
    ``InvalidRequest`` for a malformed part."""
    parts: list[TextPart | ImagePart] = []
    for j, part in enumerate(raw_parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        kind = kind if isinstance(kind, str) else None  # an array's == would raise, not compare
        if kind == "text" and isinstance(part.get("text"), str):
            if not unicode_text(part["text"]):
                raise InvalidRequest(f"message {i} part {j}: text is not valid Unicode (a lone surrogate)")
            parts.append(TextPart(part["text"]))
        elif kind in ("image_url", "image"):
            if role != "user":
                raise InvalidRequest(f"message {i}: images are accepted in user messages only, not {role}")
            parts.append(ImagePart(len(images)))
            images.append(_image_source(part, kind, i, j))
        else:
            raise InvalidRequest(f"message {i} part {j}: expected a text, image_url or image part")
    return parts


def _image_source(part: Mapping[str, Any], kind: str, i: int, j: int) -> object:
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, Mapping):
        value = value.get("url")
    if value is None:
        raise InvalidRequest(f"message {i} part {j}: {kind} part has no {'url' if kind == 'image_url' else 'image'}")
    return value


class PromptBuilder:
    """Builds ``MultimodalPrompt``s for one VLM: its chat template and its vision adapter (and store)."""

    def __init__(self, template: ChatTemplate, adapter: VisionAdapter):
        if not isinstance(template, ChatTemplate):
            raise InvalidRequest(f"template must be a ChatTemplate, got {type(template).__name__}")
        if not isinstance(adapter, VisionAdapter):
            raise InvalidRequest(f"adapter must be a VisionAdapter, got {type(adapter).__name__}")
        image_token_id = adapter.model.config.image_token_id
        if template.image_token_id != image_token_id:
            raise InvalidRequest(f"template image token {template.image_token_id} differs from the model's "
                                 f"{image_token_id}")
        self.template = template
        self.adapter = adapter

    def from_messages(self, messages: Sequence[Mapping[str, Any]], *, salt: bytes | str | None = b"",
                      add_generation_prompt: bool = True, max_tokens: int | None = None) -> MultimodalPrompt:
        """The prompt for ``messages`` (see the module docstring), its images held in the store. ``max_tokens``:
        the longest expanded prompt accepted (None: no bound), checked before any image is encoded."""
        if not isinstance(add_generation_prompt, bool):
            raise InvalidRequest(f"add_generation_prompt must be a bool, got {add_generation_prompt!r}")
        _check_bound(max_tokens)
        Namer.salt_bytes(salt)
        parsed, sources = parse_messages(messages)
        self._check_answers(parsed)
        raws = self._read_all(sources)
        counts = [self.placeholder_count(raw) for raw in raws]
        ids, runs = self.template.render(parsed, counts, add_generation_prompt)
        _check_length(len(ids), max_tokens)
        images = self.adapter.encode_all(raws, salt=salt)
        try:
            encoded = [im.num_placeholders for im in images]
            if encoded != counts:  # an adapter whose count the header does not give (placeholder_count)
                ids, runs = self.template.render(parsed, encoded, add_generation_prompt)
            return self._assemble(ids, runs, images)
        except BaseException:
            _release(images)
            raise

    def from_token_ids(self, token_ids: Sequence[int], images: Sequence[object], *,
                       salt: bytes | str | None = b"", max_tokens: int | None = None) -> MultimodalPrompt:
        """The prompt for token ids in which each image is one image token (expanded here to its run) or its
        already expanded run; runs match ``images`` in order. ``max_tokens`` as for ``from_messages``."""
        if not isinstance(images, (list, tuple)):  # one bytes object or path would read as many items
            raise InvalidRequest(f"images must be a list of images, got {type(images).__name__}")
        _check_bound(max_tokens)
        Namer.salt_bytes(salt)
        ids = [int(t) for t in as_token_array(token_ids)]
        self._check_vocab(ids, "token_ids")
        spans = _runs_of(ids, self.template.image_token_id)
        if len(spans) != len(images):
            raise InvalidRequest(f"token ids hold {len(spans)} image placeholder run(s) for {len(images)} image(s)")
        raws = self._read_all(images)
        counts = [self.placeholder_count(raw) for raw in raws]
        if all(n > 1 for n in counts):  # exact counts (a lower bound is 1): a wrong run is refused now
            for index, ((_, length), n) in enumerate(zip(spans, counts)):
                if length not in (1, n):
                    raise InvalidRequest(f"image {index}: a run of {length} image tokens; expected 1 or {n}")
        _check_length(len(ids) + sum(n - 1 for (_, length), n in zip(spans, counts) if length == 1), max_tokens)
        encoded = self.adapter.encode_all(raws, salt=salt)
        try:
            return self._assemble(*self._expand_runs(ids, spans, encoded), encoded)
        except BaseException:
            _release(encoded)
            raise

    def _expand_runs(self, ids: list[int], spans: list, encoded: list) -> tuple[list[int], list[ImageRun]]:
        """``ids`` with each image's run (``spans``: start and length) made as long as its encoded placeholders,
        and the runs; ``InvalidRequest`` for a run neither 1 nor that long."""
        out: list[int] = []
        runs: list[ImageRun] = []
        cursor = 0
        for index, ((start, length), image) in enumerate(zip(spans, encoded)):
            n = image.num_placeholders
            if length not in (1, n):
                raise InvalidRequest(f"image {index}: a run of {length} image tokens; expected 1 or {n}")
            out += ids[cursor:start]
            runs.append(ImageRun(index, len(out), n))
            out += [self.template.image_token_id] * n
            cursor = start + length
        out += ids[cursor:]
        return out, runs

    def _read_all(self, sources: Sequence[object]) -> list[RawImage]:
        """The bytes as sent of each image (nothing decoded), after the request's image count is checked."""
        limit = self.adapter.limits.max_images
        if len(sources) > limit:
            raise InvalidRequest(f"{len(sources)} images exceed the limit of {limit} per request (max_images)")
        return [read_image(source, index, self.adapter.limits) for index, source in enumerate(sources)]

    def placeholder_count(self, raw: RawImage) -> int:
        """How many placeholder tokens the tower's features for ``raw`` will fill, from the image's header and
        the model's geometry, without running the tower (``MediaDecodeError`` for a header the decode would
        refuse). The rules are the ones the adapters' models follow: LLaVA's features are the tower's positions
        less the CLS token under the ``default`` strategy, whatever the image; Qwen2-VL's are the processor's
        patches (``get_number_of_image_patches``, the processor's own rule) over ``merge**2``. Any other adapter
        or processor gets 1, a lower bound (every image fills at least one placeholder)."""
        adapter = self.adapter
        if isinstance(adapter, LlavaVisionAdapter):
            return _llava_placeholders(adapter)
        count_patches = getattr(adapter.image_processor, "get_number_of_image_patches", None)
        if isinstance(adapter, Qwen2VLVisionAdapter) and count_patches is not None:
            width, height = image_size(raw, adapter.limits)
            try:
                patches = count_patches(height, width)
            except ValueError as e:  # the processor's own bounds (Qwen2-VL: an aspect ratio over 200)
                raise MediaDecodeError(raw.ref, f"the model's image processor refused it: {e}") from e
            return int(patches) // adapter.spatial_merge_size ** 2
        return 1

    def _check_answers(self, messages: Sequence[Message]) -> None:
        for message in messages:
            if message.token_ids is not None:
                self._check_vocab(message.token_ids, "assistant token_ids")

    def _check_vocab(self, ids: Sequence[int], what: str) -> None:
        if ids and max(ids) >= self.template.vocab_size:
            raise InvalidRequest(f"{what} hold id {max(ids)} outside the vocabulary of {self.template.vocab_size}")

    def _assemble(self, ids: list[int], runs: list[ImageRun], images: list[EncodedImage]) -> MultimodalPrompt:
        runs = sorted(runs, key=lambda r: r.start)
        media = [MediaItem(images[r.index].digest, r.start) for r in runs]
        embeds = [(r.start, images[r.index].features) for r in runs]
        prompt = MultimodalPrompt(ids, media, embeds, images=[images[r.index] for r in runs])
        if isinstance(self.adapter, Qwen2VLVisionAdapter):
            m = self.adapter.spatial_merge_size
            grids = []
            for r in runs:
                t, h, w = images[r.index].grid_thw
                grids.append((r.start, (t, h // m, w // m)))
            prompt.mrope_positions, prompt.mrope_delta = mrope_positions(len(ids), grids)
        return prompt


def _position(x: object) -> bool:
    """Whether ``x`` is an int (Python or numpy, not a bool): a sequence position or a range end."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _runs_of(ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """Maximal runs ``(start, length)`` of ``token_id`` in ``ids``."""
    mask = np.concatenate(([0], np.asarray(ids) == token_id, [0])).astype(np.int8)
    edges = np.diff(mask)
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(int(s), int(e - s)) for s, e in zip(starts, ends)]


def _llava_placeholders(adapter: LlavaVisionAdapter) -> int:
    """A LLaVA tower's feature rows per image: its position embeddings (patches, plus CLS for CLIP), less the
    CLS row that the ``default`` selection strategy drops (``LlavaModel.get_image_features``)."""
    tower = adapter.tower
    embeddings = getattr(getattr(tower, "vision_model", tower), "embeddings", None)
    positions = getattr(embeddings, "num_positions", None)
    if not positive_int(positions):
        return 1  # a tower of another shape: the lower bound
    return positions - (adapter.model.config.vision_feature_select_strategy == "default")


def _check_bound(max_tokens: object) -> None:
    if max_tokens is not None and not positive_int(max_tokens):
        raise InvalidRequest(f"max_tokens must be a positive int or None, got {max_tokens!r}")


def _check_length(length: int, max_tokens: int | None) -> None:
    """Refuses a prompt longer than ``max_tokens`` with its placeholder runs expanded (before any encode)."""
    if max_tokens is not None and length > max_tokens:
        raise InvalidRequest(f"the prompt is {length} tokens with its images' placeholders expanded; at most "
                             f"{max_tokens} are accepted (refused before any image was encoded)")


def _release(images: Sequence[EncodedImage]) -> None:
    for image in images:
        image.release()
