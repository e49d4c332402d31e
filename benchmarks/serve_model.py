"""The text model ``mmcache bench serve`` serves: an embedded preset written as a Hugging Face folder that both
mmcache (``ServerConfig(model=folder)``) and vLLM's server load, with its vocabulary cut to its tokenizer's.

Why the cut: ``small`` keeps Qwen2.5-0.5B's 151,936-row vocabulary over an 8,192-entry tokenizer, so most ids
its random weights generate decode to no text, and a streamed answer then has no chunk to time a first token
by (mmcache sends only non-empty text deltas; vLLM sends empty ones). With the rows past the tokenizer dropped
(the first rows kept, tied head included) every generated id is one the tokenizer decodes, as in
``bench-llava``'s language model, which is ``small`` sized to its tokenizer the same way.

Invariants: the same preset and dtype give the same folder contents; a preset whose vocabulary already fits its
tokenizer is written unchanged.
"""

from __future__ import annotations

from pathlib import Path


def export_text_model(preset: str, out_dir, dtype: str) -> Path:
    """Write ``preset`` (vocabulary cut to its tokenizer) to ``out_dir`` (new or empty); returns the folder."""
    from mmcache.presets.export import name_generic_tokenizer
    from mmcache.presets.text import build_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty: the serving benchmark writes its model into a new folder")
    model, tokenizer = build_model(preset, dtype)
    rows = len(tokenizer)
    if model.config.vocab_size > rows:
        model.resize_token_embeddings(rows)
        model.config.vocab_size = rows
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    name_generic_tokenizer(out)
    return out
