"""``mmcache export-model`` of the VLM presets: the folder holds the model, the image processor under a class name
both transformers versions know, the tokenizer and the Jinja twin of the engine's template; ``mmcache serve
--model DIR`` loads it with that template and serves a two-turn chat whose second turn comes from the caches; a
``chat_template`` file renders in place of the folder's own, for a VLM folder and for a text folder over HTTP."""

import json

import openai
import pytest

from encoders.chat_template import Message, TextPart
from encoders.jinja_template import CHATML_JINJA, LLAVA_JINJA, PLAIN_JINJA, JinjaChatTemplate
from mmcache.engine import EngineConfig
from mmcache.engine.cli import register
from mmcache.engine.models import ModelLoadError
from mmcache.presets import serve
from mmcache.presets.export import VLM_EXPORT_FILES, export_model
from mmcache.presets.text import UnknownPreset
from mmcache.presets.vlm import VLM_PRESETS
from mmcache.presets.vlm_folder import load_vlm
from mmcache.server import ServerConfig
from server_helpers import data_url

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"tiny-llava": LLAVA_JINJA, "tiny-qwen2-vl": CHATML_JINJA}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: export_model(name, tmp_path_factory.mktemp(name) / "m", "float32") for name in TINY}


@pytest.fixture(scope="module")
def photo(datasets_dir) -> bytes:
    return (datasets_dir / "images" / "chelsea.png").read_bytes()


@pytest.mark.parametrize("name", list(TINY))
def test_an_exported_vlm_holds_its_files_and_loads_with_its_template(folders, name):
    folder = folders[name]
    assert sorted(p.name for p in folder.iterdir()) == sorted(VLM_EXPORT_FILES)
    assert (folder / "chat_template.jinja").read_text() == TINY[name]
    processor = json.loads((folder / "preprocessor_config.json").read_text())
    assert not processor["image_processor_type"].endswith("Pil")  # the backend-free name
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    vlm = load_vlm(folder, "float32")
    assert isinstance(vlm.template, JinjaChatTemplate) and vlm.template.source == TINY[name]
    assert vlm.eos_token_id == vlm.model.generation_config.eos_token_id


def test_every_vlm_preset_is_an_export_choice(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    for name in VLM_PRESETS:
        assert parser.parse_args(["export-model", name, str(tmp_path)]).preset == name
    with pytest.raises(UnknownPreset):
        export_model("no-such-preset", tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", list(TINY))
def test_an_exported_vlm_serves_a_two_turn_chat_from_the_caches(folders, photo, name):
    config = ServerConfig(model=str(folders[name]), dtype="float32", engine_config=EngineConfig(page_size=16))
    with serve(config) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(photo)}},
                                             {"type": "text", "text": "What is in this picture?"}]}]
        first = client.chat.completions.create(model="m", messages=chat, max_tokens=4, temperature=0)
        chat += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And its colour?"}]
        second = client.chat.completions.create(model="m", messages=chat, max_tokens=4, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        assert second.usage.prompt_tokens > first.usage.prompt_tokens
    srv.host.engine.check_invariants()


def test_a_chat_template_file_renders_in_place_of_the_folders_own(folders, tmp_path):
    other = tmp_path / "other.jinja"
    other.write_text("{{- '<|im_start|>system\\nBe brief.<|im_end|>\\n' -}}" + CHATML_JINJA)
    vlm = load_vlm(folders["tiny-qwen2-vl"], "float32", chat_template=other)
    assert vlm.template.source == other.read_text()
    ids, _ = vlm.template.render([Message("user", (TextPart("hi"),))], [])
    assert vlm.tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system\nBe brief.")
    sure = tmp_path / "sure.jinja"  # a generation prompt that earlier turns do not repeat
    sure.write_text(CHATML_JINJA.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\nSure:'"))
    with pytest.raises(ModelLoadError, match="sure.jinja.*rewrites earlier turns"):
        load_vlm(folders["tiny-qwen2-vl"], "float32", chat_template=sure)
    broken = tmp_path / "broken.jinja"
    broken.write_text(CHATML_JINJA.replace("'<|vision_start|><|image_pad|><|vision_end|>'", "''"))
    with pytest.raises(ModelLoadError, match="broken.jinja.*0 image token") as err:
        load_vlm(folders["tiny-qwen2-vl"], "float32", chat_template=broken)
    assert str(folders["tiny-qwen2-vl"]) in str(err.value)
    with pytest.raises(ModelLoadError, match="cannot read"):
        load_vlm(folders["tiny-qwen2-vl"], "float32", chat_template=tmp_path / "absent.jinja")


def test_a_text_folder_serves_with_the_chat_template_given(tmp_path):
    from mmcache.server.config import ServerConfigError

    folder = export_model("tiny", tmp_path / "tiny", "float32")
    assert (folder / "chat_template.jinja").read_text() == PLAIN_JINJA
    shouting = tmp_path / "shouting.jinja"
    shouting.write_text(PLAIN_JINJA.replace("'assistant:'", "'ASSISTANT >'"))
    engine_config = EngineConfig(page_size=16)
    for template, ends in ((None, "assistant:"), (str(shouting), "ASSISTANT >")):
        config = ServerConfig(model=str(folder), chat_template=template, dtype="float32",
                              engine_config=engine_config)
        with serve(config) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
            chat = [{"role": "user", "content": "hello there " * 12}]
            out = client.chat.completions.create(model="tiny", messages=chat, max_tokens=3, temperature=0,
                                                 extra_body={"return_token_ids": True})
            tokenizer = srv.host.engine.tokenizer
            assert out.usage.prompt_tokens == len(tokenizer.encode("user: " + "hello there " * 12 + "\n" + ends,
                                                                   add_special_tokens=False))
            chat += [{"role": "assistant", "content": out.choices[0].message.content,
                      "token_ids": out.choices[0].model_extra["token_ids"]}, {"role": "user", "content": "more"}]
            again = client.chat.completions.create(model="tiny", messages=chat, max_tokens=3, temperature=0)
            assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the first turn's whole pages
    latin = tmp_path / "latin.jinja"
    latin.write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    with pytest.raises(ServerConfigError, match="not UTF-8"):
        ServerConfig(model=str(folder), chat_template=str(latin))
    with pytest.raises(ServerConfigError, match="cannot read"):
        ServerConfig(model=str(folder), chat_template=str(tmp_path / "absent.jinja"))
    with pytest.raises(ServerConfigError, match="none is served"):
        ServerConfig(tts="tiny-csm", chat_template=str(shouting))


def test_a_vlm_folder_served_with_a_chat_template_file_renders_with_it(folders, tmp_path):
    system = "<|im_start|>system\nBe brief.<|im_end|>\n"
    other = tmp_path / "brief.jinja"
    other.write_text("{{- '" + system.replace("\n", "\\n") + "' -}}" + CHATML_JINJA)
    chat = [{"role": "user", "content": "What is in this picture?"}]
    tokens = {}
    for template in (None, str(other)):
        config = ServerConfig(model=str(folders["tiny-qwen2-vl"]), dtype="float32", chat_template=template,
                              engine_config=EngineConfig(page_size=16))
        with serve(config) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
            out = client.chat.completions.create(model="m", messages=chat, max_tokens=2, temperature=0)
            tokens[template] = out.usage.prompt_tokens
            extra = len(srv.host.engine.engine.tokenizer.encode(system, add_special_tokens=False))
    assert tokens[str(other)] == tokens[None] + extra


def test_a_chat_template_file_with_a_vlm_preset_is_refused(tmp_path):
    from mmcache.server.config import ServerConfigError

    template = tmp_path / "t.jinja"
    template.write_text(CHATML_JINJA)
    with pytest.raises(ServerConfigError, match="export-model"):
        with serve(ServerConfig(preset="tiny-llava", chat_template=str(template))):
            pass


def test_a_llava_export_names_its_tower_weights_as_vllm_reads_them_and_loads_back_equal(folders):
    import torch
    from safetensors import safe_open

    from mmcache.presets.vlm import build_vlm

    with safe_open(str(folders["tiny-llava"] / "model.safetensors"), "pt") as f:
        tower = [k for k in f.keys() if k.startswith("vision_tower.")]
    assert tower and all(k.startswith("vision_tower.vision_model.") for k in tower)
    loaded = load_vlm(folders["tiny-llava"], "float32").model.state_dict()
    built = build_vlm("tiny-llava", "float32").model.state_dict()
    assert loaded.keys() == built.keys() and all(torch.equal(loaded[k], built[k]) for k in built)
