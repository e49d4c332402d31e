"""A locally built tokenizer for the embedded models: byte-level BPE trained on the repository's prompts.

No model hub is reachable, so the embedded models get a tokenizer trained here, in well under a second, from
the PartiPrompts text in ``datasets/prompts`` (provenance beside it). Invariants:

* Training is deterministic: the same corpus and vocabulary size give the same vocabulary and merges.
* Byte-level: every string encodes (no unknown token) and ``decode(encode(s)) == s``.
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


class CorpusMissing(MmcacheError, FileNotFoundError):
    """The tokenizer corpus is not where the repository keeps it (an installed copy without ``datasets/``)."""


def corpus_lines(path: Path = CORPUS) -> list[str]:
    if not path.is_file():
        raise CorpusMissing(f"tokenizer corpus {path} not found; export the model from a repository checkout")
    with path.open(encoding="utf-8", newline="") as f:
        return [row["Prompt"] for row in csv.DictReader(f, delimiter="\t") if row.get("Prompt")]


def train_tokenizer(vocab_size: int, path: Path = CORPUS):
    """A ``tokenizers.Tokenizer`` with at most ``vocab_size`` entries."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"a byte-level vocabulary needs at least {256 + len(SPECIAL_TOKENS)} entries")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_lines(path), trainer=trainer)
    return tok


def hf_tokenizer(vocab_size: int, path: Path = CORPUS):
    """The trained tokenizer wrapped for transformers (saved by ``save_pretrained``, loaded by AutoTokenizer)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(vocab_size, path), bos_token=EOS,
                                   eos_token=EOS, pad_token=PAD, model_max_length=1 << 20)
