"""diffusers integration: call an unmodified pipeline with prompt embeddings computed through the store.

``CachedWanPipeline`` (text-to-video, umT5) and ``CachedSD3Pipeline`` (text-to-image, CLIP-L + CLIP-G + T5)
wrap a pipeline object. ``prepare`` encodes every prompt through the text-encoder adapters and returns the
pipeline's keyword arguments with ``prompt_embeds`` / ``negative_prompt_embeds`` (and SD3's pooled embeddings)
filled in; ``__call__`` prepares, calls the pipeline and releases.

Invariants:

* The embeddings equal, bit for bit, what the pipeline's own ``encode_prompt`` builds for a single prompt: the
  same text cleaning, tokenizer call, encoder call, dtype casts, Wan's trim-and-zero-pad to
  ``max_sequence_length``, SD3's CLIP concat / pad / T5 concat, SD3's rule that negatives ignore ``clip_skip``,
  and the repeat for several outputs per prompt (read from diffusers 0.42's ``pipeline_wan.py`` and
  ``pipeline_stable_diffusion_3.py``).
* Every prompt is encoded on its own (batch 1) and keyed on its own: the negative prompt's entry never depends
  on the positive prompt. A list of B prompts is B batch-1 forwards, where the pipeline itself runs one batch-B
  forward; tests/test_diffusion_pipelines.py records whether that changes any bit.
* A request holds a lease on every entry it uses from ``prepare`` until its ``PreparedCall`` is released (the
  end of ``__call__``), also when encoding or the pipeline fails, so entries in use are never evicted and a
  failed request holds nothing afterwards.
* ``store=None`` runs the same code with every prompt encoded (the store-off baseline).
* ``prompt_kind`` and ``negative_kind`` (default ``"output"`` both) are the kinds of the store entries the
  prompts and the negative prompts make, which the store's per-kind metrics count apart (a server labels them
  text encoder and negative prompt). A text used both ways under one salt is one entry, of the kind that made it.
* The salt is per call: ``prepare`` and ``__call__`` take ``cache_salt=`` (bytes or str, at most
  ``names.MAX_SALT_BYTES``), the wrapper's own ``salt`` when it is None. It reaches every store entry the call
  uses (prompt and negative-prompt outputs, position biases) and the tokenization memos, so one wrapper serves
  many tenants without fingerprinting the text encoders again, and two salts share no entry and no hit. A bad
  salt is refused with ``InvalidRequest`` before anything is encoded or held.
* With ``position_biases`` (the default), a T5 or umT5 encoder's relative position biases come from the store
  too (``position_bias.py``: the same values, computed once per length; held only during the forward that uses
  them); with ``store=None`` the encoder computes them in every forward, as in the pipeline.
* The adapters follow the pipeline's components: before each request an adapter whose text encoder or tokenizer
  is no longer the pipeline's (identity; ``register_modules``) is built again, and SD3's T5 adapter appears and
  disappears with ``text_encoder_3`` (without it, the pipeline's zeros). Changes inside a component are the
  adapter's to follow (``fingerprint.LiveFingerprint``).
* The embeddings are placed on the pipeline's ``_execution_device``, which diffusers finds by walking every
  module of every component (milliseconds). The wrapper reads it once and again only when the placement
  may have moved (``_placement_state``): a component replaced, its first parameter on another device
  (``.to``, sequential offload), or an offload hook added to or removed from the component or the module owning
  its first parameter (accelerate's model and sequential offload, diffusers' block- and leaf-level group
  offloading). Hooks attached by hand to other submodules are not seen: build a new wrapper after that.
* ``max_prompt_chars`` bounds what is worth reading of a prompt: every tokenizer truncates at its max length, so
  text past ``PROMPT_CHARS_PER_TOKEN`` characters per kept token only costs tokenizing time. The wrapper encodes
  what it is given; a server refuses longer prompts before anything is encoded.
"""

from __future__ import annotations

import abc
import inspect
import numbers
import threading
from dataclasses import dataclass, field

import torch

from mmcache.checks import finite_number, unicode_text
from mmcache.errors import InvalidRequest
from mmcache.names import Namer
from mmcache.store import EncoderOutputStore, Lease

from .text_encoders import T5_MAX_LENGTH, CLIPEncoderAdapter, T5EncoderAdapter, T5Recipe

SD3_MAX_SEQUENCE_LENGTH = 512  # StableDiffusion3Pipeline.check_inputs refuses longer T5 sequences
# Characters a prompt may carry per token its tokenizers keep: a generous multiple, since an English word-piece
# averages about 4 characters; with SD3's 256 T5 tokens it allows 4096 characters (DALL-E 3 takes 4000).
PROMPT_CHARS_PER_TOKEN = 16
_EMBEDDING_ARGS = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds",
                   "negative_pooled_prompt_embeds")


@dataclass
class PreparedCall:
    """A pipeline call's keyword arguments plus the leases that keep its store entries resident, and the salt
    its entries are keyed with (checked bytes)."""

    kwargs: dict
    leases: list[Lease] = field(default_factory=list)
    salt: bytes = b""

    @property
    def hits(self) -> int:
        return sum(lease.hit for lease in self.leases)

    def release(self) -> None:
        leases, self.leases = self.leases, []
        for lease in leases:
            lease.release()

    def __enter__(self) -> "PreparedCall":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _prompt_list(prompt: object, what: str) -> list[str]:
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not (isinstance(texts, list) and texts and all(isinstance(p, str) for p in texts)):
        raise InvalidRequest(f"{what} must be a str or a non-empty list of str, got {type(prompt).__name__}")
    if not all(unicode_text(p) for p in texts):
        raise InvalidRequest(f"{what} is not valid Unicode text (it holds a lone surrogate)")
    return list(texts)


def _negatives(negative: object, batch: int, what: str = "negative_prompt") -> list[str]:
    """The pipeline's rule: a missing negative is "", a str is repeated for every prompt."""
    texts = _prompt_list(negative or "", what)
    if isinstance(negative, str) or not negative:
        texts = texts * batch
    if len(texts) != batch:
        raise InvalidRequest(f"{what} has {len(texts)} entries for {batch} prompt(s)")
    return texts


def _int_at_least(value: object, low: int, what: str) -> int:
    """``value`` as an int: any integer but a bool (numpy's too, which the pipelines take), at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise InvalidRequest(f"{what} must be an int >= {low}, got {value!r}")
    return int(value)


def _check_negative_type(negative: object) -> None:
    """WanPipeline.check_inputs's rule, applied whether or not the negative branch runs: None, a str or a list."""
    if negative is not None and not isinstance(negative, (str, list)):
        raise InvalidRequest(f"negative_prompt must be a str or a list of str, got {type(negative).__name__}")


def _guidance_scale(value: object) -> float:
    """The request's guidance scale as a float, refused unless a finite real number (the pipelines compare it
    with 1 to decide whether the negative branch runs, and would raise a bare ``TypeError`` or run unguided on
    NaN). An int is passed on as the float equal to it: torch multiplies a tensor by an int through int64, so the
    pipelines raise ``OverflowError`` on an int past 2**63; for smaller ints the outputs are the same."""
    if not finite_number(value):
        raise InvalidRequest(f"guidance_scale must be a finite number, got {value!r}")
    return float(value)


def _repeat(embeds: torch.Tensor, n: int) -> torch.Tensor:
    """The pipelines' "mps friendly" repeat: each prompt's rows n times in a row. ``embeds`` is always a fresh
    tensor (stacked here), so n = 1 returns it without the pipelines' copy; the values are the same."""
    if n == 1:
        return embeds
    if embeds.dim() == 2:
        return embeds.repeat(1, n).view(embeds.shape[0] * n, -1)
    return embeds.repeat(1, n, 1).view(embeds.shape[0] * n, embeds.shape[1], -1)


def _follows(adapter, tokenizer, model) -> bool:
    """Whether ``adapter`` runs exactly these components (identity: an equal copy is another model)."""
    return adapter is not None and adapter.tokenizer is tokenizer and adapter.model is model


def _hooks(module: torch.nn.Module) -> tuple:
    """The offload hooks on ``module`` itself: accelerate's and those in diffusers' hook registry."""
    registry = getattr(module, "_diffusers_hook", None)
    return getattr(module, "_hf_hook", None), () if registry is None else tuple(registry.hooks.values())


def _placement_state(module: torch.nn.Module) -> tuple:
    """What changes when a component is moved or offloaded; microseconds, where ``_execution_device`` walks
    every module. Leaf-level group offloading hooks every module that owns parameters, block-level hooks the
    component itself, accelerate's offloading hooks the component itself (and moves parameters to meta for
    sequential offload), so the component and the owner of its first parameter cover them all."""
    name, first = next(module.named_parameters(), ("", None))
    owner = module.get_submodule(name.rpartition(".")[0])
    return module, _hooks(module), _hooks(owner), None if first is None else first.device


class _CachedPipeline(abc.ABC):
    def __init__(self, pipe, store: EncoderOutputStore | None = None, salt: bytes | str | None = b"",
                 position_biases: bool = True, prompt_kind: str = "output", negative_kind: str = "output"):
        if not isinstance(position_biases, bool):
            raise InvalidRequest(f"position_biases must be a bool, got {position_biases!r}")
        for kind in (prompt_kind, negative_kind):
            if not isinstance(kind, str) or not kind:
                raise InvalidRequest(f"an entry kind must be a non-empty str, got {kind!r}")
        self.kinds = {False: prompt_kind, True: negative_kind}  # negative? -> the kind of the entries it makes
        self.pipe = pipe
        self.store = store
        self.salt = Namer.salt_bytes(salt)  # the salt of a call that names none
        self.position_biases = position_biases  # T5-family relative position biases from the store too
        params = inspect.signature(type(pipe).__call__).parameters
        self._defaults = {name: p.default for name, p in params.items()}
        self._takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self._component_names = tuple(pipe.components)  # fixed by the pipeline class's signature
        self._placement: tuple = ((), None)  # (placement state, execution device), replaced as one
        self._adapters_lock = threading.Lock()  # one rebuild when two requests see a replaced component

    def execution_device(self) -> torch.device:
        """``pipe._execution_device``, read again only when ``_placement_state`` of a component has changed."""
        state = (tuple(getattr(self.pipe, "_exclude_from_cpu_offload", ())),
                 *(_placement_state(m) if isinstance(m, torch.nn.Module) else None
                   for m in (getattr(self.pipe, name, None) for name in self._component_names)))
        known, device = self._placement
        if state != known:
            device = self.pipe._execution_device
            self._placement = (state, device)
        return device

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt worth reading at the pipeline's default ``max_sequence_length`` (module
        docstring): ``PROMPT_CHARS_PER_TOKEN`` times the most tokens any of its tokenizers keeps (SD3's CLIP
        keeps ``tokenizer_max_length``, its T5 and Wan's umT5 ``max_sequence_length``)."""
        kept = max(self._defaults["max_sequence_length"], getattr(self.pipe, "tokenizer_max_length", 0))
        return PROMPT_CHARS_PER_TOKEN * kept

    @abc.abstractmethod
    def _text_encoders(self) -> list[torch.nn.Module]:
        """The pipeline's text encoders, checked before every request."""

    @property
    def adapters(self) -> list:
        """The text-encoder adapters, one per text encoder of the pipeline as it is now (their tokenization memos
        carry hit counts)."""
        with self._adapters_lock:
            self._follow_components()
            return self._adapter_list()

    @abc.abstractmethod
    def _adapter_list(self) -> list:
        """The adapters held, in the pipeline's order of text encoders."""

    @abc.abstractmethod
    def _follow_components(self) -> None:
        """Build again each adapter whose components are no longer the pipeline's (``_follows``); under
        ``_adapters_lock``."""

    @abc.abstractmethod
    def _build(self, call: PreparedCall, prompt, negative_prompt, kwargs: dict) -> dict:
        """The pipeline's keyword arguments with the embeddings filled in, keyed with ``call.salt``; appends each
        lease it takes to ``call.leases``."""

    def prepare(self, prompt, negative_prompt=None, *, cache_salt: bytes | str | None = None,
                **kwargs) -> PreparedCall:
        """Encode through the store under ``cache_salt`` (None: the wrapper's ``salt``); the returned call holds
        its leases until released."""
        salt = self.salt if cache_salt is None else Namer.salt_bytes(cache_salt)
        for name in _EMBEDDING_ARGS:
            if name in kwargs:
                raise InvalidRequest(f"{name} is computed by the store wrapper; pass the prompt text instead")
        unknown = sorted(set(kwargs) - set(self._defaults) - {"self"})
        if unknown and not self._takes_any:  # the call would fail on them after every prompt was encoded
            raise InvalidRequest(f"{type(self.pipe).__name__} takes no argument {', '.join(unknown)}")
        for module in self._text_encoders():
            if getattr(module, "_hf_peft_config_loaded", False):
                raise InvalidRequest("a text encoder carries LoRA layers, whose scale is not part of the store "
                                     "key; the store wrapper refuses such pipelines")
        with self._adapters_lock:
            self._follow_components()
        call = PreparedCall({}, salt=salt)
        try:
            call.kwargs = self._build(call, prompt, negative_prompt, dict(kwargs))
            return call
        except BaseException:
            call.release()
            raise

    def __call__(self, prompt, negative_prompt=None, *, cache_salt: bytes | str | None = None, **kwargs):
        """The pipeline's output for this request, its prompts encoded under ``cache_salt`` (None: the wrapper's
        ``salt``)."""
        with self.prepare(prompt, negative_prompt, cache_salt=cache_salt, **kwargs) as call:
            return self.pipe(**call.kwargs)

    def _arg(self, kwargs: dict, name: str):
        return kwargs.pop(name, self._defaults[name])

    def _encode(self, call: PreparedCall, adapter, text: str, max_length: int, negative: bool, **selector) -> dict:
        lease = adapter.encode(text, max_length, self.store, call.salt, kind=self.kinds[negative], **selector)
        call.leases.append(lease)
        return lease.outputs


class CachedWanPipeline(_CachedPipeline):
    """``WanPipeline`` with its umT5 prompt embeddings (positive and negative) served by the store. A
    ``max_sequence_length`` above ``max_sequence_length_limit`` (default ``T5_MAX_LENGTH``, eight times Wan's
    512) is refused: WanPipeline itself sets no limit and would pad every prompt to it."""

    def __init__(self, pipe, store: EncoderOutputStore | None = None, salt: bytes | str | None = b"",
                 max_sequence_length_limit: int = T5_MAX_LENGTH, position_biases: bool = True,
                 prompt_kind: str = "output", negative_kind: str = "output"):
        super().__init__(pipe, store, salt, position_biases, prompt_kind, negative_kind)
        self._max_length_limit = max_sequence_length_limit
        self.text = None
        self._follow_components()

    def _follow_components(self) -> None:
        if not _follows(self.text, self.pipe.tokenizer, self.pipe.text_encoder):
            self.text = T5EncoderAdapter(self.pipe.tokenizer, self.pipe.text_encoder,
                                         T5Recipe(attention_mask=True, trim_to_length=True), self._max_length_limit,
                                         self.position_biases)

    def _text_encoders(self):
        return [self.pipe.text_encoder]

    def _adapter_list(self):
        return [self.text]

    def _embeds(self, call, texts: list[str], max_length: int, n: int, place: dict, negative: bool) -> torch.Tensor:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        rows = [self._encode(call, self.text, prompt_clean(text), max_length, negative)["hidden"].to(**place)
                for text in texts]
        # The pipeline's trim-and-zero-pad, written into one zeroed tensor instead of a cat and a stack.
        embeds = rows[0].new_zeros((len(rows), max_length, rows[0].size(1)))
        for i, u in enumerate(rows):
            embeds[i, : u.size(0)] = u
        return _repeat(embeds, n)

    def _build(self, call, prompt, negative_prompt, kwargs):
        prompts = _prompt_list(prompt, "prompt")
        max_length = _int_at_least(self._arg(kwargs, "max_sequence_length"), 1, "max_sequence_length")
        if max_length > self.text.max_length_limit:
            raise InvalidRequest(f"max_sequence_length {max_length} exceeds the wrapper's limit of "
                                 f"{self.text.max_length_limit} (max_sequence_length_limit)")
        n = _int_at_least(self._arg(kwargs, "num_videos_per_prompt"), 1, "num_videos_per_prompt")
        guidance = _guidance_scale(self._arg(kwargs, "guidance_scale"))
        _check_negative_type(negative_prompt)
        # WanPipeline.do_classifier_free_guidance; every input is checked before anything is encoded.
        negatives = _negatives(negative_prompt, len(prompts)) if guidance > 1.0 else None
        place = {"dtype": self.pipe.text_encoder.dtype, "device": self.execution_device()}
        kwargs.update(prompt_embeds=self._embeds(call, prompts, max_length, n, place, False), guidance_scale=guidance,
                      max_sequence_length=max_length, num_videos_per_prompt=1)  # rows are already repeated
        if negatives is not None:
            kwargs["negative_prompt_embeds"] = self._embeds(call, negatives, max_length, n, place, True)
        return kwargs


class CachedSD3Pipeline(_CachedPipeline):
    """``StableDiffusion3Pipeline`` with CLIP-L, CLIP-G and T5 outputs (positive and negative) from the store."""

    def __init__(self, pipe, store: EncoderOutputStore | None = None, salt: bytes | str | None = b"",
                 position_biases: bool = True, prompt_kind: str = "output", negative_kind: str = "output"):
        super().__init__(pipe, store, salt, position_biases, prompt_kind, negative_kind)
        self.clip: list = [None, None]
        self.t5 = None
        self._follow_components()

    def _follow_components(self) -> None:
        pipe = self.pipe
        for i, (tokenizer, model) in enumerate(((pipe.tokenizer, pipe.text_encoder),
                                                (pipe.tokenizer_2, pipe.text_encoder_2))):
            if not _follows(self.clip[i], tokenizer, model):
                self.clip[i] = CLIPEncoderAdapter(tokenizer, model)
        if pipe.text_encoder_3 is None:  # the pipeline then stands zeros in for T5's output
            self.t5 = None
        elif not _follows(self.t5, pipe.tokenizer_3, pipe.text_encoder_3):
            self.t5 = T5EncoderAdapter(pipe.tokenizer_3, pipe.text_encoder_3,
                                       T5Recipe(attention_mask=False, trim_to_length=False),
                                       position_biases=self.position_biases)

    def _text_encoders(self):
        return [m for m in (self.pipe.text_encoder, self.pipe.text_encoder_2, self.pipe.text_encoder_3) if m]

    def _adapter_list(self):
        return [a for a in (*self.clip, self.t5) if a is not None]

    def _clip(self, call, index: int, texts: list[str], hidden_layer: int, n: int, place: dict, negative: bool):
        outs = [self._encode(call, self.clip[index], t, self.pipe.tokenizer_max_length, negative,
                             hidden_layer=hidden_layer)
                for t in texts]
        hidden = torch.stack([o["hidden"] for o in outs]).to(dtype=place["clip_dtype"], device=place["device"])
        return _repeat(hidden, n), _repeat(torch.stack([o["pooled"] for o in outs]), n)

    def _t5(self, call, texts: list[str], max_length: int, n: int, place: dict, negative: bool) -> torch.Tensor:
        if self.t5 is None:  # the pipeline's stand-in when the T5 encoder is dropped
            return torch.zeros((len(texts) * n, max_length, self.pipe.transformer.config.joint_attention_dim),
                               device=place["device"], dtype=place["clip_dtype"])
        rows = [self._encode(call, self.t5, t, max_length, negative)["hidden"] for t in texts]
        return _repeat(torch.stack(rows).to(dtype=place["t5_dtype"], device=place["device"]), n)

    def _embeds(self, call, texts, texts_2, texts_3, hidden_layer, max_length, n, place, negative=False):
        hidden_l, pooled_l = self._clip(call, 0, texts, hidden_layer, n, place, negative)
        hidden_g, pooled_g = self._clip(call, 1, texts_2, hidden_layer, n, place, negative)
        clip = torch.cat([hidden_l, hidden_g], dim=-1)
        t5 = self._t5(call, texts_3, max_length, n, place, negative)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat([pooled_l, pooled_g], dim=-1)

    def _build(self, call, prompt, negative_prompt, kwargs):
        prompts = _prompt_list(prompt, "prompt")
        batch = len(prompts)
        prompts_2 = _prompt_list(kwargs.pop("prompt_2", None) or prompt, "prompt_2")
        prompts_3 = _prompt_list(kwargs.pop("prompt_3", None) or prompt, "prompt_3")
        if not len(prompts_2) == len(prompts_3) == batch:
            raise InvalidRequest(f"prompt_2 and prompt_3 must have {batch} entries like prompt")
        max_length = _int_at_least(self._arg(kwargs, "max_sequence_length"), 1, "max_sequence_length")
        if max_length > SD3_MAX_SEQUENCE_LENGTH:
            raise InvalidRequest(f"max_sequence_length {max_length} exceeds SD3's {SD3_MAX_SEQUENCE_LENGTH}")
        n = _int_at_least(self._arg(kwargs, "num_images_per_prompt"), 1, "num_images_per_prompt")
        clip_skip = self._arg(kwargs, "clip_skip")
        hidden_layer = -2 if clip_skip is None else -(_int_at_least(clip_skip, 0, "clip_skip") + 2)
        guidance = _guidance_scale(self._arg(kwargs, "guidance_scale"))
        negatives = None
        if guidance > 1:  # StableDiffusion3Pipeline.do_classifier_free_guidance
            neg_2 = kwargs.pop("negative_prompt_2", None) or negative_prompt
            neg_3 = kwargs.pop("negative_prompt_3", None) or negative_prompt
            negatives = (_negatives(negative_prompt, batch), _negatives(neg_2, batch, "negative_prompt_2"),
                         _negatives(neg_3, batch, "negative_prompt_3"))
        place = {"device": self.execution_device(), "clip_dtype": self.pipe.text_encoder.dtype,
                 "t5_dtype": self.t5.model.dtype if self.t5 else None}
        embeds, pooled = self._embeds(call, prompts, prompts_2, prompts_3, hidden_layer, max_length, n, place)
        kwargs.update(prompt_embeds=embeds, pooled_prompt_embeds=pooled, guidance_scale=guidance,
                      max_sequence_length=max_length, num_images_per_prompt=1)  # rows are already repeated
        if negatives is not None:
            # The pipeline encodes negatives with clip_skip=None whatever the request's clip_skip.
            neg, neg_pooled = self._embeds(call, *negatives, -2, max_length, n, place, negative=True)
            kwargs.update(negative_prompt_embeds=neg, negative_pooled_prompt_embeds=neg_pooled)
        return kwargs
