"""Text-encoder adapters: keys, fingerprints, one forward per unique (text, max length, encoder), bad input, and
the tokenization memo (exactly the tokenizer's output, bounded, following tokenizer changes, no tokenizing on a hit).

Embeddings are compared with the pipelines' own ``encode_prompt`` (diffusers unmodified), so "exactly as the
pipeline tokenizes and truncates" is checked against the real code, not a copy of it.
"""

import copy
import threading
import time

import pytest
import torch

from encoders.diffusion import CachedSD3Pipeline, CachedWanPipeline
from mmcache.presets.diffusion import tiny_sd3_pipeline, tiny_wan_pipeline
from mmcache.presets.local_tokenizers import clip_tokenizer, t5_tokenizer, wan_negative_prompt
from encoders.fingerprint import kernel_implementations, module_fingerprint
from encoders.text_encoders import (T5_MAX_LENGTH, CLIPEncoderAdapter, ForwardCounter, T5EncoderAdapter, T5Recipe,
                                    TokenizationMemo, tokenizer_fingerprint, tokenize)
from mmcache.errors import InvalidRequest, StoreEntryRejected
from mmcache.store import EncoderOutputStore, store_key
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

NEG = wan_negative_prompt()


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(scope="module")
def wan():
    return tiny_wan_pipeline()


@pytest.fixture(scope="module")
def sd3():
    return tiny_sd3_pipeline()


def wan_adapter(pipe):
    return T5EncoderAdapter(pipe.tokenizer, pipe.text_encoder, T5Recipe(attention_mask=True, trim_to_length=True))


def test_local_tokenizers_are_deterministic_and_cover_the_negative_prompt():
    a, b = t5_tokenizer(), t5_tokenizer()
    assert a.get_vocab() == b.get_vocab()
    assert clip_tokenizer().get_vocab() == clip_tokenizer().get_vocab()
    ids = a(NEG).input_ids
    assert a.unk_token_id not in ids and ids[-1] == a.eos_token_id
    assert len(NEG) == 137


def test_fingerprint_follows_weights_recipe_and_seed(wan):
    recipe = {"kind": "t5"}
    fp = module_fingerprint(wan.text_encoder, recipe)
    assert fp == module_fingerprint(tiny_wan_pipeline().text_encoder, recipe)  # same seed, same weights
    assert fp != module_fingerprint(wan.text_encoder, {"kind": "t5", "trim_to_length": True})
    with torch.no_grad():
        w = wan.text_encoder.encoder.final_layer_norm.weight
        w[0] += 1.0
        try:
            assert module_fingerprint(wan.text_encoder, recipe) != fp
        finally:
            w[0] -= 1.0
    assert module_fingerprint(wan.text_encoder, recipe) == fp


def test_attention_implementation_is_part_of_the_fingerprint(sd3):
    # transformers keeps ``_attn_implementation`` out of ``config.to_dict()``, yet sdpa and eager CLIP encoders over
    # the same weights differ in their last bits: they must not share entries (the eager adapter
    # was served the sdpa adapter's hidden states).
    sdpa_model = sd3.text_encoder
    assert sdpa_model.config._attn_implementation == "sdpa"
    eager_model = copy.deepcopy(sdpa_model)
    eager_model.set_attn_implementation("eager")
    store = EncoderOutputStore(1 << 24)
    sdpa, eager = CLIPEncoderAdapter(sd3.tokenizer, sdpa_model), CLIPEncoderAdapter(sd3.tokenizer, eager_model)
    assert sdpa.fingerprint != eager.fingerprint
    first = sdpa.encode("a red fox in the snow", 77, store)
    served = eager.encode("a red fox in the snow", 77, store)
    own = eager.encode("a red fox in the snow", 77, None)
    assert served.key != first.key and not served.hit
    assert all(torch.equal(served.outputs[k], own.outputs[k]) for k in own.outputs)
    # Equal settings over equal weights still share.
    again = CLIPEncoderAdapter(sd3.tokenizer, copy.deepcopy(eager_model))
    assert again.fingerprint == eager.fingerprint
    hit = again.encode("a red fox in the snow", 77, store)
    assert hit.hit and hit.key == served.key
    for lease in (first, served, hit):
        lease.release()
    assert CLIPEncoderAdapter(sd3.tokenizer, sdpa_model).fingerprint == sdpa.fingerprint


def test_fingerprint_holds_nested_attention_implementations_and_the_device_type():
    # Sub-configs are found by walking the config, not by name; a CUDA copy of a module is another encoder.
    from transformers import CLIPConfig, CLIPModel, CLIPTextConfig, CLIPVisionConfig

    def model(vision_attn=None):
        torch.manual_seed(0)
        config = CLIPConfig(text_config=CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                       num_hidden_layers=1, num_attention_heads=2),
                            vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                           num_attention_heads=2, image_size=8, patch_size=4),
                            projection_dim=8)
        m = CLIPModel(config).eval()
        if vision_attn:
            m.set_attn_implementation({"vision_config": vision_attn})
        return m

    base = module_fingerprint(model(), {"kind": "clip"})
    assert module_fingerprint(model(), {"kind": "clip"}) == base
    assert model("eager").config._attn_implementation == "sdpa"  # only the nested config changes
    assert module_fingerprint(model("eager"), {"kind": "clip"}) != base
    if torch.cuda.is_available():
        assert module_fingerprint(model().cuda(), {"kind": "clip"}) != base


def test_fingerprint_holds_the_experts_implementation():
    # Like the attention implementation, transformers keeps a mixture-of-experts model's kernel choice out of the
    # config's JSON, and its kernels round differently.
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    def model(experts=None):
        torch.manual_seed(0)
        m = Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                               moe_intermediate_size=8, shared_expert_intermediate_size=8,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                               num_experts=4, num_experts_per_tok=2)).eval()
        if experts:
            m.set_experts_implementation(experts)
        return m

    base = module_fingerprint(model(), {"kind": "moe"})
    assert module_fingerprint(model(), {"kind": "moe"}) == base
    assert model("eager").config.to_json_string() == model().config.to_json_string()
    assert module_fingerprint(model("eager"), {"kind": "moe"}) != base
    assert kernel_implementations(model("eager").config)[""] == {"attention": "sdpa", "experts": "eager"}


def test_equal_text_at_different_max_lengths_never_collides(wan):
    adapter, store = wan_adapter(wan), EncoderOutputStore(1 << 24)
    with ForwardCounter(wan.text_encoder) as fc:
        leases = [adapter.encode("a red fox", n, store) for n in (16, 32, 16, 32, 64)]
    outputs = store.metrics.kinds["output"]
    assert fc.total == 3 and outputs.entries == 3 and len(store) == 3 + adapter.position_biases.computed
    assert len({lease.key for lease in leases}) == 3 and all(lease.key in store for lease in leases)
    for lease in leases:  # trimmed outputs own exactly their bytes, which is what the store's budget counts
        hidden = lease.outputs["hidden"]
        assert hidden.untyped_storage().nbytes() == hidden.numel() * hidden.element_size()
    row_bytes = wan.text_encoder.config.d_model * 4
    assert outputs.bytes == sum(adapter.tokenize("a red fox", n).length for n in (16, 32, 64)) * row_bytes
    assert store.metrics.kinds["position_bias"].bytes == sum(adapter.position_biases.forward_bytes(n)
                                                             for n in (16, 32, 64))
    assert [lease.hit for lease in leases] == [False, False, True, True, False]
    for lease in leases:
        lease.release()


def test_salt_and_clip_layer_are_part_of_the_key(sd3):
    store = EncoderOutputStore(1 << 24)
    clip = CachedSD3Pipeline(sd3, store).clip[0]
    keys = {clip.encode("a red fox", 77, store, salt=s, hidden_layer=layer).key
            for s in (b"", b"tenant-a") for layer in (-2, -3)}
    assert len(keys) == 4 and len(store) == 4


def test_negative_prompt_key_is_independent_of_the_positive(wan):
    store = EncoderOutputStore(1 << 24)
    wrapper = CachedWanPipeline(wan, store)
    keys = []
    for positive in ("a red fox", "a blue whale", "a green parrot"):
        with wrapper.prepare(positive, NEG, max_sequence_length=64) as call:
            keys.append(call.leases[-1].key)
            assert [lease.hit for lease in call.leases] == [False, len(keys) > 1]
    assert len(set(keys)) == 1


def test_empty_prompt_is_encoded_as_the_pipeline_encodes_it(wan):
    store = EncoderOutputStore(1 << 24)
    wrapper = CachedWanPipeline(wan, store)
    with ForwardCounter(wan.text_encoder) as fc:
        calls = [wrapper.prepare(text, "", max_sequence_length=32) for text in ("", "   ", "\n\t")]
    assert fc.total == 1  # whitespace cleans to "", the same token ids, the same entry: positive and negative
    with torch.no_grad():  # as inside the pipeline's __call__ (autograd mode can pick other kernels)
        expected, expected_neg = wan.encode_prompt("", "", max_sequence_length=32)
    for call in calls:
        assert torch.equal(call.kwargs["prompt_embeds"], expected)
        assert torch.equal(call.kwargs["negative_prompt_embeds"], expected_neg)
        assert int((call.kwargs["prompt_embeds"][0].abs().sum(-1) > 0).sum()) == 1  # only </s>, then zeros
        call.release()


@pytest.mark.parametrize("max_length", [8, 16])
def test_long_prompt_is_truncated_exactly_as_the_pipeline_truncates(wan, max_length):
    adapter, store = wan_adapter(wan), EncoderOutputStore(1 << 24)
    long_a = "a lighthouse on a cliff above a stormy sea at dusk, oil painting, " * 4
    long_b = long_a + "with a tiny red boat far below"  # differs only after the cut
    tokens = adapter.tokenize(long_a, max_length)
    assert tokens.length == max_length and int(tokens.input_ids[-1]) == wan.tokenizer.eos_token_id
    with ForwardCounter(wan.text_encoder) as fc:
        with CachedWanPipeline(wan, store).prepare([long_a, long_b], max_sequence_length=max_length) as call:
            got = call.kwargs["prompt_embeds"]
    assert fc.total == 2  # long_a and long_b share one entry; the "" negative is the other
    with torch.no_grad():
        expected = torch.cat([wan.encode_prompt(t, max_sequence_length=max_length)[0] for t in (long_a, long_b)])
    assert torch.equal(got, expected)


def test_clip_truncates_the_negative_prompt_as_sd3_does(sd3):
    clip = CachedSD3Pipeline(sd3, None).clip[0]
    tokens = clip.tokenize(NEG, sd3.tokenizer_max_length)
    assert len(sd3.tokenizer(NEG).input_ids) > 77 and tokens.length == 77
    with torch.no_grad():
        expected = sd3._get_clip_prompt_embeds(NEG, clip_model_index=0)
    got = clip.encode(NEG, 77)
    assert torch.equal(got.outputs["hidden"][None], expected[0])
    assert torch.equal(got.outputs["pooled"][None], expected[1])


@pytest.mark.parametrize("bad", [
    lambda n, d: {"hidden": torch.zeros(n, d - 1)},                       # wrong width
    lambda n, d: {"hidden": torch.zeros(n + 1, d)},                       # not the prompt's length
    lambda n, d: {"hidden": torch.zeros(n, d, dtype=torch.float16)},      # wrong dtype
    lambda n, d: {"hidden": torch.zeros(1, n, d)},                        # wrong rank
    lambda n, d: {"hidden": torch.zeros(n, d), "extra": torch.zeros(1)},  # undeclared output
    lambda n, d: {"hidden": [[0.0] * d] * n},                             # not a tensor
])
def test_store_refuses_tensors_of_the_wrong_shape_or_dtype(wan, bad):
    adapter, store = wan_adapter(wan), EncoderOutputStore(1 << 24)
    tokens = adapter.tokenize("a red fox", 16)
    key, spec = adapter.key(tokens), adapter.spec(tokens, {}, adapter.dtype)
    store.put(key, {"hidden": torch.zeros(tokens.length, wan.text_encoder.config.d_model)}, spec=spec).release()
    store = EncoderOutputStore(1 << 24)
    with pytest.raises(StoreEntryRejected):
        store.put(key, bad(tokens.length, wan.text_encoder.config.d_model), spec=spec)
    assert len(store) == 0 and store.metrics.bytes == 0
    store.check_invariants()


def test_an_encoder_returning_the_wrong_dtype_is_refused_and_stores_nothing(wan, monkeypatch):
    adapter, store = wan_adapter(wan), EncoderOutputStore(1 << 24)
    real = adapter.forward
    monkeypatch.setattr(adapter, "forward", lambda t, s: {"hidden": real(t, s)["hidden"].double()})
    for target in (store, None):
        with pytest.raises(StoreEntryRejected):
            adapter.encode("a red fox", 16, target)
    # no output stored; the position biases the forward used stay, unheld (they are the model's, not the prompt's)
    assert store.metrics.kind("output").inserts == 0
    assert len(store) == store.metrics.kind("position_bias").entries == adapter.position_biases.computed
    assert all(store.held(key) == 0 for key in store.keys())
    monkeypatch.setattr(adapter, "forward", real)
    with adapter.encode("a red fox", 16, store) as lease:  # the next caller computes afresh
        assert not lease.hit and store.held(lease.key) == 1
    assert store.held(lease.key) == 0


@pytest.mark.parametrize("text,max_length", [(None, 16), (b"bytes", 16), (["a"], 16), ("ok", 0), ("ok", -3),
                                             ("ok", True), ("ok", 2.5), ("a \ud800 b", 16)])
def test_bad_text_input_is_refused(wan, text, max_length):
    with pytest.raises(InvalidRequest):
        wan_adapter(wan).encode(text, max_length)


def test_a_max_length_beyond_the_encoders_limit_is_refused_before_tokenizing(wan, sd3):
    # CLIP's position embeddings stop at 77 (its forward used to raise a bare ValueError); a T5 pads every
    # prompt to max_length, so without a limit a huge one exhausted memory (10**9 was killed at 24 GiB).
    store = EncoderOutputStore(1 << 24)
    clip, t5 = CachedSD3Pipeline(sd3, None).clip[0], wan_adapter(wan)
    assert clip.max_length_limit == 77 and t5.max_length_limit == T5_MAX_LENGTH
    with ForwardCounter(sd3.text_encoder, wan.text_encoder) as fc:
        for adapter, too_long in ((clip, 78), (t5, T5_MAX_LENGTH + 1)):  # not 10**9: a regression would kill CI
            for where in (None, store):
                with pytest.raises(InvalidRequest, match="limit"):
                    adapter.encode("a red fox", too_long, where)
    assert fc.total == 0 and len(store) == 0 and len(t5.memo) == 0
    narrow = T5EncoderAdapter(wan.tokenizer, wan.text_encoder, T5Recipe(True, True), max_length_limit=16)
    with narrow.encode("a red fox", 16, store) as lease:
        assert lease.outputs["hidden"].shape[0] <= 16
    with pytest.raises(InvalidRequest):
        narrow.encode("a red fox", 17, store)
    for bad in (0, True, 2.5):
        with pytest.raises(InvalidRequest, match="max_length_limit"):
            T5EncoderAdapter(wan.tokenizer, wan.text_encoder, T5Recipe(True, True), max_length_limit=bad)


def test_clip_hidden_layer_out_of_range_is_refused(sd3):
    clip = CachedSD3Pipeline(sd3, None).clip[0]
    layers = sd3.text_encoder.config.num_hidden_layers
    for layer in (0, 1, -(layers + 2)):
        with pytest.raises(InvalidRequest):
            clip.encode("a fox", 77, hidden_layer=layer)
    clip.encode("a fox", 77, hidden_layer=-(layers + 1))  # the embedding output is a valid choice


def test_concurrent_requests_for_one_prompt_run_the_encoder_once(wan):
    adapter, store = wan_adapter(wan), EncoderOutputStore(1 << 24)
    barrier, leases = threading.Barrier(4), []

    def worker():
        barrier.wait()
        leases.append(adapter.encode(NEG, 64, store))

    with ForwardCounter(wan.text_encoder) as fc:
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert fc.total == 1 and len(leases) == 4 and sum(lease.hit for lease in leases) == 3
    assert store.held(leases[0].key) == 4
    for lease in leases:
        lease.release()
    assert store.held(leases[0].key) == 0


def test_an_entry_whose_tokens_differ_is_never_used(wan):
    """Forge a collision: another prompt's outputs under this prompt's key. The adapter must not use them."""
    adapter, store = wan_adapter(wan), EncoderOutputStore(1 << 24)
    tokens = adapter.tokenize("a red fox", 16)
    other = adapter.tokenize("a blue whale", 16)
    forged = adapter.forward(other, {})
    store.put(adapter.key(tokens), forged, {"tokens": other.token_bytes()}).release()
    with adapter.encode("a red fox", 16, store) as lease:
        assert lease.bypassed and not lease.hit
        assert torch.equal(lease.outputs["hidden"], adapter.forward(tokens, {})["hidden"])
    assert store.held(adapter.key(tokens)) == 0


def direct(tokenizer, text, max_length):
    """The pipelines' own tokenizer call, written out here so the memo is checked against the tokenizer itself."""
    enc = tokenizer(text, padding="max_length", max_length=max_length, truncation=True, add_special_tokens=True,
                    return_attention_mask=True, return_tensors="pt")
    return enc.input_ids[0], enc.attention_mask[0]


def same_as_tokenizer(memo, text, max_length):
    tokens = memo(text, max_length)
    ids, mask = direct(memo.tokenizer, text, max_length)
    return (torch.equal(tokens.input_ids, ids) and torch.equal(tokens.attention_mask, mask)
            and tokens.input_ids.dtype == ids.dtype and tokens.attention_mask.dtype == mask.dtype
            and tokens.max_length == max_length)


LONG = "a lighthouse on a cliff above a stormy sea at dusk, oil painting, " * 6


@pytest.mark.parametrize("make", [t5_tokenizer, clip_tokenizer])
def test_memo_returns_exactly_what_the_tokenizer_returns(make):
    memo = TokenizationMemo(make())
    cases = [("a red fox", 16), ("a red fox", 77), ("", 16), ("   ", 8), (LONG, 16), (LONG, 77), (NEG, 77),
             (NEG, 512)]
    for text, max_length in cases:
        assert same_as_tokenizer(memo, text, max_length)  # a miss
    assert memo.misses == len(cases) and memo.hits == 0 and len(memo) == len(cases)
    for text, max_length in cases:
        assert memo(text, max_length) is memo(text, max_length)
        assert same_as_tokenizer(memo, text, max_length)  # a hit
    assert memo.misses == len(cases) and memo.hits == 3 * len(cases)
    truncated = memo(LONG, 16)
    assert truncated.length == 16 and int(truncated.input_ids[-1]) == memo.tokenizer.eos_token_id
    assert memo("", 16).length == (1 if make is t5_tokenizer else 2)  # only the special tokens


def test_memo_is_a_bounded_lru():
    memo = TokenizationMemo(t5_tokenizer(), entries=3, max_text_chars=40)
    for text in ("a", "b", "c"):
        memo(text, 8)
    memo("a", 8)  # "a" is now the most recent; "b" the least
    memo("d", 8)
    assert len(memo) == 3 and (memo.hits, memo.misses) == (1, 4)
    memo("b", 8)  # evicted: tokenized again
    assert (memo.hits, memo.misses) == (1, 5) and len(memo) == 3
    memo("a", 8)
    assert memo.hits == 2
    memo("x" * 41, 8)  # too long to keep: tokenized, not stored
    assert len(memo) == 3 and memo.misses == 5 and same_as_tokenizer(memo, "x" * 41, 8)
    off = TokenizationMemo(t5_tokenizer(), entries=0)
    assert same_as_tokenizer(off, "a red fox", 8) and len(off) == 0

    class NoFastBackend:  # a tokenizer whose content cannot be fingerprinted is never memoized
        def __call__(self, *args, **kwargs):
            return off.tokenizer(*args, **kwargs)

    slow = TokenizationMemo(NoFastBackend())
    assert slow.fingerprint() is None
    assert same_as_tokenizer(slow, "a red fox", 8) and same_as_tokenizer(slow, "a red fox", 8) and len(slow) == 0
    for bad in (-1, 2.0, True, None):
        with pytest.raises(InvalidRequest):
            TokenizationMemo(off.tokenizer, entries=bad)
        with pytest.raises(InvalidRequest):
            TokenizationMemo(off.tokenizer, max_text_chars=bad)


def test_memo_is_bounded_in_bytes_too():
    # An entry costs 21 bytes per token of max length plus 4 per character: 21 * 64 + 4 = 1348 bytes here.
    memo = TokenizationMemo(t5_tokenizer(), max_bytes=3 * 1348)
    for text in "abcde":
        memo(text, 64)
    assert len(memo) == 3 and memo.bytes == 3 * 1348
    memo("c", 64)  # still held: the three most recent are c, d, e
    assert memo.hits == 1
    memo("a", 128)  # 2692 bytes: two older entries go
    assert len(memo) == 2 and memo.bytes == 1348 + 2692 and memo.bytes <= memo.max_bytes
    assert same_as_tokenizer(memo, "x", 256) and len(memo) == 2  # 5380 bytes alone: never kept
    with pytest.raises(InvalidRequest):
        TokenizationMemo(memo.tokenizer, max_bytes=-1)


def test_memo_keys_max_length_and_refuses_bad_input():
    memo = TokenizationMemo(t5_tokenizer())
    assert not torch.equal(memo("a red fox", 8).input_ids[:4], memo("a red fox", 4).input_ids)
    assert len(memo) == 2
    for text, max_length in [(None, 8), (b"a", 8), (["a"], 8), ("a", 0), ("a", True), ("a", 2.5)]:
        with pytest.raises(InvalidRequest):
            memo(text, max_length)
    assert len(memo) == 2


def test_memo_follows_the_tokenizer_when_its_api_changes_it():
    tokenizer = t5_tokenizer()
    memo = TokenizationMemo(tokenizer)
    text = "a <cat-toy> on a hill"
    before = memo(text, 16)
    fingerprint = memo.fingerprint()
    tokenizer.add_tokens(["<cat-toy>"])  # textual inversion adds a token: the ids change
    assert same_as_tokenizer(memo, text, 16)
    assert not torch.equal(memo(text, 16).input_ids, before.input_ids)
    assert memo.fingerprint() != fingerprint
    tokenizer.padding_side = "left"
    assert same_as_tokenizer(memo, text, 16) and int(memo(text, 16).attention_mask[0]) == 0
    tokenizer.truncation_side = "left"
    assert same_as_tokenizer(memo, LONG, 16) and int(memo(LONG, 16).input_ids[-1]) == tokenizer.eos_token_id
    tokenizer.add_eos_token = False
    assert same_as_tokenizer(memo, text, 16)
    assert tokenizer.eos_token_id not in memo(text, 16).input_ids.tolist()
    assert tokenizer_fingerprint(t5_tokenizer()) == tokenizer_fingerprint(t5_tokenizer())
    assert tokenizer_fingerprint(t5_tokenizer()) != tokenizer_fingerprint(clip_tokenizer())


@pytest.fixture
def tokenizer_calls(monkeypatch):
    """Counts every tokenizer call (all tokenizer classes share ``PreTrainedTokenizerBase.__call__``)."""
    calls = []
    real = PreTrainedTokenizerBase.__call__

    def counting(self, *args, **kwargs):
        calls.append(args[0] if args else kwargs.get("text"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", counting)
    return calls


def test_a_store_hit_does_not_tokenize_and_keeps_the_key(wan, tokenizer_calls):
    adapter, store = wan_adapter(wan), EncoderOutputStore(1 << 24)
    texts = ["a red fox", NEG, "a red fox", NEG, "", "a red fox", ""]
    with ForwardCounter(wan.text_encoder) as fc:
        leases = [adapter.encode(text, 64, store) for text in texts]
    assert fc.total == 3 and tokenizer_calls == ["a red fox", NEG, ""]
    assert [lease.hit for lease in leases] == [False, False, True, True, False, True, True]
    del tokenizer_calls[:]
    for text, lease in zip(texts, leases):
        assert lease.key == store_key(adapter.fingerprint, adapter.tokenize(text, 64).digest({}), b"")
        assert lease.meta["tokens"] == adapter.tokenize(text, 64).token_bytes()
        lease.release()
    with ForwardCounter(wan.text_encoder) as fc:  # store off: every prompt tokenized and encoded
        del tokenizer_calls[:]
        for text in texts:
            adapter.encode(text, 64).release()
    assert fc.total == len(texts) and len(tokenizer_calls) == len(texts)


def test_a_max_length_too_short_for_the_special_tokens_is_refused(wan, sd3):
    # CLIP adds two special tokens and cannot truncate below them: the tokenizer answered max_length 1 with the
    # whole prompt, which surfaced as a misleading StoreEntryRejected, or for a long prompt as a bare
    # ValueError from the model's position embeddings.
    store = EncoderOutputStore(1 << 24)
    clip = CachedSD3Pipeline(sd3, None).clip[0]
    assert clip.tokenizer.num_special_tokens_to_add() == 2
    with ForwardCounter(sd3.text_encoder) as fc:
        for text in ("a red fox", "hello world " * 100, ""):
            for where in (None, store):
                with pytest.raises(InvalidRequest, match="special tokens"):
                    clip.encode(text, 1, where)
            with pytest.raises(InvalidRequest, match="special tokens"):
                clip.tokenize(text, 1)
    assert fc.total == 0 and len(store) == 0 and len(clip.memo) == 0
    store.check_invariants()
    with clip.encode("hello world " * 100, 2, store) as lease:  # room for exactly <bos> <eos>
        assert lease.outputs["hidden"].shape[0] == 2
    t5 = wan_adapter(wan)  # T5 adds one </s>: max_length 1 is that token alone, as the pipeline encodes it
    with t5.encode("hello world " * 100, 1, store) as lease:
        assert lease.meta["length"] == 1 and t5.tokenize("x", 1).input_ids.tolist() == [wan.tokenizer.eos_token_id]
    assert store.held(lease.key) == 0


def test_selectors_stores_and_keys_the_adapter_does_not_use_are_refused(wan, sd3):
    store = EncoderOutputStore(1 << 24)
    t5, clip = wan_adapter(wan), CachedSD3Pipeline(sd3, None).clip[0]
    tokens = t5.tokenize("a red fox", 16)
    with ForwardCounter(wan.text_encoder, sd3.text_encoder) as fc:
        with pytest.raises(InvalidRequest, match="hidden_layer"):  # T5 reads no selector: it would only split keys
            t5.encode("a red fox", 16, store, hidden_layer="x")
        with pytest.raises(InvalidRequest, match="foo"):
            clip.encode("a red fox", 16, store, foo=1)
        for bad in ("x", {}, 5):
            with pytest.raises(InvalidRequest, match="EncoderOutputStore"):
                t5.encode("a red fox", 16, bad)
    assert fc.total == 0 and len(store) == 0
    for selector in ([1, 2], "hidden_layer", {"hidden_layer": -2}):
        with pytest.raises(InvalidRequest):
            t5.key(tokens, selector)
    for bad in ("a red fox", None, tokens.input_ids):
        with pytest.raises(InvalidRequest, match="TokenizedPrompt"):
            t5.key(bad)
    clip_tokens = clip.tokenize("a red fox", 16)
    for layer in (5, 0, "x", True):
        with pytest.raises(InvalidRequest, match="hidden_layer"):
            clip.key(clip_tokens, {"hidden_layer": layer})
    # valid keys are what they were
    assert t5.key(tokens) == t5.key(tokens, {}) == t5.key(tokens, None) == store_key(t5.fingerprint,
                                                                                    tokens.digest({}), b"")
    with clip.encode("a red fox", 16, store) as lease:
        assert lease.key == clip.key(clip_tokens, {"hidden_layer": -2})
        assert lease.key == store_key(clip.fingerprint, clip_tokens.digest({"hidden_layer": -2}), b"")
    store.check_invariants()


def test_adapters_refuse_missing_or_wrong_parts(wan, sd3):
    recipe = T5Recipe(attention_mask=True, trim_to_length=True)
    bad_builds = [
        lambda: CLIPEncoderAdapter(None, sd3.text_encoder),
        lambda: CLIPEncoderAdapter(sd3.tokenizer, None),
        lambda: CLIPEncoderAdapter(sd3.tokenizer, wan.text_encoder),  # a T5 has no CLIP position limit
        lambda: T5EncoderAdapter(None, wan.text_encoder, recipe),
        lambda: T5EncoderAdapter(wan.tokenizer, None, recipe),
        lambda: T5EncoderAdapter(wan.tokenizer, wan.text_encoder, None),
        lambda: T5EncoderAdapter(wan.tokenizer, wan.text_encoder, {"attention_mask": True, "trim_to_length": True}),
        lambda: T5Recipe(1, 0),
        lambda: T5Recipe("yes", True),
        lambda: TokenizationMemo(None),
        lambda: ForwardCounter(wan.text_encoder, None),
        lambda: module_fingerprint(None, {}),
        lambda: module_fingerprint(wan.text_encoder, ["kind", "t5"]),
    ]
    for build in bad_builds:
        with pytest.raises(InvalidRequest):
            build()
    narrow = T5EncoderAdapter(wan.tokenizer, wan.text_encoder, recipe, max_length_limit=16)
    with pytest.raises(InvalidRequest, match="limit"):  # tokenize pads to max_length: the limit applies to it too
        narrow.tokenize("a red fox", 17)
    assert narrow.tokenize("a red fox", 16).max_length == 16


def test_calls_on_one_tokenizer_object_never_overlap():
    # A fast tokenizer sets its shared backend's padding and truncation, then encodes: overlapping calls with
    # other max lengths read each other's settings. Calls through the adapters' tokenize are serialised.
    real = t5_tokenizer()
    inside, most = [0], [0]
    guard = threading.Lock()

    class Watched:
        backend_tokenizer = None  # not memoized: every call reaches the tokenizer

        def __call__(self, *args, **kwargs):
            with guard:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.02)
            try:
                return real(*args, **kwargs)
            finally:
                with guard:
                    inside[0] -= 1

    watched = Watched()
    results = {}

    def work(n):
        results[n] = [tokenize(watched, "a red fox in the snow", length) for length in (8, 32, 8, 32)]

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1 and len(results) == 4
    want = [tokenize(real, "a red fox in the snow", length).input_ids for length in (8, 32, 8, 32)]
    assert all(torch.equal(got.input_ids, w) for r in results.values() for got, w in zip(r, want))
