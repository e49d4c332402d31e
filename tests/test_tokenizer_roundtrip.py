"""Every preset's tokenizer gives the same ids and text in the engine and in its exported folder.

The engine encodes with ``hf_tokenizer``; an exported folder is read by transformers 5's ``AutoTokenizer``
(which, for some model types, rebuilds the pipeline around the saved vocabulary) and by
``PreTrainedTokenizerFast`` (transformers 4, vLLM). All three must give the same ids and the same decoded text,
or the same prompt generates differently in ``--preset`` and ``--model`` runs.
"""

from __future__ import annotations

import unicodedata

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from mmcache.presets.export import export_model
from mmcache.presets.text import build_model
from mmcache.presets.text import PRESETS, preset_config
from mmcache.presets.tokenizer import EOS, PAD, corpus_lines, hf_tokenizer, train_tokenizer

TINY = sorted(name for name in PRESETS if name.startswith("tiny"))
# small and qwen2.5-0.5b share one tokenizer; exporting their weights would take minutes, so their tokenizer is
# saved beside their config (the config's model_type is what AutoTokenizer picks the class by).
LARGE = sorted(name for name in PRESETS if not name.startswith("tiny"))

TRICKY = [
    "cafe\u0301 cafe\u0301s e\u0301\u0301 n\u0303o A\u030a",
    "caf\u00e9 na\u00efve \u00c5ngstr\u00f6m",
    "A photo of 2024 cats (hello) in 1990s.",
    "3.14159 and 1,000,000 and 0x7f and 12345678901234567890",
    "\u6771\u4eac\u306e\u732b \u5317\u4eac\u70e4\u9e2d \ud55c\uad6d\uc5b4",
    "emoji \U0001f408\u200d\u2b1b \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1ef\U0001f1f5 \u2764\ufe0f",
    "a  b   c\t\td \u00a0e\u3000f",
    "line\nnext\r\n\n\nend\n",
    "   leading and trailing   ",
    "don't I'M he'S we'll they'd you're we've 'tis",
    f"{EOS}",
    f"{PAD}",
    f"a{EOS}b {PAD} c{EOS}{EOS}",
    "",
    " ",
    "\ufb01 \u2126 \u212b \uff21",
]


def _expected_text(model_type: str, text: str) -> str:
    """What a round trip gives back: the text, NFC-normalised under the qwen2 pipeline (tokenizer.py)."""
    return unicodedata.normalize("NFC", text) if model_type == "qwen2" else text


def _assert_loaders_agree(name: str, engine, folder) -> None:
    model_type = PRESETS[name].model_type
    loaders = {"AutoTokenizer": AutoTokenizer.from_pretrained(folder),
               "PreTrainedTokenizerFast": PreTrainedTokenizerFast.from_pretrained(folder)}
    texts = corpus_lines() + TRICKY
    want_ids = engine(texts, add_special_tokens=False)["input_ids"]
    for loader, tok in loaders.items():
        got_ids = tok(texts, add_special_tokens=False)["input_ids"]
        bad = [text for text, want, got in zip(texts, want_ids, got_ids) if want != got]
        assert not bad, f"{name} via {loader} ({type(tok).__name__}) encodes {len(bad)} texts otherwise: {bad[:3]}"
        assert [tok.decode(ids) for ids in want_ids] == [engine.decode(ids) for ids in want_ids], (name, loader)
        assert tok.convert_tokens_to_ids([EOS, PAD]) == [0, 1], (name, loader)
        assert len(tok) <= PRESETS[name].tokenizer_vocab, (name, loader)
    for text, ids in zip(texts, want_ids):
        assert engine.decode(ids) == _expected_text(model_type, text), (name, text)


@pytest.mark.parametrize("name", TINY)
def test_an_exported_tiny_preset_tokenizes_like_the_engine(name, tmp_path):
    folder = export_model(name, tmp_path / name, dtype="float32")
    _assert_loaders_agree(name, build_model(name)[1], folder)


@pytest.mark.parametrize("name", LARGE)
def test_a_saved_large_preset_tokenizer_tokenizes_like_the_engine(name, tmp_path):
    preset = PRESETS[name]
    engine = hf_tokenizer(preset.tokenizer_vocab, model_type=preset.model_type)
    preset_config(preset).save_pretrained(tmp_path)
    engine.save_pretrained(tmp_path)
    _assert_loaders_agree(name, engine, tmp_path)


def test_training_under_the_qwen2_pipeline_is_deterministic_and_keeps_the_special_ids():
    a, b = train_tokenizer(600, model_type="qwen2"), train_tokenizer(600, model_type="qwen2")
    assert a.to_str() == b.to_str() and a.get_vocab_size() <= 600
    assert (a.token_to_id(EOS), a.token_to_id(PAD)) == (0, 1)
