"""Keys follow what they name: a model changed in place, a tokenizer changed through its API, a pipeline component
replaced. Every changed case is compared with what the unchanged code path computes now (a fresh tokenization, the
pipeline's own ``encode_prompt``), never with an earlier entry; each runs on its own pipeline, since it mutates it.
"""

import pytest
import torch
from tokenizers import AddedToken, normalizers

from encoders.diffusion import CachedSD3Pipeline, CachedWanPipeline
from mmcache.presets.diffusion import WanPreset, tiny_sd3_pipeline, tiny_wan_pipeline
from encoders.fingerprint import LiveFingerprint
from mmcache.presets.local_tokenizers import t5_tokenizer, wan_negative_prompt
from encoders.text_encoders import T5EncoderAdapter, T5Recipe, TokenizationMemo
from mmcache.presets.vlm import build_preset
from mmcache.store import EncoderOutputStore

NEG = wan_negative_prompt()
P = "a red fox in the snow"
WAN_RECIPE = T5Recipe(attention_mask=True, trim_to_length=True)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


def test_live_fingerprint_is_taken_again_exactly_when_the_module_token_changes():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    taken = []
    live = LiveFingerprint(model, lambda: taken.append(1) or len(taken))
    assert live() == live() == 1  # unchanged: no second take
    with torch.no_grad():
        model[0].weight.mul_(2)  # in place through autograd's view: its version counter moves
    assert live() == 2
    model[0].weight.data = torch.zeros(4, 4)  # new storage behind the same Parameter
    assert live() == 3
    model.to(torch.float64)
    assert live() == 4
    model[1].weight.data.mul_(3)  # through .data: no version bump, not seen ...
    assert live() == 4
    live.refresh()  # ... until refresh
    assert live() == 5
    model[0].register_parameter("bias", None)  # a slot emptied: the tensors are found again
    assert live() == 6 and live() == 6


def test_an_adapter_follows_its_model_changed_in_place():
    for change in (lambda m: m.set_attn_implementation("eager"),
                   lambda m: m.encoder.final_layer_norm.weight.mul_(1.5),
                   lambda m: m.to(torch.bfloat16),
                   lambda m: setattr(m.config, "layer_norm_epsilon", 0.5)):  # keyed (the fingerprint holds it)
        wan = tiny_wan_pipeline()
        store = EncoderOutputStore(1 << 24)
        adapter = T5EncoderAdapter(wan.tokenizer, wan.text_encoder, WAN_RECIPE)
        fingerprint = adapter.fingerprint
        adapter.encode(P, 16, store).release()
        with torch.no_grad():
            change(wan.text_encoder)
        assert adapter.fingerprint != fingerprint and adapter.dtype == wan.text_encoder.dtype
        with adapter.encode(P, 16, store) as served, adapter.encode(P, 16, None) as own:
            assert not served.hit and torch.equal(served.outputs["hidden"], own.outputs["hidden"])
            assert served.outputs["hidden"].dtype == wan.text_encoder.dtype
        held = adapter._state._held
        with adapter.encode(P, 16, store) as again:
            assert again.hit and adapter._state._held is held  # its own entry, without fingerprinting again


def test_a_write_through_data_is_seen_after_refresh():
    wan = tiny_wan_pipeline()
    store = EncoderOutputStore(1 << 24)
    adapter = T5EncoderAdapter(wan.tokenizer, wan.text_encoder, WAN_RECIPE)
    adapter.encode(P, 16, store).release()
    wan.text_encoder.encoder.final_layer_norm.weight.data.mul_(1.5)
    adapter.refresh()
    with adapter.encode(P, 16, store) as served, adapter.encode(P, 16, None) as own:
        assert not served.hit and torch.equal(served.outputs["hidden"], own.outputs["hidden"])


def wan_embeds(wrapper, pipe):
    with wrapper.prepare(P, NEG, max_sequence_length=16) as call, torch.no_grad():
        return (call.kwargs["prompt_embeds"], call.kwargs["negative_prompt_embeds"],
                *pipe.encode_prompt(P, NEG, max_sequence_length=16))


def test_the_wan_wrapper_follows_a_cast_text_encoder_store_on_and_off():
    wan = tiny_wan_pipeline()
    on, off = CachedWanPipeline(wan, EncoderOutputStore(1 << 24)), CachedWanPipeline(wan, None)
    wan_embeds(on, wan)
    wan.to(torch.float64)
    for wrapper in (on, off):
        got, got_neg, want, want_neg = wan_embeds(wrapper, wan)
        assert got.dtype == torch.float64 and torch.equal(got, want) and torch.equal(got_neg, want_neg)


def test_the_wan_wrapper_follows_a_replaced_text_encoder():
    wan = tiny_wan_pipeline()
    on, off = CachedWanPipeline(wan, EncoderOutputStore(1 << 24)), CachedWanPipeline(wan, None)
    wan_embeds(on, wan)
    wan.register_modules(text_encoder=tiny_wan_pipeline(WanPreset(seed=5)).text_encoder)
    for wrapper in (on, off):
        got, got_neg, want, want_neg = wan_embeds(wrapper, wan)
        assert torch.equal(got, want) and torch.equal(got_neg, want_neg)
        assert wrapper.adapters[0].model is wan.text_encoder
    assert on.store.metrics.kind("output").hits == 0  # no entry of the old encoder served
    # and every layer's position bias computed anew for the new one
    assert on.store.metrics.kind("position_bias").computes == 2 * wan.text_encoder.config.num_layers


def test_the_sd3_wrapper_follows_t5_leaving_and_coming_back():
    sd3 = tiny_sd3_pipeline()
    t5, tokenizer_3 = sd3.text_encoder_3, sd3.tokenizer_3
    on, off = CachedSD3Pipeline(sd3, EncoderOutputStore(1 << 26)), CachedSD3Pipeline(sd3, None)

    def check(wrapper):
        with wrapper.prepare(P, NEG) as call, torch.no_grad():
            want = sd3.encode_prompt(P, None, None, negative_prompt=NEG)
            got = [call.kwargs[k] for k in ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds",
                                            "negative_pooled_prompt_embeds")]
            assert all(torch.equal(g, w) for g, w in zip(got, want))
            return got[0]

    check(on)
    sd3.register_modules(text_encoder_3=None, tokenizer_3=None)  # the pipeline then uses zeros for T5
    for wrapper in (on, off):
        assert not check(wrapper)[:, 77:].any() and len(wrapper.adapters) == 2
    sd3.register_modules(text_encoder_3=t5, tokenizer_3=tokenizer_3)
    for wrapper in (on, off):
        assert check(wrapper)[:, 77:].any() and wrapper.adapters[2].model is t5


@pytest.mark.parametrize("change", [
    lambda t: t.add_tokens([AddedToken("red", normalized=False)]),  # already in the vocabulary: same size
    lambda t: t.add_special_tokens({"additional_special_tokens": ["a"]}),
    lambda t: setattr(t, "add_bos_token", True),  # T5 rewrites its post-processor (dropping </s>)
], ids=["added-token-in-vocab", "special-token-in-vocab", "add-bos-token"])
def test_memo_follows_added_tokens_and_the_post_processor(change):
    tokenizer = t5_tokenizer()
    memo = TokenizationMemo(tokenizer)
    text = "a redfox on a hill"
    before, size = memo(text, 16), len(tokenizer)
    change(tokenizer)
    assert len(tokenizer) == size
    fresh = tokenizer(text, padding="max_length", max_length=16, truncation=True, return_tensors="pt").input_ids[0]
    assert not torch.equal(fresh, before.input_ids)
    assert torch.equal(memo(text, 16).input_ids, fresh)


def test_memo_sees_an_edited_backend_component_after_refresh():
    tokenizer = t5_tokenizer()
    memo = TokenizationMemo(tokenizer)
    text = "A RED FOX"
    before = memo(text, 16)
    tokenizer.backend_tokenizer.normalizer = normalizers.Lowercase()
    fresh = tokenizer(text, padding="max_length", max_length=16, truncation=True, return_tensors="pt").input_ids[0]
    assert not torch.equal(fresh, before.input_ids)
    memo.refresh()
    assert torch.equal(memo(text, 16).input_ids, fresh)


def _tower_weight(model) -> torch.Tensor:
    return next(model.model.vision_tower.parameters()) if hasattr(model.model, "vision_tower") \
        else next(model.model.visual.parameters())


VISION_CHANGES = {
    "weight in place": lambda p: _tower_weight(p.model).mul_(1.5),
    "tower kernel": lambda p: p.model.set_attn_implementation({"vision_config": "eager"}),
    "cast": lambda p: p.model.to(torch.bfloat16),
    "processor attribute": lambda p: setattr(p.image_processor, "rescale_factor", 1 / 128),
}


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
@pytest.mark.parametrize("change", VISION_CHANGES)
def test_a_vision_adapter_follows_its_tower_and_processor(name, change, datasets_dir):
    # Compared with an adapter built after the change (what a new process would compute), never with an entry.
    image, preset, adapter = _fresh_adapter(name, datasets_dir)
    fingerprint, digest = adapter.fingerprint, adapter.digest(image)
    adapter.encode(image).release()
    with torch.no_grad():
        VISION_CHANGES[change](preset)
    assert adapter.fingerprint != fingerprint
    assert (adapter.digest(image) != digest) == (change == "processor attribute")
    served = adapter.encode(image)
    own = preset.adapter_class(preset.model, preset.image_processor, EncoderOutputStore(1 << 24)).encode(image)
    assert not served.hit and served.key == own.key and torch.equal(served.features, own.features)
    assert served.features.dtype == _tower_weight(preset.model).dtype
    held = adapter._state._held
    again = adapter.encode(image)
    assert again.hit and adapter._state._held is held  # its own entry, without fingerprinting again
    for encoded in (served, own, again):
        encoded.release()


def _fresh_adapter(name: str, datasets_dir):
    """A photo's bytes, a preset of its own (the tests change it) and an adapter over it with its own store."""
    preset = build_preset(name)
    return (datasets_dir / "images" / "chelsea.png").read_bytes(), preset, preset.adapter(EncoderOutputStore(1 << 24))


def test_a_vision_adapter_keys_apart_a_top_level_setting_and_not_the_language_model(datasets_dir):
    image, preset, adapter = _fresh_adapter("tiny-llava", datasets_dir)
    fingerprint = adapter.fingerprint
    with torch.no_grad():
        next(preset.model.model.language_model.parameters()).mul_(2)
    preset.model.set_attn_implementation({"text_config": "eager"})
    assert adapter.fingerprint == fingerprint  # the features do not depend on the language model
    preset.model.config.vision_feature_layer = -1  # a top-level setting the features do depend on
    assert adapter.fingerprint != fingerprint
    _assert_served_as_a_new_adapter_computes(preset, adapter, image)


def _assert_served_as_a_new_adapter_computes(preset, adapter, image: bytes) -> None:
    served = adapter.encode(image)
    own = preset.adapter_class(preset.model, preset.image_processor, EncoderOutputStore(1 << 24)).encode(image)
    assert not served.hit and torch.equal(served.features, own.features)
    served.release()
    own.release()


def test_a_vision_adapter_sees_a_write_through_data_after_refresh(datasets_dir):
    image, preset, adapter = _fresh_adapter("tiny-qwen2-vl", datasets_dir)
    fingerprint = adapter.fingerprint
    _tower_weight(preset.model).data.mul_(1.5)
    assert adapter.fingerprint == fingerprint  # not seen by itself (documented) ...
    adapter.refresh()
    assert adapter.fingerprint != fingerprint  # ... until refresh
    _assert_served_as_a_new_adapter_computes(preset, adapter, image)
