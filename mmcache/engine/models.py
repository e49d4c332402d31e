"""Building, loading, exporting and fingerprinting models.

Invariants:

* ``model_digest`` is xxh3_128 over the canonical config (minus fields that do not change the computation:
  private keys, ``architectures``, ``dtype``, ``transformers_version``) and every distinct parameter and
  persistent buffer (name, dtype, shape, bytes) in name order; equal digests mean equal weights and config.
* ``export_model`` writes an ordinary Hugging Face folder (``EXPORT_FILES``: config.json, model.safetensors,
  generation config, tokenizer files) that ``AutoModelForCausalLM`` / ``AutoTokenizer`` and vLLM load, and
  that ``load_model`` reads back to the same digest. The folder gets every file or none: they are written
  beside it and moved in only when all are written. It overwrites only a folder that its own mark
  (``EXPORT_MARK``) names an earlier export.
* ``load_model`` serves the folder's own weights or refuses it (``ModelLoadError``): a weight the config needs
  and the files lack, one the files hold and the config has no place for, or one of another shape, which
  transformers would draw at random, drop or refuse, each refuses the folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
import xxhash

from ..errors import MmcacheError
from ..names import canonical_encoding
from .presets import get_preset, preset_config
from .tokenizer import hf_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DIGEST_SKIP = {"architectures", "dtype", "torch_dtype", "transformers_version"}
EXPORT_MARK = "mmcache_export.json"
"""Written into every export (the preset and dtype it holds): a folder without it is not an earlier export,
whatever files it holds, and is never overwritten."""
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", EXPORT_MARK)


class ModelExportError(MmcacheError, OSError):
    """A preset could not be exported: the folder is not a new, empty or earlier export's folder, or writing
    failed (no space, a file in the way); nothing was left in the folder."""


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
    _check_weights_fit(path, model, info)
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


def _check_weights_fit(path: Path, model: torch.nn.Module, info: dict) -> None:
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


def export_model(preset_name: str, out_dir, dtype="bfloat16") -> Path:
    """Write an embedded preset as a Hugging Face folder; returns the folder.

    ``out_dir`` may be new, empty, or an earlier export (its files are replaced; it is known by its
    ``EXPORT_MARK``). Any other folder is refused before the model is built: one holding another model's files
    (written by ``save_pretrained``, say, with the very names an export writes) would lose them, one holding
    other files beside these (a shard index) would load wrongly, and an empty path would mean the current
    folder. The files are written
    into a temporary folder beside ``out_dir`` and moved in once all are written, so a failure (no space,
    an unwritable file) leaves ``out_dir`` as it was. Every file gets the mode an ordinary write gives (0666
    less the umask)."""
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir).strip():
        raise ModelExportError(f"the output folder must be a non-empty path, got {out_dir!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ModelExportError(f"cannot write {out}: it exists and is not a folder")
    if out.is_dir():
        other = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES or not p.is_file())
        if other:
            raise ModelExportError(f"{out} holds files an export does not write ({', '.join(other[:5])}); "
                                   f"export into a new or empty folder")
        if any(out.iterdir()) and not (out / EXPORT_MARK).is_file():
            raise ModelExportError(f"{out} holds a model that mmcache did not export (no {EXPORT_MARK}); its files "
                                   f"would be replaced: export into a new or empty folder (an export written "
                                   f"before exports were marked has no mark either: delete it first)")
    model, tokenizer = build_model(preset_name, dtype)
    tmp = None
    try:
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.absolute().name}.export-", dir=out.absolute().parent))
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # transformers 5 records its own backend class; the generic fast class also loads in transformers 4
        # (vLLM).
        tok_cfg = tmp / "tokenizer_config.json"
        cfg = json.loads(tok_cfg.read_text())
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        tok_cfg.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (tmp / EXPORT_MARK).write_text(json.dumps({"preset": preset_name, "dtype": str(dtype)}, indent=2) + "\n")
        # safetensors' save_file makes its file private (0600); give every file the mode the others have.
        mode = _new_file_mode(tmp)
        for path in tmp.iterdir():
            if path.is_file():
                path.chmod(mode)
        out.mkdir(exist_ok=True)
        # the mark last, so a new folder is marked only once every file is in it
        for name in sorted((p.name for p in tmp.iterdir()), key=lambda name: (name == EXPORT_MARK, name)):
            os.replace(tmp / name, out / name)
    except Exception as e:  # OSError, safetensors' and the tokenizers library's own errors for a failed write
        raise ModelExportError(f"cannot write {out}: {type(e).__name__}: {e}") from e
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _new_file_mode(folder: Path) -> int:
    """The permission bits an ordinary new file in ``folder`` gets (0666 less the umask), found by making one:
    reading the umask means setting it, which is process-wide and would race with other threads."""
    probe = folder / ".mode-probe"
    probe.touch()
    try:
        return probe.stat().st_mode & 0o777
    finally:
        probe.unlink()


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
