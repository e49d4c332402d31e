"""VLM presets: real transformers architectures with seeded random weights, built locally (no model hub).

* ``tiny-llava``: ``LlavaForConditionalGeneration`` with a CLIP vision tower (32x32 input, 8x8 patches, CLS
  dropped, features from the second-to-last layer, the llava-1.5 recipe) and a Llama text model;
  ``CLIPImageProcessorPil`` (resize shortest edge, centre crop); 16 placeholders per image.
* ``tiny-llava-siglip``: the same with a SigLIP tower (no CLS, last layer, ``full`` strategy) and
  ``SiglipImageProcessorPil``.
* ``tiny-qwen2-vl``: ``Qwen2VLForConditionalGeneration`` (14-pixel patches, 2x2 merge, M-RoPE sections 2/3/3)
  with ``Qwen2VLImageProcessorPil`` bounded to 56x56 .. 112x112 pixels, so 4 to 16 placeholders per image.
* ``bench-llava``: the benchmark's model. ``LlavaForConditionalGeneration`` with a CLIP ViT-B/16 tower at 224x224
  pixels (ViT-B's shape: hidden 768, 12 layers, 12 heads, MLP 3072), llava-1.5's recipe (features of the
  second-to-last layer, CLS dropped: 196 placeholders per image) and two-layer GELU projector (768 -> 896 ->
  896), over the text preset ``small`` (Qwen2.5-0.5B's shape with 8 of its 24 layers) with its vocabulary sized
  to the preset's tokenizer (516 entries, so every id the model can generate is one the chat template accepts
  back). ``CLIPImageProcessorPil`` at CLIP's defaults; the Vicuna template and tokenizer of ``tiny-llava``.
  About 208M parameters: tower 86M, projector 1.5M, language model 120M.

Each preset has a byte-level BPE tokenizer trained with the ``tokenizers`` package on the LLaVA-Bench questions
(``datasets/vlm/qa90_questions.jsonl``) plus the template's own words, with the template's special tokens
appended; the model's vocabulary is sized to it. ``vlm_from_preset`` builds a ready ``VLMEngine``.

Invariants: a preset name, seed and dtype always give the same config, weights and vocabulary (weights drawn in
float32 inside a forked RNG, so the caller's random state is untouched, then cast), hence the same model digest
and adapter fingerprint in every process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from encoders.chat import PromptBuilder
from encoders.chat_template import ChatMLTemplate, ChatTemplate, LlavaTemplate
from encoders.media import ImageLimits
from encoders.vision import LlavaVisionAdapter, Qwen2VLVisionAdapter, VisionAdapter
from mmcache.engine import Engine, EngineConfig
from mmcache.engine.models import resolve_dtype
from mmcache.errors import InvalidRequest
from mmcache.hosts.vlm import DEFAULT_STORE_BYTES, VLMEngine
from mmcache.store import EncoderOutputStore

from .text import PRESETS, UnknownPreset

QUESTIONS = Path(__file__).resolve().parents[2] / "datasets" / "vlm" / "qa90_questions.jsonl"
TINY_VLM_PRESETS = ("tiny-llava", "tiny-llava-siglip", "tiny-qwen2-vl")
VLM_PRESETS = TINY_VLM_PRESETS + ("bench-llava",)

LLAVA_SPECIAL = ("<pad>", "<s>", "</s>", "<image>")
CHATML_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
TEMPLATE_WORDS = ("USER: ", " ASSISTANT:", "system\n", "user\n", "assistant\n")


@dataclass(frozen=True)
class TinySizes:
    """Sizes of the tiny presets' text models and towers."""

    text_hidden: int = 64
    text_layers: int = 2
    text_heads: int = 4
    text_kv_heads: int = 2
    text_intermediate: int = 128
    vision_hidden: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    bpe_vocab: int = 512
    initializer_range: float = 0.1  # larger than the usual 0.02 so logits vary visibly with the image


@dataclass
class VLMPreset:
    """A built VLM: model (eval mode), image processor, tokenizer and chat template, and its adapter class."""

    name: str
    model: nn.Module
    image_processor: object
    tokenizer: Tokenizer
    template: ChatTemplate
    adapter_class: type[VisionAdapter]

    def adapter(self, store: EncoderOutputStore, limits: ImageLimits = ImageLimits()) -> VisionAdapter:
        return self.adapter_class(self.model, self.image_processor, store, limits)

    def prompt_builder(self, store: EncoderOutputStore, limits: ImageLimits = ImageLimits()) -> PromptBuilder:
        return PromptBuilder(self.template, self.adapter(store, limits))

    @property
    def eos_token_id(self) -> int:
        return self.template.end_of_turn_id


def vlm_tokenizer(special_tokens: tuple[str, ...], vocab_size: int = 512, questions: Path = QUESTIONS) -> Tokenizer:
    """A byte-level BPE trained on the question texts and template words, then ``special_tokens`` appended."""
    with open(questions, encoding="utf-8") as f:
        corpus = [json.loads(line)["text"] for line in f if line.strip()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus + list(TEMPLATE_WORDS) * 4, trainer=trainer)
    tok.add_special_tokens(list(special_tokens))
    return tok


def build_preset(name: str, seed: int = 0, sizes: TinySizes = TinySizes()) -> VLMPreset:
    """Build tiny preset ``name`` (one of ``TINY_VLM_PRESETS``) with weights drawn from ``seed``, in float32."""
    if name not in TINY_VLM_PRESETS:
        raise InvalidRequest(f"unknown tiny VLM preset {name!r}; known: {TINY_VLM_PRESETS}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "tiny-qwen2-vl":
            return _qwen2_vl(sizes)
        return _llava(name, sizes)


def _llava(name: str, s: TinySizes) -> VLMPreset:
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, SiglipImageProcessorPil, SiglipVisionConfig)

    tokenizer = vlm_tokenizer(LLAVA_SPECIAL, s.bpe_vocab)
    ids = {t: tokenizer.token_to_id(t) for t in LLAVA_SPECIAL}
    tower = dict(hidden_size=s.vision_hidden, intermediate_size=2 * s.vision_hidden, num_hidden_layers=s.vision_layers,
                 num_attention_heads=s.vision_heads, image_size=32, patch_size=8)
    if name == "tiny-llava":
        vision, processor = CLIPVisionConfig(**tower), CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        strategy, layer = "default", -2
    else:
        vision, processor = SiglipVisionConfig(**tower), SiglipImageProcessorPil(size={"height": 32, "width": 32})
        strategy, layer = "full", -1
    text = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=s.text_hidden,
                       intermediate_size=s.text_intermediate, num_hidden_layers=s.text_layers,
                       num_attention_heads=s.text_heads, num_key_value_heads=s.text_kv_heads,
                       max_position_embeddings=4096, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                       pad_token_id=ids["<pad>"], initializer_range=s.initializer_range)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=ids["<image>"],
                         image_seq_length=(32 // 8) ** 2, vision_feature_select_strategy=strategy,
                         vision_feature_layer=layer)
    model = LlavaForConditionalGeneration(config).eval()
    return VLMPreset(name, model, processor, tokenizer, LlavaTemplate(tokenizer), LlavaVisionAdapter)


def _qwen2_vl(s: TinySizes) -> VLMPreset:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    tokenizer = vlm_tokenizer(CHATML_SPECIAL, s.bpe_vocab)
    ids = {t: tokenizer.token_to_id(t) for t in CHATML_SPECIAL}
    head_dim = s.text_hidden // s.text_heads
    half = head_dim // 2
    mrope_section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # 16/24/24 of 64 in Qwen2-VL
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=tokenizer.get_vocab_size(), hidden_size=s.text_hidden,
                         intermediate_size=s.text_intermediate, num_hidden_layers=s.text_layers,
                         num_attention_heads=s.text_heads, num_key_value_heads=s.text_kv_heads,
                         max_position_embeddings=4096, initializer_range=s.initializer_range,
                         rope_parameters={"rope_type": "default", "mrope_section": mrope_section,
                                          "rope_theta": 10000.0},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         pad_token_id=ids["<|endoftext|>"]),
        vision_config=dict(depth=s.vision_layers, embed_dim=s.vision_hidden, hidden_size=s.text_hidden,
                           num_heads=s.vision_heads, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           initializer_range=s.initializer_range),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    model = Qwen2VLForConditionalGeneration(config).eval()
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                         temporal_patch_size=2)
    return VLMPreset("tiny-qwen2-vl", model, processor, tokenizer, ChatMLTemplate(tokenizer), Qwen2VLVisionAdapter)


BENCH_TOWER = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   image_size=224, patch_size=16)
BENCH_IMAGE_SIZE = 224


def build_vlm(name: str, dtype="float32", seed: int = 0) -> VLMPreset:
    """The VLM preset ``name`` (one of ``VLM_PRESETS``) with its model cast to ``dtype``, in eval mode."""
    if name not in VLM_PRESETS:
        raise UnknownPreset(name)
    if name in TINY_VLM_PRESETS:
        preset = build_preset(name, seed)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            preset = _bench_llava()
    preset.model = preset.model.to(resolve_dtype(dtype)).eval()
    return preset


def vlm_from_preset(name: str, config: EngineConfig | None = None, dtype="float32",
                    store_bytes: int = DEFAULT_STORE_BYTES, limits: ImageLimits | None = None) -> VLMEngine:
    """A ``VLMEngine`` over preset ``name`` with a fresh store of ``store_bytes``. ``limits`` default to
    ``ImageLimits()``, which read no local file: a caller that sends paths opts in (``allow_paths=True`` or
    ``path_root=``)."""
    return vlm_engine(build_vlm(name, dtype), config, store_bytes, limits)


def vlm_engine(preset: VLMPreset, config: EngineConfig | None = None, store_bytes: int = DEFAULT_STORE_BYTES,
               limits: ImageLimits | None = None) -> VLMEngine:
    """A ``VLMEngine`` over a built preset (or a loaded folder: ``vlm_folder.load_vlm``), as ``vlm_from_preset``."""
    engine = Engine(preset.model, hf_tokenizer(preset), config)
    return VLMEngine(engine, preset.prompt_builder(EncoderOutputStore(store_bytes), limits or ImageLimits()))


def hf_tokenizer(preset: VLMPreset):
    """The preset's tokenizer wrapped for transformers, ending generation at the template's end-of-turn token."""
    from transformers import PreTrainedTokenizerFast

    tok = preset.tokenizer
    eos = tok.id_to_token(preset.template.end_of_turn_id)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, model_max_length=1 << 20)


def _bench_llava() -> VLMPreset:
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration,
                              Qwen2Config)

    tokenizer = vlm_tokenizer(LLAVA_SPECIAL)
    ids = {t: tokenizer.token_to_id(t) for t in LLAVA_SPECIAL}
    text = Qwen2Config(**{**PRESETS["small"].config, "vocab_size": tokenizer.get_vocab_size()},
                       bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"])
    patches = (BENCH_IMAGE_SIZE // BENCH_TOWER["patch_size"]) ** 2
    config = LlavaConfig(vision_config=CLIPVisionConfig(**BENCH_TOWER), text_config=text,
                         image_token_index=ids["<image>"], image_seq_length=patches,
                         vision_feature_select_strategy="default", vision_feature_layer=-2)
    model = LlavaForConditionalGeneration(config).eval()
    size = BENCH_IMAGE_SIZE
    processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return VLMPreset("bench-llava", model, processor, tokenizer, LlavaTemplate(tokenizer), LlavaVisionAdapter)
