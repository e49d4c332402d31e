"""Tokenizers built locally, in well under a second, from the repository's prompt files (no model hub).

Two families, each in the transformers class the real pipelines load, so tokenization, padding, truncation and
special tokens run the same code as with the published vocabularies:

* ``t5_tokenizer``: a Unigram vocabulary in ``transformers.T5Tokenizer`` (``<pad>`` = 0, ``</s>`` = 1,
  ``<unk>`` = 2, ``</s>`` appended to every sequence), the layout of the T5 and umT5 tokenizers.
* ``clip_tokenizer``: a byte-level BPE with ``</w>`` word ends in ``transformers.CLIPTokenizer``
  (``<|startoftext|>`` ... ``<|endoftext|>``, padded with ``<|endoftext|>``).

Invariants: building is deterministic (the same corpus and size give the same vocabulary and ids in every
process). The ``tokenizers`` trainers are not (their tie-breaking follows hash-map order), so the vocabularies
are built here: the Unigram pieces are every corpus character plus the substrings ranked by frequency x length
(SentencePiece's seed rule), scored by log frequency; the BPE merges are learned greedily, most frequent pair
first, ties broken by the pair's text. Every corpus character is a piece, so the Wan negative prompt's Chinese
text never maps to ``<unk>``.
"""

from __future__ import annotations

import csv
import heapq
import json
import math
from collections import Counter, defaultdict
from pathlib import Path

from tokenizers import Regex, normalizers, pre_tokenizers

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "datasets" / "prompts"

# CLIP's pre-tokenizer pattern (special tokens, English contractions, letter runs, single digits, punctuation).
_CLIP_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
_MAX_PIECE = 10  # longest Unigram piece, in characters


def parti_prompts(prompts_dir: Path = PROMPTS_DIR) -> list[str]:
    """The 1,632 PartiPrompts, in file order."""
    with open(prompts_dir / "PartiPrompts.tsv", newline="", encoding="utf-8") as f:
        return [row["Prompt"] for row in csv.DictReader(f, delimiter="\t")]


def wan_negative_prompt(prompts_dir: Path = PROMPTS_DIR) -> str:
    """Wan's default negative prompt (``sample_neg_prompt``, identical in Wan2.1 and Wan2.2)."""
    with open(prompts_dir / "wan_prompts.json", encoding="utf-8") as f:
        return json.load(f)["Wan2.1"]["sample_neg_prompt"]


def wan_example_prompts(prompts_dir: Path = PROMPTS_DIR) -> list[str]:
    with open(prompts_dir / "wan_prompts.json", encoding="utf-8") as f:
        data = json.load(f)
    return [task["prompt"] for version in data.values() for task in version["example_prompts"].values()]


def training_corpus(prompts_dir: Path = PROMPTS_DIR) -> list[str]:
    return parti_prompts(prompts_dir) + wan_example_prompts(prompts_dir) + [wan_negative_prompt(prompts_dir)]


def _word_counts(corpus: list[str], pre_tokenizer, normalizer=None) -> Counter:
    words: Counter = Counter()
    for text in corpus:
        if normalizer is not None:
            text = normalizer.normalize_str(text)
        words.update(w for w, _ in pre_tokenizer.pre_tokenize_str(text))
    return words


def _unigram_vocab(words: Counter, size: int) -> list[tuple[str, float]]:
    chars: Counter = Counter()
    subs: Counter = Counter()
    for w, n in words.items():
        for i in range(len(w)):
            chars[w[i]] += n
            for j in range(i + 2, min(len(w), i + _MAX_PIECE) + 1):
                subs[w[i:j]] += n
    pieces = dict(chars)
    for piece, n in sorted(subs.items(), key=lambda kv: (-kv[1] * len(kv[0]), kv[0])):
        if len(pieces) >= size:
            break
        pieces[piece] = n
    total = sum(pieces.values())
    scored = sorted(((p, math.log(n / total)) for p, n in pieces.items()), key=lambda ps: (-ps[1], ps[0]))
    return [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + scored


def _bpe_merges(words: Counter, n_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE: merge the most frequent adjacent pair (ties: smallest pair text), updating counts in place."""
    seqs = [list(w[:-1]) + [w[-1] + "</w>"] for w in words]
    freq = list(words.values())
    pair_count: Counter = Counter()
    where: defaultdict = defaultdict(set)
    for i, s in enumerate(seqs):
        for pair in zip(s, s[1:]):
            pair_count[pair] += freq[i]
            where[pair].add(i)
    heap = [(-n, pair) for pair, n in pair_count.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while heap and len(merges) < n_merges:
        neg, best = heapq.heappop(heap)
        if pair_count.get(best, 0) != -neg or neg == 0:
            continue  # a stale heap entry; the live count was pushed again when it changed
        merges.append(best)
        for pair in _merge_everywhere(best, seqs, freq, pair_count, where):
            if pair_count[pair] > 0:
                heapq.heappush(heap, (-pair_count[pair], pair))
            else:
                del pair_count[pair]
    return merges


def _merge_everywhere(best: tuple[str, str], seqs: list[list[str]], freq: list[int], pair_count: Counter,
                      where: defaultdict) -> set:
    """Joins ``best`` in every word holding it, updating ``seqs``, ``pair_count`` and ``where`` in place; returns
    the pairs whose counts changed."""
    joined = best[0] + best[1]
    changed: set = set()
    for i in sorted(where.pop(best)):
        s = seqs[i]
        for pair in zip(s, s[1:]):
            pair_count[pair] -= freq[i]
            changed.add(pair)
        out, k = [], 0
        while k < len(s):
            if k + 1 < len(s) and (s[k], s[k + 1]) == best:
                out.append(joined)
                k += 2
            else:
                out.append(s[k])
                k += 1
        seqs[i] = out
        for pair in zip(out, out[1:]):
            pair_count[pair] += freq[i]
            where[pair].add(i)
            changed.add(pair)
    return changed


def t5_tokenizer(vocab_size: int = 2000, model_max_length: int = 512, prompts_dir: Path = PROMPTS_DIR):
    """A ``T5Tokenizer`` over a Unigram vocabulary built from the prompt corpus."""
    from transformers import T5Tokenizer

    # The pre-tokenizer T5Tokenizer installs, so the pieces are cut from the words it will look up.
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])
    vocab = _unigram_vocab(_word_counts(training_corpus(prompts_dir), pre), vocab_size - 3)
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def clip_tokenizer(vocab_size: int = 2000, model_max_length: int = 77, prompts_dir: Path = PROMPTS_DIR):
    """A ``CLIPTokenizer`` over a byte-level BPE learned from the prompt corpus."""
    from transformers import CLIPTokenizer

    # The normalizer and pre-tokenizer CLIPTokenizer installs.
    norm = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_CLIP_SPLIT), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    base = alphabet + [c + "</w>" for c in alphabet]  # CLIP's layout: 256 bytes, then 256 word-final bytes
    merges = _bpe_merges(_word_counts(training_corpus(prompts_dir), pre, norm), vocab_size - len(base) - 2)
    tokens = base + [a + b for a, b in merges] + ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)
