"""Writing an embedded preset as an ordinary Hugging Face folder (``mmcache export-model``).

Invariants: ``export_model`` writes a text preset's ``EXPORT_FILES`` (config.json, model.safetensors, generation
config, tokenizer files, chat_template.jinja) that ``AutoModelForCausalLM`` / ``AutoTokenizer`` and vLLM load, and
that ``mmcache.engine.models.load_model`` reads back to the same digest; a VLM preset's ``VLM_EXPORT_FILES`` add the
image processor (preprocessor_config.json) and the processor's settings (processor_config.json), and load back
through ``vlm_folder.load_vlm``. Every export carries a chat template equivalent to the engine's own
(``encoders.jinja_template``: the Vicuna turns for LLaVA, ChatML for Qwen2-VL, plain ``role: text`` lines for
the text presets, whose tokenizers have no turn tokens), so every server renders the same text. Class names
in the files are ones both transformers versions in use know (``name_generic_tokenizer``, the image
processors' backend-free names). The folder gets every file or none: they are written beside it and moved in
only when all are written. It overwrites only a folder that its own mark (``EXPORT_MARK``) names an earlier
export.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import MmcacheError
from .text import PRESETS, UnknownPreset, build_model
from .vlm import VLM_PRESETS

EXPORT_MARK = "mmcache_export.json"
"""Written into every export (the preset and dtype it holds): a folder without it is not an earlier export,
whatever files it holds, and is never overwritten."""
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja", EXPORT_MARK)
"""What a text preset's export holds."""
VLM_EXPORT_FILES = EXPORT_FILES + ("preprocessor_config.json", "processor_config.json")
"""What a VLM preset's export holds: every name an export may write (an earlier export may hold any of them)."""


class ModelExportError(MmcacheError, OSError):
    """A preset could not be exported: the folder is not a new, empty or earlier export's folder, or writing
    failed (no space, a file in the way); nothing was left in the folder."""


def export_model(preset_name: str, out_dir, dtype="bfloat16") -> Path:
    """Write an embedded preset (text or VLM) as a Hugging Face folder; returns the folder. ``UnknownPreset``
    for a name that is neither.

    ``out_dir`` may be new, empty, or an earlier export (its files are replaced; it is known by its
    ``EXPORT_MARK``). Any other folder is refused before the model is built: one holding another model's files
    (written by ``save_pretrained``, say, with the very names an export writes) would lose them, one holding
    other files beside these (a shard index) would load wrongly, and an empty path would mean the current
    folder. The files are written
    into a temporary folder beside ``out_dir`` and moved in once all are written, so a failure (no space,
    an unwritable file) leaves ``out_dir`` as it was. Every file gets the mode an ordinary write gives (0666
    less the umask)."""
    out = _export_folder(out_dir)
    if preset_name not in PRESETS and preset_name not in VLM_PRESETS:
        raise UnknownPreset(preset_name)
    write = _write_vlm if preset_name in VLM_PRESETS else _write_text
    tmp = None
    try:
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.absolute().name}.export-", dir=out.absolute().parent))
        write(tmp, preset_name, dtype)
        _finish(tmp, preset_name, dtype)
        out.mkdir(exist_ok=True)
        for stale in set(VLM_EXPORT_FILES) - {p.name for p in tmp.iterdir()}:  # an earlier export of another kind
            (out / stale).unlink(missing_ok=True)
        # the mark last, so a new folder is marked only once every file is in it
        for name in sorted((p.name for p in tmp.iterdir()), key=lambda name: (name == EXPORT_MARK, name)):
            os.replace(tmp / name, out / name)
    except Exception as e:  # OSError, safetensors' and the tokenizers library's own errors for a failed write
        raise ModelExportError(f"cannot write {out}: {type(e).__name__}: {e}") from e
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _export_folder(out_dir) -> Path:
    """``out_dir`` as a path once it is known to be new, empty or an earlier export's folder;
    ``ModelExportError`` otherwise."""
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir).strip():
        raise ModelExportError(f"the output folder must be a non-empty path, got {out_dir!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ModelExportError(f"cannot write {out}: it exists and is not a folder")
    if out.is_dir():
        other = sorted(p.name for p in out.iterdir() if p.name not in VLM_EXPORT_FILES or not p.is_file())
        if other:
            raise ModelExportError(f"{out} holds files an export does not write ({', '.join(other[:5])}); "
                                   f"export into a new or empty folder")
        if any(out.iterdir()) and not (out / EXPORT_MARK).is_file():
            raise ModelExportError(f"{out} holds a model that mmcache did not export (no {EXPORT_MARK}); its files "
                                   f"would be replaced: export into a new or empty folder (an export written "
                                   f"before exports were marked has no mark either: delete it first)")
    return out


def _write_text(tmp: Path, preset_name: str, dtype) -> None:
    """A text preset's ``EXPORT_FILES`` but the mark into ``tmp``."""
    from encoders.jinja_template import PLAIN_JINJA

    model, tokenizer = build_model(preset_name, dtype)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    name_generic_tokenizer(tmp)
    (tmp / "chat_template.jinja").write_text(PLAIN_JINJA, encoding="utf-8")


IMAGE_PROCESSOR_TYPES = {"CLIPImageProcessorPil": "CLIPImageProcessor",
                         "SiglipImageProcessorPil": "SiglipImageProcessor",
                         "Qwen2VLImageProcessorPil": "Qwen2VLImageProcessor"}
"""The image processors' backend-free names: transformers resolves them to the PIL classes where torchvision is
missing (and to its own default backend where it is), in the engine's version and in vLLM's."""


def _write_vlm(tmp: Path, preset_name: str, dtype) -> None:
    """A VLM preset's ``VLM_EXPORT_FILES`` but the mark into ``tmp``."""
    from encoders.chat_template import LlavaTemplate
    from encoders.jinja_template import CHATML_JINJA, LLAVA_JINJA

    from .vlm import build_vlm, hf_tokenizer

    preset = build_vlm(preset_name, dtype)
    preset.model.save_pretrained(tmp, safe_serialization=True)
    if isinstance(preset.template, LlavaTemplate):
        name_tower_weights(tmp / "model.safetensors")
    preset.image_processor.save_pretrained(tmp)
    processor_file = tmp / "preprocessor_config.json"
    settings = json.loads(processor_file.read_text())
    kind = settings.get("image_processor_type")
    settings["image_processor_type"] = IMAGE_PROCESSOR_TYPES.get(kind, kind)
    processor_file.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    tokenizer = hf_tokenizer(preset)
    config = preset.model.config
    if isinstance(preset.template, LlavaTemplate):
        tokenizer.bos_token, tokenizer.pad_token = "<s>", "<pad>"
        source = LLAVA_JINJA
        tower = config.vision_config
        processor = {"processor_class": "LlavaProcessor", "image_token": "<image>",
                     "patch_size": tower.patch_size, "vision_feature_select_strategy":
                         config.vision_feature_select_strategy,
                     "num_additional_image_tokens": int(tower.model_type == "clip_vision_model")}
    else:
        tokenizer.pad_token = "<|endoftext|>"
        source = CHATML_JINJA
        processor = {"processor_class": "Qwen2VLProcessor"}
    tokenizer.save_pretrained(tmp)
    name_generic_tokenizer(tmp)
    (tmp / "chat_template.jinja").write_text(source, encoding="utf-8")
    (tmp / "processor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n")


TOWER = "vision_tower."
TOWER_MODEL = "vision_tower.vision_model."


def name_tower_weights(path: Path) -> None:
    """Give a LLaVA export's CLIP or SigLIP tower weights the names with the tower's ``vision_model`` level
    (``vision_tower.vision_model.encoder...``): transformers 5 saves them without it and reads both forms, while
    vLLM 0.32's LLaVA loader knows only the names with it and refuses the folder otherwise. The tensors are
    unchanged."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    renamed = {(TOWER_MODEL + k[len(TOWER):] if k.startswith(TOWER) and not k.startswith(TOWER_MODEL) else k): v
               for k, v in tensors.items()}
    if renamed.keys() != tensors.keys():
        save_file(renamed, str(path), metadata={"format": "pt"})


def _finish(tmp: Path, preset_name: str, dtype) -> None:
    """The mark, then every file given the mode an ordinary write gives."""
    (tmp / EXPORT_MARK).write_text(json.dumps({"preset": preset_name, "dtype": str(dtype)}, indent=2) + "\n")
    # safetensors' save_file makes its file private (0600); give every file the mode the others have.
    mode = _new_file_mode(tmp)
    for path in tmp.iterdir():
        if path.is_file():
            path.chmod(mode)


def _new_file_mode(folder: Path) -> int:
    """The permission bits an ordinary new file in ``folder`` gets (0666 less the umask), found by making one:
    reading the umask means setting it, which is process-wide and would race with other threads."""
    probe = folder / ".mode-probe"
    probe.touch()
    try:
        return probe.stat().st_mode & 0o777
    finally:
        probe.unlink()


def name_generic_tokenizer(folder: Path) -> None:
    """Make the saved tokenizer's class the generic fast one: transformers 5 records its own backend class,
    which transformers 4 (vLLM's) does not know; the generic class loads in both."""
    path = Path(folder) / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
