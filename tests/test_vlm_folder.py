"""A VLM served from a local Hugging Face folder (``mmcache serve --model DIR``): the tiny LLaVA and Qwen2-VL
presets written as folders (``save_pretrained``, as llava-hf's and Qwen's folders hold them) load back to an
engine whose greedy answers to a chat with a photo equal the preset's own; over HTTP the folder's second turn is
served from the caches; a folder that lacks a file, whose weights do not fit its config, or whose tokenizer
lacks the template's tokens is refused with a ``ModelLoadError`` that names it."""

import json
import shutil

import openai
import pytest

from mmcache.engine import EngineConfig, SamplingParams
from mmcache.engine.models import ModelLoadError
from mmcache.hosts.vlm import VLMEngine, VLMRequest, answer_message
from mmcache.presets import serve, vlm_from_preset
from mmcache.presets.serving import build_engine
from mmcache.presets.vlm import build_vlm
from mmcache.presets.vlm_folder import is_vlm_folder, load_vlm
from mmcache.server import ServerConfig
from server_helpers import data_url

pytestmark = pytest.mark.usefixtures("one_thread")

PRESETS = ("tiny-llava", "tiny-qwen2-vl")


def write_folder(name: str, out):
    """The preset as a Hugging Face folder: weights and config, image processor, tokenizer.json."""
    preset = build_vlm(name, "float32")
    preset.model.save_pretrained(out)
    preset.image_processor.save_pretrained(out)
    preset.tokenizer.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: write_folder(name, tmp_path_factory.mktemp(name)) for name in PRESETS}


def _chat(photo: bytes) -> list:
    return [{"role": "user", "content": [{"type": "image", "image": photo},
                                         {"type": "text", "text": "What is in this picture?"}]}]


@pytest.fixture(scope="module")
def photo(datasets_dir) -> bytes:
    return (datasets_dir / "images" / "chelsea.png").read_bytes()


def _two_turns(engine, photo: bytes) -> list:
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    chat = _chat(photo)
    first = engine.generate([VLMRequest(messages=chat, sampling=greedy)])[0]
    chat = chat + [answer_message(first), {"role": "user", "content": [{"type": "text", "text": "Its colour?"}]}]
    second = engine.generate([VLMRequest(messages=chat, sampling=greedy)])[0]
    return [first, second]


@pytest.mark.parametrize("name", PRESETS)
def test_a_folder_answers_as_its_preset(folders, photo, name):
    folder = folders[name]
    assert is_vlm_folder(folder)
    engine = build_engine(ServerConfig(model=str(folder), dtype="float32", engine_config=EngineConfig(page_size=16)))
    assert isinstance(engine, VLMEngine)
    preset = vlm_from_preset(name, EngineConfig(page_size=16))
    got, want = _two_turns(engine, photo), _two_turns(preset, photo)
    assert [o.output_ids for o in got] == [o.output_ids for o in want]
    assert [o.prompt_len for o in got] == [o.prompt_len for o in want]
    assert got[1].matched_tokens > 0 and got[1].matched_tokens == want[1].matched_tokens  # turn 2 from the cache
    engine.check_invariants()


def test_the_server_serves_a_llava_folder_with_its_caches(folders, photo):
    config = ServerConfig(model=str(folders["tiny-llava"]), dtype="float32", engine_config=EngineConfig(page_size=16))
    image = data_url(photo)
    with serve(config) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        assert model == folders["tiny-llava"].name
        chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": "What is in this picture?"}]}]
        first = client.chat.completions.create(model=model, messages=chat, max_tokens=4, temperature=0)
        chat += [first.choices[0].message, {"role": "user", "content": "And its colour?"}]
        second = client.chat.completions.create(model=model, messages=chat, max_tokens=4, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        store = srv.host.engine.metrics()["encoder"]
        assert store["computes"] == 1 and store["hits"] >= 1  # the photo was encoded once
    srv.host.engine.check_invariants()


def test_a_text_folder_is_not_taken_for_a_vlm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert not is_vlm_folder(tmp_path) and not is_vlm_folder(tmp_path / "absent")
    (tmp_path / "config.json").write_text("{not json")
    assert not is_vlm_folder(tmp_path)
    with pytest.raises(ModelLoadError, match="not a VLM folder"):
        load_vlm(tmp_path)


@pytest.mark.parametrize("damage,says", [
    ("no_processor", "lacks preprocessor_config.json"),
    ("no_tokenizer", "lacks tokenizer.json"),
    ("deeper_config", "weights the config needs are not in the files"),
    ("tokenizer_without_image_token", "has no token '<image>'"),
])
def test_a_damaged_folder_is_refused_by_name(folders, tmp_path, damage, says):
    folder = tmp_path / "damaged"
    shutil.copytree(folders["tiny-llava"], folder)
    if damage == "no_processor":
        (folder / "preprocessor_config.json").unlink()
    elif damage == "no_tokenizer":
        (folder / "tokenizer.json").unlink()
    elif damage == "deeper_config":
        config = json.loads((folder / "config.json").read_text())
        config["text_config"]["num_hidden_layers"] += 1
        (folder / "config.json").write_text(json.dumps(config))
    else:
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
        tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != "<image>"]
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ModelLoadError, match="damaged") as err:
        load_vlm(folder, "float32")
    assert says in str(err.value)
