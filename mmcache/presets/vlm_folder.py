"""A VLM from a local Hugging Face folder: what ``mmcache serve --model DIR`` serves when DIR holds a LLaVA or a
Qwen2-VL model (a text model's folder goes to ``Engine.from_pretrained``).

The folder holds ``config.json`` (``model_type`` ``llava`` or ``qwen2_vl``: ``VLM_TYPES``), the weights,
``preprocessor_config.json`` and ``tokenizer.json``, as llava-hf's and Qwen's folders do. The model loads with
``AutoModelForImageTextToText`` (sdpa attention), the image processor with the PIL backend (torchvision is no
dependency of this project), the tokenizer from ``tokenizer.json``.

Prompts are rendered with the folder's own Jinja chat template (``encoders.jinja_template.folder_template``:
chat_template.jinja, chat_template.json or tokenizer_config.json), or with the file given as ``chat_template``
(``--chat-template``), through ``JinjaChatTemplate``, which knows where each image's placeholders go. A folder
without one gets the engine's own template of its model type (``LlavaTemplate``: llava-1.5's Vicuna turns;
``ChatMLTemplate``: Qwen2-VL's), and a log line says so.

Failures are ``ModelLoadError``s that name the folder: a missing file, weights that do not fit the config (the
text loader's check), a tokenizer without a token the template needs, a chat template that cannot be read or
that breaks the rules of ``JinjaChatTemplate`` (what broke is named).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from encoders.chat_template import ChatMLTemplate, LlavaTemplate
from encoders.jinja_template import ChatTemplateError, JinjaChatTemplate, folder_template, read_template_file, \
    special_tokens_of
from encoders.vision import LlavaVisionAdapter, Qwen2VLVisionAdapter

from ..engine.models import ModelLoadError, check_weights_fit, resolve_dtype
from ..errors import InvalidRequest
from .vlm import VLMPreset

VLM_TYPES = {"llava": (LlavaTemplate, LlavaVisionAdapter), "qwen2_vl": (ChatMLTemplate, Qwen2VLVisionAdapter)}
IMAGE_TOKENS = {"llava": "<image>", "qwen2_vl": "<|image_pad|>"}  # the token a template writes for an image
log = logging.getLogger(__name__)
NEEDED = ("config.json", "preprocessor_config.json", "tokenizer.json")


def model_type(folder) -> str | None:
    """The ``model_type`` of ``folder``'s config.json; None when there is no readable one."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def is_vlm_folder(folder) -> bool:
    return model_type(folder) in VLM_TYPES


def load_vlm(folder, dtype: str = "bfloat16", chat_template=None) -> VLMPreset:
    """The folder's model (eval mode, ``dtype``), image processor, tokenizer, template and adapter class;
    ``chat_template``: a Jinja file rendered in place of the folder's own template (module docstring)."""
    path = Path(folder)
    kind = model_type(path)
    if kind not in VLM_TYPES:
        raise ModelLoadError(f"{path} is not a VLM folder this server loads (model_type {kind!r}; it loads "
                             f"{', '.join(VLM_TYPES)})")
    missing = [name for name in NEEDED if not (path / name).is_file()]
    if missing:
        raise ModelLoadError(f"{path} lacks {', '.join(missing)}, which a VLM folder needs")
    source = _template_source(path, chat_template)
    template_class, adapter_class = VLM_TYPES[kind]
    model, processor, tokenizer = _load_parts(path, dtype)
    try:
        if source is None:
            log.warning("%s has no chat template: rendering with the engine's own %s", path, template_class.__name__)
            template = template_class(tokenizer)
        else:
            template = JinjaChatTemplate(tokenizer, source[0], IMAGE_TOKENS[kind], special_tokens_of(path))
    except ChatTemplateError as e:
        raise ModelLoadError(f"cannot serve {path} with the chat template of {source[1]}: {e}") from e
    except InvalidRequest as e:  # the tokenizer lacks a special token the template needs
        raise ModelLoadError(f"cannot serve {path}: {e}") from e
    return VLMPreset(path.name, model, processor, tokenizer, template, adapter_class)


def _template_source(path: Path, chat_template) -> tuple[str, Path] | None:
    """The Jinja source to render ``path``'s chats with and where it came from; None: the engine's own."""
    try:
        if chat_template is not None:
            return read_template_file(chat_template), Path(chat_template)
        return folder_template(path)
    except ChatTemplateError as e:
        raise ModelLoadError(f"cannot serve {path}: {e}") from e


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
