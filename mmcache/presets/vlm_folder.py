"""A VLM from a local Hugging Face folder: what ``mmcache serve --model DIR`` serves when DIR holds a LLaVA or a
Qwen2-VL model (a text model's folder goes to ``Engine.from_pretrained``).

The folder holds ``config.json`` (``model_type`` ``llava`` or ``qwen2_vl``: ``VLM_TYPES``), the weights,
``preprocessor_config.json`` and ``tokenizer.json``, as llava-hf's and Qwen's folders do. The model loads with
``AutoModelForImageTextToText`` (sdpa attention), the image processor with the PIL backend (torchvision is no
dependency of this project), the tokenizer from ``tokenizer.json``. Prompts are rendered by the engine's own
template of the model type (``LlavaTemplate``: llava-1.5's Vicuna turns; ``ChatMLTemplate``: Qwen2-VL's), not
by the folder's Jinja template, since the vision adapters need to know where each image's placeholders go.

Failures are ``ModelLoadError``s that name the folder: a missing file, weights that do not fit the config (the
text loader's check), a tokenizer without a token the template needs.
"""

from __future__ import annotations

import json
from pathlib import Path

from encoders.chat_template import ChatMLTemplate, LlavaTemplate
from encoders.vision import LlavaVisionAdapter, Qwen2VLVisionAdapter

from ..engine.models import ModelLoadError, check_weights_fit, resolve_dtype
from ..errors import InvalidRequest
from .vlm import VLMPreset

VLM_TYPES = {"llava": (LlavaTemplate, LlavaVisionAdapter), "qwen2_vl": (ChatMLTemplate, Qwen2VLVisionAdapter)}
NEEDED = ("config.json", "preprocessor_config.json", "tokenizer.json")


def model_type(folder) -> str | None:
    """The ``model_type`` of ``folder``'s config.json; None when there is no readable one."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def is_vlm_folder(folder) -> bool:
    return model_type(folder) in VLM_TYPES


def load_vlm(folder, dtype: str = "bfloat16") -> VLMPreset:
    """The folder's model (eval mode, ``dtype``), image processor, tokenizer, template and adapter class."""
    path = Path(folder)
    kind = model_type(path)
    if kind not in VLM_TYPES:
        raise ModelLoadError(f"{path} is not a VLM folder this server loads (model_type {kind!r}; it loads "
                             f"{', '.join(VLM_TYPES)})")
    missing = [name for name in NEEDED if not (path / name).is_file()]
    if missing:
        raise ModelLoadError(f"{path} lacks {', '.join(missing)}, which a VLM folder needs")
    template_class, adapter_class = VLM_TYPES[kind]
    model, processor, tokenizer = _load_parts(path, dtype)
    try:
        template = template_class(tokenizer)
    except InvalidRequest as e:  # the tokenizer lacks a special token the template needs
        raise ModelLoadError(f"cannot serve {path}: {e}") from e
    return VLMPreset(path.name, model, processor, tokenizer, template, adapter_class)


def _load_parts(path: Path, dtype: str):
    from tokenizers import Tokenizer
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    try:
        model, info = AutoModelForImageTextToText.from_pretrained(
            path, dtype=resolve_dtype(dtype), attn_implementation="sdpa", local_files_only=True,
            output_loading_info=True)
        processor = AutoImageProcessor.from_pretrained(path, backend="pil", local_files_only=True)
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as e:  # transformers', safetensors' and the tokenizers library's many kinds of error
        raise ModelLoadError(f"cannot load {path}: {type(e).__name__}: {e}") from e
    check_weights_fit(path, model, info)
    return model.eval(), processor, tokenizer
