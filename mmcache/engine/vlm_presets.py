"""VLM presets the engine serves: the encoders' tiny presets, and ``bench-llava``, the benchmark's model.

* ``tiny-llava``, ``tiny-llava-siglip``, ``tiny-qwen2-vl``: ``encoders.vlm_presets`` (built in well under a
  second; for tests).
* ``bench-llava``: ``LlavaForConditionalGeneration`` with a CLIP ViT-B/16 tower at 224x224 pixels (hidden 768,
  12 layers, 12 heads, MLP 3072: ViT-B's shape), llava-1.5's recipe (features of the second-to-last layer, CLS
  dropped: 14 x 14 = 196 placeholders per image) and two-layer GELU projector (768 -> 896 -> 896), over the
  engine's ``small`` language model (Qwen2.5-0.5B's shape with 8 of its 24 layers: hidden 896, 14 heads,
  2 KV heads, MLP 4864, tied embeddings, rope theta 1e6) with its vocabulary sized to the preset's tokenizer
  (516 entries instead of 151,936, so every id the model can generate is one the chat template accepts back;
  the head's one prefill row was a negligible share of a prefill). ``CLIPImageProcessorPil`` at CLIP's
  defaults (shortest edge 224, bicubic, centre crop 224, CLIP mean and std). The Vicuna template and the BPE
  tokenizer of the tiny LLaVA preset (trained on the LLaVA-Bench questions). About 208M parameters: tower
  86M, projector 1.5M, language model 120M.

Invariants: a preset name and dtype always give the same config and weights (drawn in float32 from the
preset's seed inside a forked RNG, so the caller's random state is untouched, then cast), hence the same model
digest and adapter fingerprint in every process. ``encoders`` is imported only when a preset is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .models import resolve_dtype
from .presets import PRESETS, UnknownPreset

if TYPE_CHECKING:
    from encoders.vlm_presets import VLMPreset

TINY_VLM_PRESETS = ("tiny-llava", "tiny-llava-siglip", "tiny-qwen2-vl")
VLM_PRESETS = TINY_VLM_PRESETS + ("bench-llava",)

BENCH_TOWER = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   image_size=224, patch_size=16)
BENCH_IMAGE_SIZE = 224


def build_vlm(name: str, dtype="float32", seed: int = 0) -> "VLMPreset":
    """The VLM preset ``name`` (one of ``VLM_PRESETS``) with its model cast to ``dtype``, in eval mode."""
    if name not in VLM_PRESETS:
        raise UnknownPreset(name)
    from encoders.vlm_presets import build_preset

    if name in TINY_VLM_PRESETS:
        preset = build_preset(name, seed)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            preset = _bench_llava()
    preset.model = preset.model.to(resolve_dtype(dtype)).eval()
    return preset


def _bench_llava() -> "VLMPreset":
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration,
                              Qwen2Config)

    from encoders.chat_template import LlavaTemplate
    from encoders.vision import LlavaVisionAdapter
    from encoders.vlm_presets import LLAVA_SPECIAL, VLMPreset, vlm_tokenizer

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
