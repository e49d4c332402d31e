"""Vision-tower adapters (encoders/vision.py) on the tiny VLM presets: equality with the models' own forward,
one tower run per unique image, fingerprints, the store budget under churn, and nothing held after a failure."""

import copy
import itertools

import pytest
import torch

from encoders.fingerprint import weights_digest
from encoders.media import ImageLimits, decode_image, read_image
from mmcache.presets.vlm import TINY_VLM_PRESETS, build_preset
from mmcache.errors import InvalidRequest, MediaDecodeError
from mmcache.store import EncoderOutputStore

# Logits computed from the adapter's features are compared with the model's own pixel_values forward within
# ATOL (measured: bit-identical on CPU); a swapped image must move them by far more.
ATOL = 1e-5
IMAGES = ("chelsea.png", "extreme_ironing.jpg", "astronaut.png", "coffee.png")


@pytest.fixture(scope="module")
def images(datasets_dir) -> list[bytes]:
    return [(datasets_dir / "images" / name).read_bytes() for name in IMAGES]


@pytest.fixture(scope="module")
def presets() -> dict:
    return {name: build_preset(name) for name in TINY_VLM_PRESETS}


def count_tower_calls(adapter) -> list:
    calls = []
    adapter.tower.register_forward_hook(lambda *_: calls.append(1))
    return calls


def adapter_logits(preset, prompt) -> torch.Tensor:
    model = preset.model
    with torch.no_grad():
        embeds = prompt.embed(model.get_input_embeddings())[None]
        if prompt.mrope_positions is None:
            return model(inputs_embeds=embeds).logits[0]
        return model(inputs_embeds=embeds, position_ids=prompt.mrope_positions[:, None, :]).logits[0]


def two_image_chat(images):
    return [
        {"role": "user", "content": [{"type": "image", "image": images[0]},
                                     {"type": "text", "text": "What is the color of the cat?"}]},
        {"role": "assistant", "content": "It is brown."},
        {"role": "user", "content": [{"type": "text", "text": "And in this one?"},
                                     {"type": "image_url", "image_url": {"url": images[1]}}]},
    ]


@pytest.mark.parametrize("name", TINY_VLM_PRESETS)
def test_substituted_features_give_the_models_own_logits(name, presets, images, hf_vlm_logits):
    preset = presets[name]
    store = EncoderOutputStore(1 << 24)
    with preset.prompt_builder(store).from_messages(two_image_chat(images)) as prompt:
        ours = adapter_logits(preset, prompt)
        theirs = hf_vlm_logits(preset, prompt.token_ids, images[:2])
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
        if name == "tiny-qwen2-vl":
            ids = torch.tensor([prompt.token_ids])
            grid = torch.tensor([im.grid_thw for im in prompt.images])
            positions, delta = preset.model.model.get_rope_index(
                ids, (ids == preset.model.config.image_token_id).int(), grid)
            assert torch.equal(prompt.mrope_positions, positions[:, 0]) and prompt.mrope_delta == int(delta)
        (a, fa), (b, fb) = prompt.embeds
        prompt.embeds = [(a, fb), (b, fa)]  # same shapes (equal grids), swapped images
        assert (adapter_logits(preset, prompt) - theirs).abs().max() > 1000 * ATOL


def test_generated_tokens_continue_at_position_plus_delta(presets, images):
    """Greedy decoding with our positions (p + mrope_delta for generated tokens, no KV cache) reproduces the
    logits of the model's own cached ``generate``; dropping the delta does not."""
    preset = presets["tiny-qwen2-vl"]
    model = preset.model
    store = EncoderOutputStore(1 << 24)
    content = [{"type": "image", "image": images[0]}, {"type": "text", "text": "Describe"},
               {"type": "image", "image": images[2]}]
    with preset.prompt_builder(store).from_messages([{"role": "user", "content": content}]) as prompt:
        ids = torch.tensor([prompt.token_ids])
        n = ids.shape[1]
        batch = preset.image_processor(images=[decode_image(read_image(images[i])) for i in (0, 2)],
                                       return_tensors="pt")
        with torch.no_grad():
            ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **batch,
                                 mm_token_type_ids=(ids == model.config.image_token_id).int(), max_new_tokens=4,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 eos_token_id=None, pad_token_id=0)
            new = ref.sequences[0, n:].tolist()
            table = model.get_input_embeddings()
            assert prompt.mrope_delta < 0
            for step in range(4):
                embeds = torch.cat([prompt.embed(table), table(torch.tensor(new[:step], dtype=torch.long))])[None]
                positions = prompt.positions(0, n + step)
                logits = model(inputs_embeds=embeds, position_ids=positions[:, None]).logits[0, -1]
                torch.testing.assert_close(logits, ref.logits[step][0], atol=1e-4, rtol=0)
                if step:
                    positions[:, n:] -= prompt.mrope_delta
                    wrong = model(inputs_embeds=embeds, position_ids=positions[:, None]).logits[0, -1]
                    assert (wrong - ref.logits[step][0]).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_tower_runs_once_per_unique_image(name, presets, images):
    preset = presets[name]
    store = EncoderOutputStore(1 << 24)
    adapter = preset.adapter(store)
    calls = count_tower_calls(adapter)
    same_twice = adapter.encode_all([images[0], images[0]])
    assert len(calls) == 1 and same_twice[0] is same_twice[1] and not same_twice[0].hit
    again = adapter.encode(images[0])
    assert len(calls) == 1 and again.hit and again.key == same_twice[0].key
    assert store.held(again.key) == 2
    torch.testing.assert_close(again.features, same_twice[0].features, atol=0, rtol=0)
    again.release()
    same_twice[0].release()
    assert store.held(again.key) == 0 and again.key in store

    other_params = type(preset.image_processor)(**{**preset.image_processor.to_dict(), "resample": 2})
    resized = preset.adapter_class(preset.model, other_params, store)  # same model: the hook sees its runs
    assert resized.digest(images[0]) != adapter.digest(images[0])
    assert resized.fingerprint != adapter.fingerprint
    resized.encode(images[0]).release()
    assert len(calls) == 2
    assert len(store) == 2


def test_different_salts_share_no_entries(presets, images):
    store = EncoderOutputStore(1 << 24)
    adapter = presets["tiny-llava"].adapter(store)
    calls = count_tower_calls(adapter)
    a = adapter.encode(images[1], salt="tenant-a")
    b = adapter.encode(images[1], salt=b"tenant-b")
    plain = adapter.encode(images[1])
    assert len(calls) == 3 and len({a.key, b.key, plain.key}) == 3 and len(store) == 3
    assert a.digest == b.digest == plain.digest  # the media digest is salt-free; the store key is not
    assert not (a.hit or b.hit or plain.hit)
    assert adapter.encode(images[1], salt="tenant-a").hit and len(calls) == 3


def test_fingerprint_follows_weights_config_and_seed(presets):
    store = EncoderOutputStore(1 << 20)
    base = presets["tiny-llava"].adapter(store).fingerprint
    assert build_preset("tiny-llava").adapter(store).fingerprint == base
    assert build_preset("tiny-llava", seed=1).adapter(store).fingerprint != base
    changed = build_preset("tiny-llava")
    with torch.no_grad():
        changed.model.model.multi_modal_projector.linear_2.bias[0] += 1e-3
    assert changed.adapter(store).fingerprint != base
    changed = build_preset("tiny-llava")
    changed.model.config.vision_feature_layer = -1
    assert changed.adapter(store).fingerprint != base
    changed = build_preset("tiny-llava")
    with torch.no_grad():
        changed.model.model.language_model.layers[0].mlp.up_proj.weight[0, 0] += 1.0  # text side: irrelevant
    assert changed.adapter(store).fingerprint == base


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_attention_implementation_is_part_of_the_fingerprint(name, presets, images):
    # transformers keeps ``_attn_implementation`` out of the config's JSON, yet sdpa and eager towers over the same
    # weights give features that differ in their last bits: they must not share entries (the eager
    # adapter was served the sdpa adapter's features).
    preset = presets[name]
    store = EncoderOutputStore(1 << 24)
    sdpa = preset.adapter(store)
    eager_model = copy.deepcopy(preset.model)
    eager_model.set_attn_implementation("eager")
    assert eager_model.config.vision_config._attn_implementation == "eager"
    eager = preset.adapter_class(eager_model, preset.image_processor, store)
    assert eager.fingerprint != sdpa.fingerprint and eager.key(images[0]) != sdpa.key(images[0])
    first = sdpa.encode(images[0])
    served = eager.encode(images[0])
    own = eager.encode(images[0], salt="own")  # an entry only the eager adapter computes
    assert not served.hit and torch.equal(served.features, own.features)
    for image in (first, served, own):
        image.release()

    # The tower's own config decides, not the top level's or the language model's (which the engine sets when
    # it attaches): eager vision under an sdpa text model is the eager tower; the reverse is the sdpa tower.
    vision_only = copy.deepcopy(preset.model)
    vision_only.set_attn_implementation({"vision_config": "eager"})
    assert vision_only.config._attn_implementation == "sdpa"
    assert preset.adapter_class(vision_only, preset.image_processor, store).fingerprint == eager.fingerprint
    text_only = copy.deepcopy(preset.model)
    text_only.set_attn_implementation({"": "eager", "text_config": "eager", "vision_config": "sdpa"})
    assert text_only.config.text_config._attn_implementation == "eager"
    assert preset.adapter_class(text_only, preset.image_processor, store).fingerprint == sdpa.fingerprint

    # Equal settings over equal weights still share: another eager copy hits the eager adapter's entry.
    again = preset.adapter_class(copy.deepcopy(eager_model), preset.image_processor, store)
    assert again.fingerprint == eager.fingerprint
    hit = again.encode(images[0])
    assert hit.hit and torch.equal(hit.features, served.features)
    hit.release()
    assert preset.adapter(store).fingerprint == sdpa.fingerprint


def test_store_budget_under_churn(presets, images):
    preset = presets["tiny-qwen2-vl"]
    reference = {}
    probe = preset.adapter(EncoderOutputStore(1 << 24))
    for i, image in enumerate(images):
        encoded = probe.encode(image)
        reference[i] = encoded.features.clone()
        encoded.release()
    sizes = {i: f.numel() * f.element_size() for i, f in reference.items()}
    budget = sizes[0] + sizes[1] + sizes[2] // 2  # two entries fit, never three
    store = EncoderOutputStore(budget)
    adapter = preset.adapter(store)
    calls = count_tower_calls(adapter)
    held = {}
    pattern = itertools.islice(itertools.cycle([0, 1, 2, 3, 0, 0, 2, 1, 3, 3]), 24)
    for step, i in enumerate(pattern):
        encoded = adapter.encode(images[i])
        torch.testing.assert_close(encoded.features, reference[i], atol=0, rtol=0)
        if step % 3 == 0 and i not in held:
            held[i] = encoded  # keep this one for a while
        else:
            encoded.release()
        if step % 7 == 6 and held:
            held.pop(min(held)).release()
        store.check_invariants()
        assert store.metrics.bytes <= budget
        for kept in held.values():
            if not kept.lease.bypassed:
                assert kept.key in store and store.held(kept.key) >= 1
    for kept in held.values():
        kept.release()
    m = store.metrics
    assert m.evictions > 0 and m.hits > 0 and m.computes == len(calls)
    assert m.peak_bytes <= budget


def test_oversize_entries_bypass_but_return_features(presets, images):
    preset = presets["tiny-llava"]
    full = preset.adapter(EncoderOutputStore(1 << 24)).encode(images[2])
    tiny = EncoderOutputStore(full.features.numel() * full.features.element_size() - 1)
    adapter = preset.adapter(tiny)
    calls = count_tower_calls(adapter)
    for _ in range(2):
        encoded = adapter.encode(images[2])
        assert encoded.lease.bypassed and not encoded.hit
        torch.testing.assert_close(encoded.features, full.features, atol=0, rtol=0)
        encoded.release()
    assert len(calls) == 2 and len(tiny) == 0 and tiny.metrics.bypasses == 2
    tiny.check_invariants()


def test_budget_pinned_by_held_entries_bypasses_new_ones(presets, images):
    preset = presets["tiny-llava"]
    one = preset.adapter(EncoderOutputStore(1 << 24)).encode(images[0]).features
    store = EncoderOutputStore(one.numel() * one.element_size())
    adapter = preset.adapter(store)
    pinned = adapter.encode(images[0])
    other = adapter.encode(images[1])
    assert not pinned.lease.bypassed and other.lease.bypassed
    assert pinned.key in store and other.key not in store and other.features.shape == one.shape
    pinned.release()
    assert not adapter.encode(images[1]).lease.bypassed  # now the unheld entry is evicted for it
    assert pinned.key not in store
    store.check_invariants()


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2-vl"])
def test_corrupt_image_in_a_request_leaks_nothing(name, presets, images):
    preset = presets[name]
    store = EncoderOutputStore(1 << 24)
    builder = preset.prompt_builder(store)
    calls = count_tower_calls(builder.adapter)
    truncated = images[0][: len(images[0]) // 3]
    messages = [{"role": "user", "content": [{"type": "image", "image": images[1]},
                                             {"type": "text", "text": "Compare them."},
                                             {"type": "image", "image": truncated}]}]
    with pytest.raises(MediaDecodeError) as e:
        builder.from_messages(messages)
    assert e.value.item.index == 1 and e.value.item.kind == "bytes"
    good = builder.adapter.key(images[1])
    assert good in store and store.held(good) == 0 and len(store) == 1 and len(calls) == 1

    ids = builder.template.text("look") + [builder.template.image_token_id] * 3
    with pytest.raises(InvalidRequest, match="a run of 3 image tokens"):
        builder.from_token_ids(ids, [images[1]])  # fails after encoding: the lease must be returned
    assert store.held(good) == 0 and len(calls) == 1

    with pytest.raises(MediaDecodeError) as e:
        image = builder.template.image_token_id
        builder.from_token_ids([image] + ids[:1] + [image], [images[1], "data:image/png;base64,AAAA"])
    assert e.value.item.index == 1 and e.value.item.kind == "data_url"
    assert store.held(good) == 0
    store.check_invariants()


def test_encode_all_takes_only_a_list_or_tuple_of_images(presets, images, datasets_dir):
    # encode_all(None) or (5) raised a bare TypeError; a str path was read one character per image, and one
    # bytes object one int per image.
    store = EncoderOutputStore(1 << 24)
    adapter = presets["tiny-llava"].adapter(store, ImageLimits(allow_paths=True))  # reads a dataset file
    calls = count_tower_calls(adapter)
    path = str(datasets_dir / "images" / IMAGES[0])
    for bad in (None, 5, images[0], path, iter([images[0]]), {0: images[0]}, bytearray(images[0])):
        with pytest.raises(InvalidRequest, match="list of images"):
            adapter.encode_all(bad)
    with pytest.raises(InvalidRequest, match="salt"):
        adapter.encode_all([], salt=5)  # refused even with no image to key
    for index in (-1, "0", True, 1.0):
        with pytest.raises(InvalidRequest, match="index"):
            adapter.encode(images[0], index=index)
    assert len(calls) == 0 and len(store) == 0
    encoded = adapter.encode_all((images[0], path))
    assert encoded[0] is encoded[1] and store.held(encoded[0].key) == 1  # a tuple is a list of images
    encoded[0].release()
    store.check_invariants()


def test_digest_and_key_take_only_image_bytes(presets, images):
    # bytes(raw) made digest(5) the digest of five zero bytes and digest([1, 2]) that of b"\x01\x02"; -1,
    # 10**30 and a str raised bare ValueError, OverflowError and TypeError.
    adapter = presets["tiny-llava"].adapter(EncoderOutputStore(1 << 20))
    for bad in (5, [1, 2], -1, 10**30, "abc", None, 2.5, (0,)):
        with pytest.raises(InvalidRequest):
            adapter.digest(bad)
        with pytest.raises(InvalidRequest):
            adapter.key(bad)
    raw = read_image(images[0])
    digest = adapter.digest(raw)
    assert digest == adapter.digest(images[0]) == adapter.digest(bytearray(images[0]))
    assert digest == adapter.digest(memoryview(images[0])) != adapter.digest(b"\0" * 5)
    encoded = adapter.encode(images[0])
    assert adapter.key(raw) == adapter.key(images[0]) == encoded.key
    encoded.release()


def test_vision_adapter_refuses_missing_parts(presets):
    preset = presets["tiny-llava"]
    store = EncoderOutputStore(1 << 20)
    for args in ((None, preset.image_processor, store), (preset.model, None, store),
                 (preset.model, preset.image_processor, None), (preset.model, preset.image_processor, "store"),
                 (preset.model, preset.image_processor, store, {"max_pixels": 10})):
        with pytest.raises(InvalidRequest):
            preset.adapter_class(*args)
    for bad in ([None], preset.model, "tower"):
        with pytest.raises(InvalidRequest):
            weights_digest(bad)
