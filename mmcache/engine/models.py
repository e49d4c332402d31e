"""Loading and fingerprinting models (the embedded presets are built and exported by ``mmcache.presets``).

Invariants:

* ``model_digest`` is xxh3_128 over the canonical config (minus fields that do not change the computation:
  private keys, ``architectures``, ``dtype``, ``transformers_version``) and every distinct parameter and
  persistent buffer (name, dtype, shape, bytes) in name order; equal digests mean equal weights and config.
* ``load_model`` serves the folder's own weights or refuses it (``ModelLoadError``): a weight the config needs
  and the files lack, one the files hold and the config has no place for, or one of another shape, which
  transformers would draw at random, drop or refuse, each refuses the folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import xxhash

from ..errors import MmcacheError
from ..names import canonical_encoding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DIGEST_SKIP = {"architectures", "dtype", "torch_dtype", "transformers_version"}
class ModelLoadError(MmcacheError, ValueError):
    """A model folder could not be loaded (missing or damaged files, unknown architecture, weights that do not
    fit the config, a tokenizer without vocabulary, bad dtype)."""


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype)]
    except KeyError:
        raise ModelLoadError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}") from None


def load_model(path, dtype="bfloat16"):
    """``(model, tokenizer or None)`` from a local Hugging Face folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json")
    torch_dtype = resolve_dtype(dtype)
    # transformers and safetensors raise many kinds of error for a damaged folder (OSError, ValueError,
    # RuntimeError for mismatched shapes, SafetensorError for a cut weights file, the tokenizers library's
    # own): each becomes a ModelLoadError that names the folder and keeps the cause.
    try:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa",
                                                               output_loading_info=True)
        except ValueError as e:
            if "sdpa" not in str(e) and "scaled_dot_product_attention" not in str(e):
                raise
            # An architecture without an sdpa path (Gemma 2, GPT-OSS, state-space models): load it with its own
            # attention, so the engine's checks name what it cannot serve (UnsupportedModel) instead of this.
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, output_loading_info=True)
    except Exception as e:
        raise ModelLoadError(f"cannot load {path}: {type(e).__name__}: {e}") from e
    check_weights_fit(path, model, info)
    tokenizer = None
    if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as e:
            raise ModelLoadError(f"cannot load the tokenizer of {path}: {type(e).__name__}: {e}") from e
        # Without its vocabulary files transformers builds the model type's tokenizer empty, which would turn
        # every text prompt into no tokens at all.
        if not set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens):
            raise ModelLoadError(f"the tokenizer of {path} has no vocabulary besides its special tokens: its "
                                 f"vocabulary files (tokenizer.json, or the model type's own) are missing")
    return model.eval(), tokenizer


def check_weights_fit(path: Path, model: torch.nn.Module, info: dict) -> None:
    """Refuse a folder whose weights and config disagree. transformers only warns: it draws every weight the
    files lack at random (a dropped tensor, a config without ``num_hidden_layers`` that builds its default
    depth) and drops every weight the config has no place for (a config naming fewer layers), so the model
    would run and answer wrongly, differently on every load.

    A left-over tensor is refused when it has the name of one of the model's own tensors up to layer indices
    (a layer the config dropped); one of a kind the model does not have at all (a buffer older transformers
    saved, GPT-2's ``masked_bias``, GPTBigCode's ``attn.bias``) is ignored, as transformers ignores it."""
    own = {_SHAPE_OF_NAME.sub("N", name) for name in model.state_dict()}
    problems = {
        "weights the config needs are not in the files": sorted(str(k) for k in info.get("missing_keys") or ()),
        "the files hold weights the config has no place for": sorted(
            str(k) for k in info.get("unexpected_keys") or () if _SHAPE_OF_NAME.sub("N", str(k)) in own),
        "weights have other shapes than the config gives": sorted(
            str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or ()),
    }
    for what, names in problems.items():
        if names:
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise ModelLoadError(f"cannot load {path}: {what} ({shown}); the config and the weights do not belong "
                                 f"together")


_SHAPE_OF_NAME = re.compile(r"(?<=\.)\d+(?=\.)")  # a layer or expert index inside a tensor name


def model_digest(model: torch.nn.Module) -> str:
    """Hex digest over the model's config and weights (see the module docstring)."""
    h = xxhash.xxh3_128()
    cfg = json.loads(model.config.to_json_string(use_diff=False))
    h.update(canonical_encoding({k: v for k, v in cfg.items() if not k.startswith("_") and k not in _DIGEST_SKIP}))
    seen = set()
    for name, t in sorted(model.state_dict().items()):
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key in seen:
            continue  # a tied weight is hashed once, under its first name
        seen.add(key)
        h.update(canonical_encoding([name, str(t.dtype), list(t.shape)]))
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()
