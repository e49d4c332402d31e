"""A locally built tokenizer for the embedded models: byte-level BPE trained on the repository's prompts.

No model hub is reachable, so the embedded models get a tokenizer trained here, in well under a second, from
the PartiPrompts text in ``datasets/prompts`` (provenance beside it). Its normalizer, pre-tokenizer and
decoder (the pipeline) depend on the model type: transformers' ``AutoTokenizer`` loads some model types'
folders with their own tokenizer class, which keeps only the vocabulary and merges of ``tokenizer.json`` and
imposes its own pipeline. Such a model type is trained under that very pipeline, so that the engine, an
exported folder loaded by ``AutoTokenizer`` and the same folder loaded by ``PreTrainedTokenizerFast`` (what
transformers 4 and vLLM do) give the same ids. Invariants:

* Training is deterministic: the same corpus, vocabulary size and model type give the same vocabulary and
  merges.
* Byte-level: every string encodes (no unknown token). ``decode(encode(s)) == s`` for every string, except
  under the ``qwen2`` pipeline, which normalises to Unicode NFC first: there ``decode(encode(s))`` is
  ``unicodedata.normalize("NFC", s)``, so NFC text (all of the corpus) comes back exactly and
  a decomposed ``"e\\u0301"`` comes back composed.
* Ids ``0`` and ``1`` are ``<|endoftext|>`` (BOS and EOS) and ``<|pad|>``; the vocabulary never exceeds
  the requested size, so it fits any model whose vocabulary is at least that large.
"""

from __future__ import annotations

import csv
from pathlib import Path

from ..errors import MmcacheError

CORPUS = Path(__file__).resolve().parents[2] / "datasets" / "prompts" / "PartiPrompts.tsv"
EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (EOS, PAD)

# transformers' Qwen2Tokenizer (models/qwen2/tokenization_qwen2.py) splits on this before the byte mapping.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


class CorpusMissing(MmcacheError, FileNotFoundError):
    """The tokenizer corpus is not where the repository keeps it (an installed copy without ``datasets/``)."""


def corpus_lines(path: Path = CORPUS) -> list[str]:
    if not path.is_file():
        raise CorpusMissing(f"tokenizer corpus {path} not found; export the model from a repository checkout")
    with path.open(encoding="utf-8", newline="") as f:
        return [row["Prompt"] for row in csv.DictReader(f, delimiter="\t") if row.get("Prompt")]


def _set_pipeline(tok, model_type: str | None) -> None:
    """Give ``tok`` the normalizer, pre-tokenizer and decoder that ``AutoTokenizer`` uses for ``model_type``."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    if model_type == "qwen2":
        # Qwen2Tokenizer rebuilds exactly this around the saved vocabulary and merges, whatever tokenizer.json
        # says, because transformers lists qwen2 among the types whose declared tokenizer class it overrides.
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        # The other embedded types load as the generic fast tokenizer, which keeps tokenizer.json whole.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()


def train_tokenizer(vocab_size: int, path: Path = CORPUS, *, model_type: str | None = None):
    """A ``tokenizers.Tokenizer`` with at most ``vocab_size`` entries, under ``model_type``'s pipeline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"a byte-level vocabulary needs at least {256 + len(SPECIAL_TOKENS)} entries")
    tok = Tokenizer(models.BPE())
    _set_pipeline(tok, model_type)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines(path), trainer=trainer)
    return tok


def hf_tokenizer(vocab_size: int, path: Path = CORPUS, *, model_type: str | None = None):
    """The trained tokenizer wrapped for transformers (saved by ``save_pretrained``, loaded by AutoTokenizer)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(vocab_size, path, model_type=model_type),
                                   bos_token=EOS, eos_token=EOS, pad_token=PAD, model_max_length=1 << 20)
