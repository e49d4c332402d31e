"""The reference host engine: continuous batching for transformers decoder models over mmcache's page pools.

Modules, one concept each: ``request`` (what callers pass and get back), ``config`` (EngineConfig),
``intake`` (request validation and naming), ``attention`` (the paged attention function registered with
transformers), ``adapter`` (where a model's embeddings, decoder and head live), ``compute`` (the CPU compute
path behind one seam: ``ComputeConfig``, ``ComputePath``, the kernels), ``runner`` (one packed forward),
``sequence`` (per-request state), ``scheduler`` (continuous batching, chunked prefill, preemption),
``sampling``, ``models`` (loading a local folder, digests),
``engine`` (the glue), ``cli``. The engine imports only the core: the VLM front end is a host
(``mmcache.hosts.vlm``) and the embedded models are presets (``mmcache.presets``).
"""

from .adapter import CausalLMAdapter, MRopeAdapter, adapter_for
from .attention import ATTENTION_BACKEND, UnsupportedModel
from .compute import ComputeConfig, ComputeConfigError, ComputePath, ComputeSettings
from .config import EngineConfig, EngineConfigError
from .engine import Engine, ForwardError, SamplingError
from .models import ModelLoadError, load_model, model_digest
from .request import MultimodalInput, Request, RequestOutput, SamplingParams, StreamEvent

__all__ = [
    "ATTENTION_BACKEND", "CausalLMAdapter", "ComputeConfig", "ComputeConfigError", "ComputePath",
    "ComputeSettings", "Engine", "EngineConfig", "EngineConfigError", "ForwardError",
    "MRopeAdapter", "ModelLoadError", "MultimodalInput", "Request", "RequestOutput", "SamplingError",
    "SamplingParams", "StreamEvent", "UnsupportedModel", "adapter_for", "load_model", "model_digest",
]
