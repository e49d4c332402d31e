"""The sampler draws from the distribution that temperature, top-k and top-p define, cheaply."""

import math

import pytest
import torch

from mmcache.engine import SamplingParams
from mmcache.engine.sampling import _nucleus, sample


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution by its definition: a full sort of the vocabulary."""
    x = logits.double() / temperature
    if 0 < top_k < len(x):
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], float("-inf"))
    p = torch.softmax(x, dim=0)
    if top_p < 1.0:
        sp, order = torch.sort(p, descending=True)
        drop = (torch.cumsum(sp, dim=0) - sp) >= top_p
        p = p.index_fill(0, order[drop], 0.0)
    return p / p.sum()


@pytest.mark.parametrize("kw", [{}, {"top_k": 3}, {"top_p": 0.7}, {"top_k": 4, "top_p": 0.8},
                                {"temperature": 0.5}, {"temperature": 2.0, "top_p": 0.95}])
def test_draws_follow_the_defined_distribution(kw):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0, float("-inf")])
    sp = SamplingParams(**{"temperature": 1.0, **kw})
    want = reference_probs(logits, sp.temperature, sp.top_k, sp.top_p)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.bincount(torch.tensor([sample(logits, sp, gen) for _ in range(n)]), minlength=len(logits))
    assert (want[counts > 0] > 0).all() and (counts[want > 1e-3] > 0).all()  # never a masked token
    sigma = torch.sqrt(n * want * (1 - want))
    assert ((counts - n * want).abs() <= 5 * sigma + 1).all(), (counts.tolist(), (n * want).tolist())


@pytest.mark.parametrize("vocab,top_k,top_p,scale", [(50, 0, 0.9, 3.0), (5000, 0, 0.95, 0.1),
                                                     (5000, 3000, 0.9, 0.01), (5000, 0, 0.5, 8.0),
                                                     (70000, 0, 0.99, 0.05), (300, 300, 0.999, 1.0)])
def test_the_nucleus_is_what_a_full_sort_keeps(vocab, top_k, top_p, scale):
    gen = torch.Generator().manual_seed(vocab + top_k)
    logits = torch.randn(vocab, generator=gen) * scale
    k = top_k if 0 < top_k < vocab else vocab
    values, ids = _nucleus(logits, k, top_p)
    want = reference_probs(logits, 1.0, top_k, top_p)
    assert set(ids.tolist()) == set(torch.nonzero(want).flatten().tolist())
    assert torch.equal(values, logits[ids])
    if scale <= 0.1:
        assert len(ids) > 256  # flat logits: the search grew past its first candidates


def test_a_request_seed_fixes_its_draws_and_top_k_1_is_greedy():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    sp = SamplingParams(temperature=0.9, top_p=0.9)
    draws = [[sample(logits, sp, torch.Generator().manual_seed(s)) for _ in range(5)] for s in (3, 3, 4)]
    assert draws[0] == draws[1] != draws[2]
    gen = torch.Generator().manual_seed(0)
    assert {sample(logits, SamplingParams(temperature=1.5, top_k=1), gen) for _ in range(20)} == {
        int(torch.argmax(logits))}


@pytest.mark.parametrize("kw", [{}, {"top_k": 5}, {"top_p": 0.5}, {"top_k": 5, "top_p": 0.9}])
@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-12])
def test_a_vanishing_temperature_draws_the_maximum_never_nan(temperature, kw):
    # Divided first, logits over a tiny temperature overflowed float32 to inf (30 / 1e-38 = 3e39, 2 / 1e-45 =
    # 1.4e45), inf - inf made the weights NaN, and the draw fell on the last token of the vocabulary.
    logits = torch.linspace(-30.0, 2.0, 600)[torch.randperm(600, generator=torch.Generator().manual_seed(1))]
    gen = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=temperature, **kw)
    assert {sample(logits, sp, gen) for _ in range(50)} == {int(torch.argmax(logits))}
    tied = torch.tensor([1.0, 30.0, -4.0, 30.0, float("-inf")])  # in the limit the tied maxima share the draw
    assert {sample(tied, SamplingParams(temperature=temperature), gen) for _ in range(200)} == {1, 3}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_raise_under_random_sampling(bad):
    logits = torch.zeros(10)
    logits[3] = bad
    with pytest.raises(RuntimeError, match="NaN or no finite maximum"):
        sample(logits, SamplingParams(temperature=1.0), torch.Generator())
    with pytest.raises(RuntimeError):
        sample(torch.full((10,), float("-inf")), SamplingParams(temperature=1.0, top_p=0.5), torch.Generator())
    if not math.isnan(bad):
        assert sample(logits, SamplingParams(temperature=0.0), None) == 3  # greedy takes the argmax as it is


def test_bf16_logits_are_sampled_in_float32():
    logits = torch.tensor([0.0, 0.0, 5.0], dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(logits, SamplingParams(temperature=1.0), gen)
                                          for _ in range(2000)]), minlength=3)
    assert counts[2] > 1900 and counts[:2].sum() > 0


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
def test_the_binned_nucleus_keeps_as_many_tied_tokens_as_a_sort(top_p):
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(20000, generator=gen) * 0.05).to(torch.bfloat16).float()  # few distinct values: ties
    logits[:50] = float("-inf")  # masked tokens: probability 0, never kept
    values, ids = _nucleus(logits, logits.numel(), top_p)
    want = reference_probs(logits, 1.0, 0, top_p)
    assert len(ids) == int((want > 0).sum()) > 4096  # the binned path
    assert sorted(values.tolist()) == sorted(logits[want > 0].tolist())  # the same values, ties included
    assert not (ids < 50).any()


def test_a_nucleus_of_equal_logits_among_masked_ones():
    logits = torch.full((10000,), float("-inf"))
    logits[[3, 500, 7000]] = 1.0
    values, ids = _nucleus(logits, logits.numel(), 0.5)
    assert len(ids) == 2 and set(ids.tolist()) <= {3, 500, 7000}  # 1/3 + 1/3 covers 0.5
    gen = torch.Generator().manual_seed(0)
    assert {sample(logits, SamplingParams(temperature=1.0, top_p=0.99), gen) for _ in range(200)} == {3, 500, 7000}
    flat = torch.zeros(10000)
    flat[:100] = float("-inf")
    values, ids = _nucleus(flat, flat.numel(), 0.505)  # the binned path with one distinct finite value
    assert len(ids) == 5000 and not (ids < 100).any()  # token j is kept while (j - 1) / 9900 < 0.505


def test_a_draw_at_the_top_of_the_unit_interval_skips_trailing_zero_weights(monkeypatch):
    from mmcache.engine import sampling

    monkeypatch.setattr(sampling.torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert sampling._draw(torch.tensor([0.5, 0.0, 0.5, 0.0, 0.0]), None) == 2
