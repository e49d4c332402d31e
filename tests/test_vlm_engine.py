"""VLM requests through the reference engine (mmcache/hosts/vlm.py): placeholders, page names and encoder
outputs together.

* The engine computes what the VLM computes from pixels (its own forward), for LLaVA and Qwen2-VL (3-D).
* Same image, same text: pages hit through the image and the tower does not run again.
* Same placeholder ids, another image: matching stops at the page of the first placeholder; the output equals
  the cache-off output.
* Same bytes, other preprocessing: another digest, no store hit, no page past the image's first page.
* The bit-exact gate for VLM requests: under ``EngineConfig.exact`` every logits row with the KV cache and the
  store on equals the row with both off, for LLaVA and Qwen2-VL.
* A five-turn chat with two images runs the tower twice and each turn reuses the pages of the one before.
* Images as bytes, path or data URL are one image; token ids plus images are served like messages.
"""

import base64
import io
import subprocess
import sys
import time

import pytest
import torch
from PIL import Image, ImageOps

from encoders.media import ImageLimits
from mmcache.engine import Engine, EngineConfig, SamplingParams
from mmcache.presets.text import UnknownPreset
from mmcache.engine.attention import ATTENTION_BACKEND
from mmcache.engine.inspect import record_logits
from mmcache.hosts.vlm import VLMEngine, VLMRequest, answer_message
from mmcache.presets.vlm import build_vlm
from mmcache.store import EncoderOutputStore
from mmcache.presets import vlm_from_preset

P = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SYSTEM = "A chat between a curious human and an artificial intelligence assistant about a photo."
NAMES = ["tiny-llava", "tiny-qwen2-vl"]


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(scope="module")
def presets() -> dict:
    return {name: build_vlm(name) for name in NAMES}


@pytest.fixture(scope="module")
def images(datasets_dir) -> dict:
    """Real images; ``mirrored`` has the coffee photo's size (equal placeholder runs) and other pixels."""
    folder = datasets_dir / "images"
    out = {name: (folder / f"{name}.png").read_bytes() for name in ("coffee", "chelsea", "astronaut")}
    buf = io.BytesIO()
    ImageOps.mirror(Image.open(folder / "coffee.png")).save(buf, format="PNG")
    out["mirrored"] = buf.getvalue()
    out["ironing"] = (folder / "extreme_ironing.jpg").read_bytes()
    return out


def front(preset, mode="on", store_bytes=1 << 24, exact=False, limits=ImageLimits(), **config) -> VLMEngine:
    """A VLM engine over the preset's model (shared between fronts) with its own pools and store."""
    config.setdefault("num_pages", 256)
    cfg = EngineConfig.exact(page_size=P, cache_mode=mode, **config) if exact else \
        EngineConfig(page_size=P, cache_mode=mode, **config)
    return VLMEngine(Engine(preset.model, None, cfg), preset.prompt_builder(EncoderOutputStore(store_bytes), limits))


def chat(image, question="What is unusual about this image?", system=SYSTEM) -> list:
    messages = [{"role": "system", "content": system}] if system else []
    content = [{"type": "image", "image": image}] if image is not None else []
    return messages + [{"role": "user", "content": content + [{"type": "text", "text": question}]}]


def first_placeholder(vlm: VLMEngine, messages) -> tuple[int, int, list]:
    """(first placeholder position, end of the last image run, token ids) of a chat's prompt."""
    with vlm.builder.from_messages(messages) as prompt:
        start = prompt.embeds[0][0]
        end = max(s + f.shape[0] for s, f in prompt.embeds)
        return start, end, list(prompt.token_ids)


@pytest.mark.parametrize("name", NAMES)
def test_engine_computes_what_the_vlm_computes_from_pixels(name, presets, images, hf_vlm_logits):
    preset = presets[name]
    vlm = front(preset, prefill_chunk_tokens=P, max_tokens_per_step=4 * P)  # image runs cut across chunks
    assert vlm.tower.config._attn_implementation == "sdpa"  # only the language model uses the paged backend
    assert vlm.engine.adapter.text_config._attn_implementation == ATTENTION_BACKEND
    rec = record_logits(vlm.engine)
    content = [{"type": "image", "image": images["coffee"]}, {"type": "text", "text": "and"},
               {"type": "image", "image": images["chelsea"]}, {"type": "text", "text": "What differs?"}]
    out = vlm.generate([VLMRequest([{"role": "user", "content": content}], sampling=GREEDY, request_id="r")])[0]
    _, _, ids = first_placeholder(vlm, [{"role": "user", "content": content}])
    seq = ids + out.output_ids
    want = hf_vlm_logits(preset, seq[:-1], [images["coffee"], images["chelsea"]],
                         model=build_vlm(preset.name).model)[len(ids) - 1:]  # a fresh copy, same seed
    got = torch.stack(rec["r"])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-5 * float(want.abs().max()), rtol=0)
    assert out.output_ids == want.argmax(-1).tolist()


@pytest.mark.parametrize("name", NAMES)
def test_same_image_same_text_hits_pages_through_the_image_and_skips_the_tower(name, presets, images, tower_calls):
    vlm = front(presets[name])
    calls = tower_calls(vlm)
    messages = chat(images["coffee"])
    _, image_end, ids = first_placeholder(vlm, messages)  # a store miss: the tower's one run
    first, again = (vlm.generate([VLMRequest(messages, sampling=GREEDY)])[0] for _ in range(2))
    assert first.matched_tokens == 0 and first.prompt_len == len(ids)
    assert again.matched_tokens == (len(ids) - 1) // P * P > image_end
    assert again.output_ids == first.output_ids
    assert len(calls) == 1
    assert vlm.store.metrics.computes == 1 and vlm.store.metrics.hits == 2
    vlm.check_invariants()


@pytest.mark.parametrize("name", NAMES)
def test_same_placeholder_ids_with_another_image_stop_at_the_first_placeholder_page(name, presets, images):
    preset = presets[name]
    on, off = front(preset, exact=True), front(preset, "off", store_bytes=0, exact=True)
    first, image_end, ids = first_placeholder(on, chat(images["coffee"]))
    assert first >= 2 * P  # the system prompt puts the image on page 2 or later: pages before it exist
    other_first, _, other_ids = first_placeholder(on, chat(images["chelsea"]))
    assert other_ids == ids and other_first == first
    outs = {}
    for vlm in (on, off):
        outs[vlm] = [vlm.generate([VLMRequest(chat(images[k]), sampling=GREEDY)])[0] for k in ("coffee", "chelsea")]
    a, b = outs[on]
    assert a.matched_tokens == 0 and b.matched_tokens == first // P * P
    assert [o.output_ids for o in outs[on]] == [o.output_ids for o in outs[off]]
    assert a.output_ids != b.output_ids  # the image reaches the output: equal outputs would prove nothing
    on.check_invariants()
    off.check_invariants()


def test_same_bytes_with_other_preprocessing_get_another_digest_and_no_hit(presets, images, tower_calls):
    from transformers import CLIPImageProcessorPil

    preset = presets["tiny-llava"]
    vlm = front(preset)
    calls = tower_calls(vlm)
    resized = CLIPImageProcessorPil(size={"shortest_edge": 48}, crop_size={"height": 32, "width": 32})
    other_adapter = preset.adapter_class(preset.model, resized, vlm.store)
    other = VLMEngine(vlm.engine, type(vlm.builder)(vlm.builder.template, other_adapter))
    raw = images["chelsea"]
    assert other_adapter.digest(raw) != vlm.builder.adapter.digest(raw)
    first, _, _ = first_placeholder(vlm, chat(raw))
    vlm.generate([VLMRequest(chat(raw), sampling=GREEDY)])  # stores the pages under this adapter's digest
    b = other.generate([VLMRequest(chat(raw), sampling=GREEDY)])[0]
    c = vlm.generate([VLMRequest(chat(raw), sampling=GREEDY)])[0]
    assert b.matched_tokens == first // P * P < c.matched_tokens
    assert len(calls) == 2 and len(vlm.store) == 2 and vlm.store.metrics.hits == 2  # a and c
    vlm.check_invariants()
    other.check_invariants()


@pytest.mark.parametrize("name", NAMES)
def test_vlm_cache_on_logits_equal_cache_off_bit_for_bit_under_exact_schedule(name, presets, images, tower_calls):
    preset = presets[name]
    two = [{"role": "user", "content": [{"type": "image", "image": images["coffee"]}, {"type": "text", "text": "vs"},
                                        {"type": "image", "image": images["ironing"]}]}]
    requests = [chat(images["coffee"]), chat(images["coffee"], "Describe the photo in detail."),
                chat(images["mirrored"]), chat(images["coffee"]), two, chat(None, "Hello there."),
                chat(images["ironing"], system=None)]
    sampling = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = {}
    for mode in ("on", "off"):
        vlm = front(preset, mode, store_bytes=1 << 24 if mode == "on" else 0, exact=True)
        calls = tower_calls(vlm)
        rec = record_logits(vlm.engine)
        outs = vlm.generate([VLMRequest(m, sampling=sampling, request_id=i) for i, m in enumerate(requests)])
        runs[mode] = (rec, outs, len(calls))
        vlm.check_invariants()
    rec_on, out_on, calls_on = runs["on"]
    rec_off, out_off, calls_off = runs["off"]
    assert (calls_on, calls_off) == (3, 7)  # unique images vs every image of every request
    assert [o.matched_tokens for o in out_off] == [0] * len(requests)
    matched = [o.matched_tokens for o in out_on]
    assert matched[1] > 0 and matched[3] == (out_on[3].prompt_len - 1) // P * P and matched[2] > 0
    for i in range(len(requests)):
        assert len(rec_on[i]) == len(rec_off[i]) == 16
        for step, (a, b) in enumerate(zip(rec_on[i], rec_off[i])):
            assert torch.equal(a, b), f"request {i} step {step}: max diff {(a - b).abs().max()}"
        assert out_on[i].output_ids == out_off[i].output_ids


@pytest.mark.parametrize("name", NAMES)
def test_five_turn_chat_with_two_images_runs_the_tower_twice_and_reuses_pages(name, presets, images, tower_calls):
    vlm = front(presets[name])
    calls = tower_calls(vlm)
    questions = ["What is in this image?", "What colour is it?", "How do the two images differ?",
                 "Which one is older?", "Summarise our conversation."]
    new_image = {0: images["coffee"], 2: images["chelsea"]}
    messages = [{"role": "system", "content": SYSTEM}]
    previous = None
    for turn, question in enumerate(questions):
        content = [{"type": "text", "text": question}]
        if turn in new_image:
            content.insert(0, {"type": "image", "image": new_image[turn]})
        messages.append({"role": "user", "content": content})
        out = vlm.generate([VLMRequest(list(messages), sampling=GREEDY)])[0]
        if previous is None:
            assert out.matched_tokens == 0
        else:
            # Every full page of the previous turn's sequence (prompt and answer, whose last token has no KV yet).
            written = previous.prompt_len + len(previous.output_ids) - 1
            assert out.matched_tokens == min(written // P, (out.prompt_len - 1) // P) * P
            assert out.matched_tokens >= previous.prompt_len - P  # through every image of the history
        vlm.check_invariants()
        messages.append(answer_message(out))
        previous = out
    assert len(calls) == 2
    assert vlm.store.metrics.computes == 2 and vlm.store.metrics.hits == 1 + 1 + 2 + 2  # turns 1-4


def test_image_as_bytes_path_or_data_url_is_one_image(presets, images, datasets_dir, tower_calls):
    vlm = front(presets["tiny-llava"], limits=ImageLimits(allow_paths=True))  # reads a dataset file by path
    calls = tower_calls(vlm)
    path = datasets_dir / "images" / "coffee.png"
    url = "data:image/png;base64," + base64.b64encode(images["coffee"]).decode()
    sources = [images["coffee"], str(path), f"file://{path}", url]
    outs = [vlm.generate([VLMRequest(chat(s), sampling=GREEDY)])[0] for s in sources]
    assert len(calls) == 1
    assert [o.matched_tokens for o in outs[1:]] == [(outs[0].prompt_len - 1) // P * P] * 3
    assert len({tuple(o.output_ids) for o in outs}) == 1
    parts = [{"type": "image_url", "image_url": {"url": url}},
             {"type": "text", "text": "What is unusual about this image?"}]
    openai = vlm.generate([VLMRequest([{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}],
                                      sampling=GREEDY)])[0]
    assert openai.output_ids == outs[0].output_ids and len(calls) == 1


@pytest.mark.parametrize("name", NAMES)
def test_token_ids_with_images_are_served_like_the_chat(name, presets, images):
    vlm = front(presets[name])
    start, end, ids = first_placeholder(vlm, chat(images["chelsea"]))
    collapsed = ids[:start] + [vlm.builder.template.image_token_id] + ids[end:]
    by_chat = vlm.generate([VLMRequest(chat(images["chelsea"]), sampling=GREEDY)])[0]
    by_ids = vlm.generate([VLMRequest(token_ids=collapsed, images=[images["chelsea"]], sampling=GREEDY)])[0]
    assert by_ids.prompt_len == by_chat.prompt_len == len(ids)
    assert by_ids.output_ids == by_chat.output_ids and by_ids.matched_tokens == (len(ids) - 1) // P * P
    mismatched = vlm.generate([VLMRequest(token_ids=collapsed, images=[], sampling=GREEDY),
                               VLMRequest(chat(images["chelsea"]), token_ids=ids, sampling=GREEDY),
                               VLMRequest(chat(images["chelsea"]), images=[images["coffee"]], sampling=GREEDY)])
    assert [type(o.error).__name__ for o in mismatched] == ["InvalidRequest"] * 3
    vlm.check_invariants()


def test_ttft_counts_image_encoding(presets, images):
    vlm = front(presets["tiny-llava"])
    stamps = []
    handle = vlm.tower.register_forward_hook(lambda *_: stamps.append(time.perf_counter()))
    out = vlm.generate([VLMRequest(chat(images["astronaut"]), sampling=GREEDY)])[0]
    handle.remove()
    assert out.arrival_time < stamps[0] < out.first_token_time
    assert out.ttft == out.first_token_time - out.arrival_time


def test_text_engine_does_not_import_encoders():
    code = ("import sys, mmcache.engine, mmcache.hosts.vlm, mmcache.presets.text, mmcache.presets; "
            "mmcache.presets.engine_from_preset; "
            "print(any(m == 'encoders' or m.startswith('encoders.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", NAMES)
def test_from_preset_serves_a_chat_with_text_out(name, images):
    vlm = vlm_from_preset(name, EngineConfig(page_size=P, num_pages=64), store_bytes=1 << 20)
    out = vlm.generate([VLMRequest(chat(images["coffee"]), sampling=SamplingParams(max_tokens=4, temperature=0.0))])[0]
    assert out.finish_reason in ("length", "eos") and out.error is None
    assert isinstance(out.text, str) and out.text == vlm.engine.tokenizer.decode(out.output_ids)
    assert vlm.engine.eos_ids == {vlm.builder.template.end_of_turn_id}
    assert len(vlm.store) == 1 and vlm.metrics()["encoder"]["computes"] == 1
    with pytest.raises(UnknownPreset):
        vlm_from_preset("tiny-gpt-vision")
