"""Tiny diffusers pipelines with seeded random weights, built from configs in code (no model hub).

* ``tiny_wan_pipeline``: ``WanPipeline`` (text-to-video) = ``UMT5EncoderModel`` + ``WanTransformer3DModel`` +
  ``AutoencoderKLWan`` + the UniPC flow scheduler Wan ships with, and a locally trained T5-layout tokenizer.
* ``tiny_sd3_pipeline``: ``StableDiffusion3Pipeline`` (text-to-image) = two ``CLIPTextModelWithProjection``
  towers + ``T5EncoderModel`` + ``SD3Transformer2DModel`` + ``AutoencoderKL``, with locally trained CLIP and T5
  tokenizers. SD3 is the text-to-image family chosen because one pipeline exercises both CLIP (pooled output
  and a selected hidden layer, ``clip_skip``) and T5 (full padded sequence, no attention mask), the two
  text-encoder kinds of image generation, and it runs tiny.

Invariants: the same config and seed give bit-identical weights in every process; building a pipeline leaves
the global torch RNG as it was (weights are drawn inside ``torch.random.fork_rng``). Every config field has a
default that runs a request in well under a second on a CPU core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .local_tokenizers import clip_tokenizer, t5_tokenizer


@dataclass(frozen=True)
class UMT5Shape:
    """umT5 encoder shape. umT5-XXL (Wan) is d_model 4096, 24 layers, d_ff 10240, 64 heads of 64."""

    d_model: int = 32
    num_layers: int = 2
    d_ff: int = 64
    num_heads: int = 4
    d_kv: int = 8


@dataclass(frozen=True)
class WanPreset:
    text_encoder: UMT5Shape = field(default_factory=UMT5Shape)
    vocab_size: int = 2000
    dit_heads: int = 2
    dit_head_dim: int = 12
    dit_layers: int = 2
    dit_ffn: int = 32
    vae_base_dim: int = 3
    seed: int = 0


@dataclass(frozen=True)
class SD3Preset:
    clip_hidden: tuple[int, int] = (32, 32)  # CLIP-L and CLIP-G widths (768 and 1280 in SD3)
    clip_layers: int = 3
    clip_max_length: int = 77
    t5: UMT5Shape = field(default_factory=lambda: UMT5Shape(d_model=64))  # must be >= sum(clip_hidden)
    vocab_size: int = 2000
    dit_heads: int = 4
    dit_head_dim: int = 8
    dit_layers: int = 1
    vae_channels: int = 4
    seed: int = 0


def _seeded(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().eval()


def tiny_wan_pipeline(preset: WanPreset = WanPreset()):
    """A ``WanPipeline`` with seeded random weights; requests of 16x16 pixels and 5 frames take well under 1 s."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer(vocab_size=preset.vocab_size)
    te = preset.text_encoder
    cfg = UMT5Config(vocab_size=len(tokenizer), d_model=te.d_model, d_kv=te.d_kv, d_ff=te.d_ff,
                     num_layers=te.num_layers, num_heads=te.num_heads, dropout_rate=0.0,
                     feed_forward_proj="gated-gelu", pad_token_id=tokenizer.pad_token_id,
                     eos_token_id=tokenizer.eos_token_id)
    text_encoder = _seeded(preset.seed, lambda: UMT5EncoderModel(cfg))
    transformer = _seeded(preset.seed + 1, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=preset.dit_heads, attention_head_dim=preset.dit_head_dim,
        in_channels=16, out_channels=16, text_dim=te.d_model, freq_dim=256, ffn_dim=preset.dit_ffn,
        num_layers=preset.dit_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32))
    vae = _seeded(preset.seed + 2, lambda: AutoencoderKLWan(
        base_dim=preset.vae_base_dim, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True]))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae,
                       scheduler=scheduler)


def tiny_sd3_pipeline(preset: SD3Preset = SD3Preset()):
    """A ``StableDiffusion3Pipeline`` with seeded random weights; 16x16 images take well under 1 s."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    clip_tok = clip_tokenizer(vocab_size=preset.vocab_size, model_max_length=preset.clip_max_length)
    t5_tok = t5_tokenizer(vocab_size=preset.vocab_size)
    width_l, width_g = preset.clip_hidden
    t5_cfg = _t5_config(t5_tok, preset.t5)
    return StableDiffusion3Pipeline(
        text_encoder=_seeded(preset.seed, lambda: CLIPTextModelWithProjection(_clip_config(clip_tok, width_l, preset))),
        tokenizer=clip_tok,
        text_encoder_2=_seeded(preset.seed + 1,
                               lambda: CLIPTextModelWithProjection(_clip_config(clip_tok, width_g, preset))),
        tokenizer_2=clip_tok,
        text_encoder_3=_seeded(preset.seed + 2, lambda: T5EncoderModel(t5_cfg)),
        tokenizer_3=t5_tok,
        transformer=_seeded(preset.seed + 3, lambda: _sd3_transformer(preset)),
        vae=_seeded(preset.seed + 4, lambda: _sd3_vae(preset)),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


def _clip_config(tokenizer, width: int, preset: SD3Preset):
    """The ``CLIPTextConfig`` of one of SD3's two CLIP towers, ``width`` wide."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                          num_hidden_layers=preset.clip_layers, num_attention_heads=4, projection_dim=width,
                          max_position_embeddings=preset.clip_max_length, hidden_act="gelu",
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          pad_token_id=tokenizer.pad_token_id)


def _t5_config(tokenizer, t5: UMT5Shape):
    """The ``T5Config`` of SD3's T5 encoder, shaped by ``t5``."""
    from transformers import T5Config

    return T5Config(vocab_size=len(tokenizer), d_model=t5.d_model, d_kv=t5.d_kv, d_ff=t5.d_ff,
                    num_layers=t5.num_layers, num_heads=t5.num_heads, dropout_rate=0.0,
                    feed_forward_proj="gated-gelu", pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id)


def _sd3_transformer(preset: SD3Preset):
    """SD3's denoiser, its joint attention as wide as the T5 encoder and its pooled input both CLIP widths."""
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=16, patch_size=1, in_channels=preset.vae_channels, num_layers=preset.dit_layers,
        attention_head_dim=preset.dit_head_dim, num_attention_heads=preset.dit_heads,
        caption_projection_dim=preset.dit_heads * preset.dit_head_dim, joint_attention_dim=preset.t5.d_model,
        pooled_projection_dim=sum(preset.clip_hidden), out_channels=preset.vae_channels, pos_embed_max_size=32)


def _sd3_vae(preset: SD3Preset):
    """SD3's autoencoder: one block each way, ``vae_channels`` latent channels, SD3's shift and scale."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",), block_out_channels=(preset.vae_channels,),
        latent_channels=preset.vae_channels, norm_num_groups=1, sample_size=16, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
