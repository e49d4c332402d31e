"""T5-family relative position biases served from the store: bit-identical outputs, one computation per
(layer, length), entries held only during the forward, the model left as found, and the fall-backs."""

import copy
import threading

import pytest
import torch

from encoders.diffusion import CachedSD3Pipeline, CachedWanPipeline
from mmcache.presets.diffusion import tiny_sd3_pipeline, tiny_wan_pipeline
from encoders.position_bias import BUDGET_SHARE, PositionBiases, bias_owners
from encoders.text_encoders import T5EncoderAdapter, T5Recipe
from mmcache.errors import InvalidRequest
from mmcache.store import EncoderOutputStore

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(scope="module")
def umt5():
    return tiny_wan_pipeline().text_encoder  # UMT5EncoderModel: a bias table in every layer


@pytest.fixture(scope="module")
def t5():
    return tiny_sd3_pipeline().text_encoder_3  # T5EncoderModel: layer 0's table, its bias handed down


def inputs(model, length: int, real: int):
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    mask = torch.zeros(1, length, dtype=torch.long)
    mask[:, :real] = 1
    return ids, mask


def run(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask).last_hidden_state


def served(model, store, ids, mask, fingerprint="fp", salt=b""):
    with PositionBiases(model).serving(store, fingerprint, salt, ids.shape[1]) as serving:
        return run(model, ids, mask), serving


def test_the_bias_owners_are_every_umt5_layer_and_t5s_first(umt5, t5):
    assert [path for path, _ in bias_owners(umt5)] == [
        f"encoder.block.{i}.layer.0.SelfAttention" for i in range(umt5.config.num_layers)]
    assert [path for path, _ in bias_owners(t5)] == ["encoder.block.0.layer.0.SelfAttention"]


@pytest.mark.parametrize("length,real", [(64, 9), (512, 40), (33, 33)])
def test_served_outputs_equal_the_models_own_bit_for_bit(umt5, t5, length, real):
    for model in (umt5, t5):
        store = EncoderOutputStore(1 << 26)
        ids, mask = inputs(model, length, real)
        ref = run(model, ids, mask)
        first, serving = served(model, store, ids, mask)
        again, _ = served(model, store, ids, mask)  # every bias from the store now
        assert serving and torch.equal(first, ref) and torch.equal(again, ref)
        owners = len(bias_owners(model))
        assert store.metrics.computes == owners and len(store) == owners and store.metrics.hits == owners
        other_ids, other_mask = inputs(model, length, max(1, real // 2))  # another prompt, same length: hits
        assert torch.equal(served(model, store, other_ids, other_mask)[0], run(model, other_ids, other_mask))
        assert store.metrics.computes == owners
        store.check_invariants()


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_both_attention_kernels_give_the_models_own_bits(kernel):
    model = tiny_wan_pipeline().text_encoder  # a fresh model: the kernel is switched on it
    model.set_attn_implementation(kernel)
    assert model.config._attn_implementation == kernel
    store = EncoderOutputStore(1 << 26)
    for real in (40, 12):
        ids, mask = inputs(model, 512, real)
        assert torch.equal(served(model, store, ids, mask)[0], run(model, ids, mask))
    assert store.metrics.computes == model.config.num_layers


def test_t5_without_a_mask_as_sd3_runs_it(t5):
    store = EncoderOutputStore(1 << 26)
    ids, _ = inputs(t5, 256, 256)
    with torch.no_grad():
        ref = t5(ids)[0]
        for _ in range(2):
            with PositionBiases(t5).serving(store, "fp", b"", 256):
                assert torch.equal(t5(ids)[0], ref)
    assert store.metrics.computes == 1


def test_each_length_salt_and_fingerprint_has_its_own_entries(umt5):
    store, owners = EncoderOutputStore(1 << 26), len(bias_owners(umt5))
    for length, salt, fingerprint in ((64, b"", "a"), (32, b"", "a"), (64, b"tenant", "a"), (64, b"", "b")):
        ids, mask = inputs(umt5, length, 5)
        served(umt5, store, ids, mask, fingerprint, salt)
    assert store.metrics.computes == 4 * owners and len(store) == 4 * owners


def test_entries_are_held_during_the_forward_and_released_after(umt5):
    store = EncoderOutputStore(1 << 26)
    ids, mask = inputs(umt5, 64, 7)
    seen = []
    last = umt5.encoder.block[-1]
    hook = last.register_forward_pre_hook(lambda *_: seen.append(sorted(store.held(k) for k in store.keys())))
    try:
        served(umt5, store, ids, mask)
    finally:
        hook.remove()
    # before the last layer runs, every earlier layer's bias is held once; the last one's is not taken yet
    assert seen == [[1] * (umt5.config.num_layers - 1)]
    assert all(store.held(k) == 0 for k in store.keys())


def test_a_failing_forward_releases_its_biases_and_leaves_the_model_as_found(umt5):
    store = EncoderOutputStore(1 << 26)
    ids, mask = inputs(umt5, 64, 7)

    def fail(*_):
        raise RuntimeError("boom")

    hook = umt5.encoder.block[-1].register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            served(umt5, store, ids, mask)
    finally:
        hook.remove()
    assert len(store) == umt5.config.num_layers - 1 and all(store.held(k) == 0 for k in store.keys())
    assert all("compute_bias" not in m.__dict__ for _, m in bias_owners(umt5))
    store.check_invariants()


def test_the_model_is_left_as_found_and_can_be_copied(umt5):
    _, module = bias_owners(umt5)[0]
    own = module.__dict__.get("compute_bias")
    store = EncoderOutputStore(1 << 26)
    served(umt5, store, *inputs(umt5, 16, 3))
    assert module.__dict__.get("compute_bias") is own is None
    copy.deepcopy(umt5)  # a dispatch left behind (it holds a thread-local) would make this raise


def test_a_callers_own_instance_attribute_is_put_back(umt5):
    _, module = bias_owners(umt5)[0]
    calls = []

    def mine(query_length, key_length, device=None, past_seen_tokens=0):
        calls.append(query_length)
        return type(module).compute_bias(module, query_length, key_length, device, past_seen_tokens)

    module.compute_bias = mine
    try:
        store = EncoderOutputStore(1 << 26)
        ids, mask = inputs(umt5, 16, 3)
        ref = run(umt5, ids, mask)
        out, _ = served(umt5, store, ids, mask)
        assert torch.equal(out, ref) and calls == [16, 16]  # the reference forward, then the first store fill
        served(umt5, store, ids, mask)
        assert calls == [16, 16]  # served from the store
        assert module.__dict__["compute_bias"] is mine
    finally:
        del module.compute_bias


def test_other_threads_and_decoder_steps_run_the_models_own_code(umt5):
    _, module = bias_owners(umt5)[0]
    store = EncoderOutputStore(1 << 26)
    got = {}
    with PositionBiases(umt5).serving(store, "fp", b"", 16):
        thread = threading.Thread(target=lambda: got.update(other=module.compute_bias(16, 16)))
        thread.start()
        thread.join()
        got["cached_step"] = module.compute_bias(1, 17, None, 16)
        got["tensor_step"] = module.compute_bias(16, 16, None, torch.tensor(0))
        assert store.metrics.lookups == 0
        got["mine"] = module.compute_bias(16, 16)
        assert store.metrics.lookups == 1
    own = type(module).compute_bias
    assert torch.equal(got["other"], own(module, 16, 16)) and torch.equal(got["mine"], got["other"])
    assert torch.equal(got["cached_step"], own(module, 1, 17, None, 16))


def test_concurrent_servings_of_one_model_each_get_their_own_store(umt5):
    stores = [EncoderOutputStore(1 << 26) for _ in range(4)]
    ids, mask = inputs(umt5, 32, 6)
    ref = run(umt5, ids, mask)
    outs, barrier = [None] * 4, threading.Barrier(4)

    def work(i):
        barrier.wait()
        for _ in range(3):
            outs[i] = served(umt5, stores[i], ids, mask)[0]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(o, ref) for o in outs)
    assert all(s.metrics.computes == umt5.config.num_layers for s in stores)
    assert all("compute_bias" not in m.__dict__ for _, m in bias_owners(umt5))


def test_a_store_too_small_for_a_forwards_biases_serves_none(umt5):
    need = PositionBiases(umt5).forward_bytes(64)
    assert need == umt5.config.num_layers * umt5.config.num_heads * 64 * 64 * 4
    ids, mask = inputs(umt5, 64, 9)
    ref = run(umt5, ids, mask)
    small, enough = EncoderOutputStore(need * BUDGET_SHARE - 1), EncoderOutputStore(need * BUDGET_SHARE)
    out, serving = served(umt5, small, ids, mask)
    assert not serving and torch.equal(out, ref) and len(small) == 0 and small.metrics.lookups == 0
    out, serving = served(umt5, enough, ids, mask)
    assert serving and torch.equal(out, ref) and len(enough) == umt5.config.num_layers


def test_a_changed_bias_table_is_never_served_from_the_old_entries():
    pipe = tiny_wan_pipeline()
    adapter = T5EncoderAdapter(pipe.tokenizer, pipe.text_encoder, T5Recipe(attention_mask=True, trim_to_length=True))
    store = EncoderOutputStore(1 << 26)
    adapter.encode("a red fox", 32, store).release()
    _, module = bias_owners(pipe.text_encoder)[0]
    with torch.no_grad():
        module.relative_attention_bias.weight.mul_(1.5)  # seen by the fingerprint (version counter)
    with adapter.encode("a blue fox", 32, store) as lease, adapter.encode("a blue fox", 32) as ref:  # ref: no store
        assert torch.equal(lease.outputs["hidden"], ref.outputs["hidden"])
    assert store.metrics.computes == 2 * (1 + pipe.text_encoder.config.num_layers)


def test_a_class_with_another_compute_bias_signature_is_not_served():
    class Attention(torch.nn.Module):
        has_relative_attention_bias = True

        def __init__(self):
            super().__init__()
            self.relative_attention_bias = torch.nn.Embedding(32, 2)

        def compute_bias(self, query_length, key_length, device=None):  # no past_seen_tokens
            return torch.zeros(1, 2, query_length, key_length)

    model = torch.nn.Sequential(Attention())
    assert bias_owners(model) == []
    with PositionBiases(model).serving(EncoderOutputStore(1 << 20), "fp", b"", 8) as serving:
        assert not serving and "compute_bias" not in model[0].__dict__


def test_the_switch_is_a_bool(umt5):
    pipe = tiny_wan_pipeline()
    recipe = T5Recipe(attention_mask=True, trim_to_length=True)
    for bad in (1, "yes", None):
        with pytest.raises(InvalidRequest, match="position_biases"):
            T5EncoderAdapter(pipe.tokenizer, pipe.text_encoder, recipe, position_biases=bad)
        with pytest.raises(InvalidRequest, match="position_biases"):
            CachedWanPipeline(pipe, None, position_biases=bad)


def test_switched_off_the_wrappers_store_prompt_outputs_only():
    pipe = tiny_sd3_pipeline()
    pipe.set_progress_bar_config(disable=True)
    store = EncoderOutputStore(1 << 26)
    CachedSD3Pipeline(pipe, store, position_biases=False).prepare("a red fox", "blurry").release()
    assert len(store) == 6  # CLIP-L, CLIP-G and T5, for the prompt and the negative
    store = EncoderOutputStore(1 << 26)
    CachedSD3Pipeline(pipe, store).prepare("a red fox", "blurry").release()
    assert len(store) == 7  # and T5's one bias at its text length


def test_biases_and_prompt_outputs_churn_together_under_a_tight_budget():
    pipe = tiny_wan_pipeline()
    pipe.set_progress_bar_config(disable=True)
    from mmcache.presets.local_tokenizers import parti_prompts, wan_negative_prompt

    neg, pool = wan_negative_prompt(), parti_prompts()[300:312]
    need = PositionBiases(pipe.text_encoder).forward_bytes(64)
    store = EncoderOutputStore(need * BUDGET_SHARE)  # the biases of one length at most a quarter of it
    on, off = CachedWanPipeline(pipe, store), CachedWanPipeline(pipe, None)
    lengths = range(40, 65, 4)  # seven lengths: their biases alone exceed the budget, so entries are evicted
    assert sum(PositionBiases(pipe.text_encoder).forward_bytes(n) for n in lengths) > store.budget_bytes
    for i in range(30):
        length = lengths[i % len(lengths)]
        prompt = pool[(i * 7) % len(pool)]
        with on.prepare(prompt, neg, max_sequence_length=length) as call, \
                off.prepare(prompt, neg, max_sequence_length=length) as ref:
            for name in ("prompt_embeds", "negative_prompt_embeds"):
                assert torch.equal(call.kwargs[name], ref.kwargs[name])
        store.check_invariants()
        assert all(store.held(key) == 0 for key in store.keys())
    assert store.metrics.evictions > 0 and on.text.position_biases.computed > pipe.text_encoder.config.num_layers
