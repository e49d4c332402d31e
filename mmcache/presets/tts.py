"""A voice-cloning TTS pipeline with seeded random weights, built from configs in code (no model hub).

``csm_pipeline`` builds transformers' ``CsmForConditionalGeneration`` (Sesame's Conversational Speech Model:
a Llama backbone over text and audio frames, a depth decoder for the codebooks of each frame, and a Mimi codec
that turns reference audio into 32 codebooks at 12.5 frames a second) with its ``CsmProcessor`` and a locally
trained byte-level BPE carrying CSM's two audio tokens. Voice cloning with CSM: the reference clip and its
transcript come first in the prompt, the text to speak after (``encoders.voice.voice_prompt``), and the model
continues in the reference's voice.

* The codec is the part the cache serves. ``CODECS["mimi"]`` is the published Mimi configuration (transformers'
  ``MimiConfig()`` defaults, the codec of CSM-1B and Moshi: 79 M parameters), so its encode time is the real
  one; ``CODECS["tiny"]`` keeps Mimi's convolution strides and kernels (which fix the frame count the processor
  computes) with a narrow network, for tests.
* The backbone and depth decoder are small (``BACKBONES``): this package measures the reference encoder and
  the request around it, not CSM-1B's generation speed.

Mimi's codebook centroids are buffers that a random initialization leaves at zero (every code would be 0);
they are drawn at random here too.

Invariants: the same arguments give bit-identical weights in every process, and building leaves the global
torch RNG as it was (weights are drawn inside ``torch.random.fork_rng``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from encoders.voice import AUDIO_EOS_TOKEN, AUDIO_TOKEN, SAMPLING_RATE, VoicePipeline
from mmcache.presets.tokenizer import hf_tokenizer
from mmcache.errors import InvalidRequest

TEXT_VOCAB = 1024

CODECS = {
    "mimi": {},
    "tiny": {"hidden_size": 32, "num_filters": 4, "num_hidden_layers": 1, "num_attention_heads": 2,
             "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "codebook_dim": 16,
             "vector_quantization_hidden_dimension": 16, "upsample_groups": 32},
}


@dataclass(frozen=True)
class Backbone:
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    depth_hidden: int
    depth_layers: int


BACKBONES = {"tiny": Backbone(128, 2, 4, 2, 256, 64, 1)}


def csm_pipeline(codec: str = "mimi", backbone: str = "tiny", seed: int = 0) -> VoicePipeline:
    """CSM with seeded random weights, its processor and tokenizer (see the module docstring)."""
    from transformers import CsmConfig, CsmForConditionalGeneration, CsmProcessor, EncodecFeatureExtractor, MimiConfig

    if codec not in CODECS:
        raise InvalidRequest(f"unknown codec preset {codec!r}; known: {', '.join(CODECS)}")
    if backbone not in BACKBONES:
        raise InvalidRequest(f"unknown backbone preset {backbone!r}; known: {', '.join(BACKBONES)}")
    tok = hf_tokenizer(TEXT_VOCAB)
    tok.add_special_tokens({"additional_special_tokens": [AUDIO_TOKEN, AUDIO_EOS_TOKEN]})
    audio_id, audio_eos_id = tok.convert_tokens_to_ids([AUDIO_TOKEN, AUDIO_EOS_TOKEN])
    extractor = EncodecFeatureExtractor(feature_size=1, sampling_rate=SAMPLING_RATE, padding_value=0.0)
    processor = CsmProcessor(extractor, tok)
    b = BACKBONES[backbone]
    config = CsmConfig(
        hidden_size=b.hidden_size, num_hidden_layers=b.layers, num_attention_heads=b.heads,
        num_key_value_heads=b.kv_heads, intermediate_size=b.intermediate_size, text_vocab_size=len(tok),
        audio_token_id=audio_id, audio_eos_token_id=audio_eos_id, bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id,
        depth_decoder_config={"hidden_size": b.depth_hidden, "num_hidden_layers": b.depth_layers,
                              "num_attention_heads": 4, "num_key_value_heads": 2,
                              "intermediate_size": 2 * b.depth_hidden, "backbone_hidden_size": b.hidden_size},
        codec_config=MimiConfig(**CODECS[codec]).to_dict())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CsmForConditionalGeneration(config).eval()
        _seed_codebooks(model.codec_model)
    # Audio frames hold codes below the codec's codebook size; the heads' last ids (CSM's padding and end
    # markers) are not codes the codec can decode. A trained model does not emit them inside a frame; random
    # heads would, so generation suppresses them, in the backbone (codebook 0) and the depth decoder.
    specials = list(range(config.codec_config.codebook_size, config.vocab_size))
    model.generation_config.suppress_tokens = specials
    model.depth_decoder.generation_config.suppress_tokens = specials
    return VoicePipeline(model, processor)


def _seed_codebooks(codec: torch.nn.Module) -> None:
    """Random codebook centroids. Mimi initializes them to zero (a trained codec loads them), and with every
    centroid equal each frame's nearest one is the first: all codes would be 0, whatever the audio."""
    from transformers.models.mimi.modeling_mimi import MimiEuclideanCodebook

    with torch.no_grad():
        for book in codec.modules():
            if isinstance(book, MimiEuclideanCodebook):
                book.embed_sum.normal_()
                book._embed = None  # the centroid cache, rebuilt from embed_sum on first use
