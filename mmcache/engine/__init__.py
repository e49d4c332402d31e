"""The reference host engine: continuous batching for transformers decoder models over mmcache's page pools.

Modules, one concept each: ``request`` (what callers pass and get back), ``config`` (EngineConfig),
``intake`` (request validation and naming), ``attention`` (the paged attention function registered with
transformers), ``adapter`` (where a model's embeddings, decoder and head live), ``compute`` (the CPU compute
path behind one seam: ``ComputeConfig``, ``ComputePath``, the kernels), ``runner`` (one packed forward),
``sequence`` (per-request state), ``scheduler`` (continuous batching, chunked prefill, preemption),
``sampling``, ``presets`` / ``models`` / ``tokenizer`` (embedded models, loading, export, digests), ``engine``
(the glue), ``cli``; ``vlm`` and ``vlm_presets`` (the VLM front end: chat messages with images through
``encoders`` and the store; ``encoders`` is imported only when a VLM is built).
"""

from .adapter import CausalLMAdapter, MRopeAdapter, adapter_for
from .attention import ATTENTION_BACKEND, UnsupportedModel
from .compute import ComputeConfig, ComputeConfigError, ComputePath, ComputeSettings
from .config import EngineConfig, EngineConfigError
from .engine import Engine, ForwardError, SamplingError
from .models import ModelLoadError, build_model, export_model, load_model, model_digest
from .presets import PRESETS, UnknownPreset
from .request import MultimodalInput, Request, RequestOutput, SamplingParams, StreamEvent
from .vlm import VLMEngine, VLMRequest, answer_message
from .vlm_presets import VLM_PRESETS, build_vlm

__all__ = [
    "ATTENTION_BACKEND", "CausalLMAdapter", "ComputeConfig", "ComputeConfigError", "ComputePath",
    "ComputeSettings", "Engine", "EngineConfig", "EngineConfigError", "ForwardError",
    "MRopeAdapter", "ModelLoadError", "MultimodalInput", "PRESETS", "Request", "RequestOutput", "SamplingError",
    "SamplingParams", "StreamEvent", "UnknownPreset", "VLMEngine", "VLMRequest", "VLM_PRESETS", "answer_message",
    "build_vlm", "UnsupportedModel", "adapter_for", "build_model", "export_model", "load_model",
    "model_digest",
]
