"""Embedded model presets: real architectures, configs built in code, weights drawn from a fixed seed.

No model hub is reachable, so every embedded model is a transformers architecture initialised by its own
``_init_weights`` under ``torch.manual_seed(preset.seed)`` (in float32, then cast), inside a forked RNG so
the caller's random state is untouched. Invariants:

* A preset name always yields the same config, weights and tokenizer (hence the same model digest per dtype).
* The tokenizer vocabulary never exceeds the model's; ids 0 and 1 are EOS/BOS and PAD in both.
* The tokenizer is trained under the pipeline transformers' ``AutoTokenizer`` imposes on the preset's
  ``model_type`` (see tokenizer.py), so an exported folder tokenizes exactly as the engine does.
* ``tiny*`` presets run a test in seconds; their weights are drawn wider than transformers' default (0.02)
  so that attention and MLP outputs are not drowned by the embeddings and greedy outputs depend on context.
* ``small`` is Qwen2.5-0.5B's shape with 8 of its 24 layers; ``qwen2.5-0.5b`` is Qwen2.5-0.5B's published
  config (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151936, tied
  embeddings, rope_theta 1e6).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.engine import Engine
from ..engine.models import resolve_dtype
from .tokenizer import EOS, PAD, SPECIAL_TOKENS, hf_tokenizer
from ..errors import MmcacheError


class UnknownPreset(MmcacheError, KeyError):
    def __init__(self, name: str):
        super().__init__(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
        self.name = name

    def __str__(self) -> str:
        return self.args[0]


@dataclass(frozen=True)
class Preset:
    name: str
    model_type: str
    config: dict = field(default_factory=dict)
    tokenizer_vocab: int = 512
    seed: int = 0


_SPECIAL_IDS = {"bos_token_id": SPECIAL_TOKENS.index(EOS), "eos_token_id": SPECIAL_TOKENS.index(EOS),
                "pad_token_id": SPECIAL_TOKENS.index(PAD)}

_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
             initializer_range=0.15)

_QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
                   tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                   use_sliding_window=False, hidden_act="silu")


def _presets() -> dict[str, Preset]:
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    tiny_qwen2 = Preset("tiny-qwen2", "qwen2", {**_TINY, "tie_word_embeddings": True, "rope_parameters": rope})
    out = [
        Preset("tiny", tiny_qwen2.model_type, tiny_qwen2.config),
        tiny_qwen2,
        Preset("tiny-llama", "llama", {**_TINY, "rope_parameters": rope}, seed=1),
        # A short sliding window, so tests exercise windowed attention with prompts of a few pages.
        Preset("tiny-mistral", "mistral", {**_TINY, "sliding_window": 48, "rope_parameters": rope}, seed=2),
        # Gemma scales embeddings by sqrt(hidden); wider weights keep its layers from being drowned by them.
        Preset("tiny-gemma", "gemma", {**_TINY, "initializer_range": 0.5, "rope_parameters": rope}, seed=3),
        Preset("small", "qwen2", {**_QWEN25_05B, "num_hidden_layers": 8}, tokenizer_vocab=8192),
        Preset("qwen2.5-0.5b", "qwen2", dict(_QWEN25_05B), tokenizer_vocab=8192),
    ]
    return {p.name: p for p in out}


PRESETS = _presets()


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownPreset(name) from None


def preset_config(preset: Preset):
    """The transformers config of a preset (architectures set, special token ids of the local tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(preset.model_type, **preset.config, **_SPECIAL_IDS)
    cfg.architectures = [AutoModelForCausalLM._model_mapping[type(cfg)].__name__]
    return cfg


def build_model(preset_name: str, dtype="float32"):
    """``(model, tokenizer)`` of an embedded preset; weights drawn from the preset's seed in float32, then cast."""
    from transformers import AutoModelForCausalLM

    preset = get_preset(preset_name)
    config = preset_config(preset)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(resolve_dtype(dtype)).eval()
    return model, hf_tokenizer(preset.tokenizer_vocab, model_type=preset.model_type)


def engine_from_preset(name: str, dtype="float32", config=None) -> Engine:
    """An ``Engine`` over preset ``name`` (``config``: an ``EngineConfig``, default one)."""
    model, tokenizer = build_model(name, dtype)
    return Engine(model, tokenizer, config)
