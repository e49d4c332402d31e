"""Embedded models, tokenizer, export and loading, fingerprints, and the multimodal seam of the runner."""

import copy
import json

import numpy as np
import pytest
import torch

from mmcache.cli import main as cli_main
from mmcache.engine import (ATTENTION_BACKEND, ComputeConfig, Engine, EngineConfig, ModelLoadError, MRopeAdapter, MultimodalInput, Request, SamplingParams, UnsupportedModel)
from mmcache.presets.text import UnknownPreset
from mmcache.engine.compute import kernels, native
from mmcache.errors import InvalidRequest
from mmcache.engine.models import load_model, model_digest
from mmcache.presets.text import build_model
from mmcache.presets.text import PRESETS, get_preset, preset_config
from mmcache.presets.tokenizer import train_tokenizer
from mmcache.names import MediaItem, media_digest
from mmcache.presets import engine_from_preset

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


def test_presets_are_deterministic_and_their_tokenizers_fit():
    digests = {}
    for name in ("tiny", "tiny-llama", "tiny-mistral", "tiny-gemma"):
        model, tok = build_model(name, "float32")
        digests[name] = model_digest(model)
        assert model_digest(build_model(name, "float32")[0]) == digests[name]
        assert model_digest(model.to(torch.bfloat16)) != digests[name]
        assert len(tok) <= model.config.vocab_size
        assert tok.eos_token_id == model.config.eos_token_id == 0 and tok.pad_token_id == model.config.pad_token_id
    assert len(set(digests.values())) == 4
    assert {preset_config(get_preset(n)).model_type for n in digests} == {"qwen2", "llama", "mistral", "gemma"}
    with pytest.raises(UnknownPreset):
        get_preset("gpt-5")


def test_qwen25_presets_have_the_published_shape():
    real = preset_config(PRESETS["qwen2.5-0.5b"])
    assert (real.hidden_size, real.num_hidden_layers, real.num_attention_heads, real.num_key_value_heads,
            real.intermediate_size, real.vocab_size) == (896, 24, 14, 2, 4864, 151936)
    assert real.tie_word_embeddings and real.rope_parameters["rope_theta"] == 1e6
    small = preset_config(PRESETS["small"])
    assert small.num_hidden_layers < 24 and small.hidden_size == 896 and small.vocab_size == 151936


def test_tokenizer_training_is_deterministic_and_lossless():
    a, b = train_tokenizer(600), train_tokenizer(600)
    assert a.to_str() == b.to_str() and a.get_vocab_size() <= 600
    text = "A photo of an astronaut riding a horse, 2024 — naïve café 東京"
    assert a.decode(a.encode(text).ids) == text


def test_an_export_fills_a_new_folder_or_refreshes_an_export_and_otherwise_writes_nothing(tmp_path, capsys,
                                                                                          monkeypatch):
    from mmcache.presets import export as models

    out = tmp_path / "m"
    assert cli_main(["export-model", "tiny", str(out), "--dtype", "float32"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(models.EXPORT_FILES)
    assert cli_main(["export-model", "tiny", str(out), "--dtype", "float32"]) == 0  # an earlier export: replaced
    monkeypatch.chdir(tmp_path / "m")
    capsys.readouterr()
    assert cli_main(["export-model", "tiny", ""]) == 1  # "" was the current folder: it wrote into it
    assert "non-empty path" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    theirs = tmp_path / "theirs"  # a model saved by transformers, with the very names an export writes
    assert cli_main(["export-model", "tiny-llama", str(theirs), "--dtype", "float32"]) == 0
    (theirs / models.EXPORT_MARK).unlink()
    before = {p.name: p.read_bytes() for p in theirs.iterdir()}
    capsys.readouterr()
    assert cli_main(["export-model", "tiny", str(theirs)]) == 1  # it was overwritten
    assert "did not export" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in theirs.iterdir()} == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors.index.json").write_text("{}")  # another model's files: not mixed with these
    (other / "model.safetensors").mkdir()  # a folder where a file goes: it failed halfway before
    assert cli_main(["export-model", "tiny", str(other)]) == 1
    assert "holds files an export does not write" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["model.safetensors", "model.safetensors.index.json"]

    built = models.build_model

    def disk_full(*args, **kwargs):  # the tokenizers library's own exception, not an OSError
        raise Exception("No space left on device (os error 28)")

    def failing_tokenizer(*args):  # a write that fails halfway: the weights are written, the tokenizer is not
        model, tok = built(*args)
        tok.save_pretrained = disk_full
        return model, tok

    monkeypatch.setattr(models, "build_model", failing_tokenizer)
    assert cli_main(["export-model", "tiny", str(tmp_path / "new")]) == 1  # a traceback before
    assert "No space left" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "other", "theirs"]  # no half-written folder


def test_export_model_cli_and_from_pretrained_roundtrip(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert cli_main(["export-model", "tiny", str(out), "--dtype", "float32"]) == 0
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a folder")
    capsys.readouterr()
    assert cli_main(["export-model", "tiny", str(in_the_way)]) == 1  # a clear line, not a traceback
    assert "cannot write" in capsys.readouterr().err and in_the_way.read_text() == "not a folder"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).is_file(), f
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    assert AutoTokenizer.from_pretrained(out)("a cat")["input_ids"]

    preset = engine_from_preset("tiny", dtype="float32", config=EngineConfig(page_size=16, num_pages=64))
    loaded = Engine.from_pretrained(out, dtype="float32", config=EngineConfig(page_size=16, num_pages=64))
    assert loaded.fingerprint == preset.fingerprint
    prompts = ["a photo of a cat on a mat", [5, 6, 7, 8, 9]]
    a, b = preset.generate(prompts, GREEDY), loaded.generate(prompts, GREEDY)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    assert isinstance(b[0].text, str) and b[0].prompt_len == len(loaded.tokenizer("a photo of a cat on a mat")["input_ids"])

    capsys.readouterr()
    assert cli_main(["generate", "--model", str(out), "--dtype", "float32", "--max-tokens", "3", "a cat"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(line["output_ids"]) == 3 and line["error"] is None
    sampled = ["generate", "--preset", "tiny", "--max-tokens", "6", "--temperature", "0.9", "--top-k", "40",
               "--top-p", "0.9", "--seed", "7", "a cat", "a dog"]
    runs = []
    for _ in range(2):
        assert cli_main(sampled) == 0
        runs.append([json.loads(x)["output_ids"] for x in capsys.readouterr().out.strip().splitlines()[-2:]])
    assert runs[0] == runs[1] and all(len(ids) == 6 for ids in runs[0])  # the seed fixes the draws
    assert cli_main(["generate", "--preset", "tiny", "--top-p", "0", "a cat"]) == 1  # a bad value: typed error
    assert "top_p" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    # one bad prompt among good ones: every line printed, in order, and the command says it failed
    assert cli_main(["generate", "--preset", "tiny", "--max-tokens", "2", "a cat", "", "a dog"]) == 1
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()[-3:]]
    assert [x["error"] is None for x in lines] == [True, False, True] and "empty" in lines[1]["error"]
    assert len(lines[0]["output_ids"]) == len(lines[2]["output_ids"]) == 2

    with pytest.raises(ModelLoadError):
        Engine.from_pretrained(tmp_path / "missing")
    capsys.readouterr()
    assert cli_main(["generate", "--model", str(tmp_path / "missing"), "a cat"]) == 1  # one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("mmcache generate: ModelLoadError: ") and "no config.json" in err


def _cut_weights(d):
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000])


def _wider_config(d):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, hidden_size=2 * cfg["hidden_size"])))


def _edit_weights(d, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))


def _unknown_architecture(d):
    (d / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"}))


@pytest.mark.parametrize("damage, says", [
    (_cut_weights, "SafetensorError"),
    (_wider_config, "RuntimeError"),
    (_unknown_architecture, "foo"),
    (lambda d: (d / "config.json").write_text("{"), "config.json"),
    (lambda d: (d / "tokenizer.json").write_text("not json"), "cannot load the tokenizer"),
    (lambda d: (d / "tokenizer.json").unlink(), "no vocabulary besides its special tokens"),
    # transformers only warns of these, drawing what the files lack at random and dropping what the config has
    # no place for: the model loaded, ran and answered wrongly (differently on every load)
    (lambda d: _edit_weights(d, lambda t: t.pop("model.layers.1.mlp.down_proj.weight")),
     "weights the config needs are not in the files"),
    (lambda d: _edit_config(d, num_hidden_layers=1, layer_types=["full_attention"]),
     "the files hold weights the config has no place for"),
    (lambda d: _edit_config(d, num_hidden_layers=None, layer_types=None),
     "weights the config needs are not in the files"),
], ids=["cut weights", "config wider than the weights", "unknown architecture", "broken config",
        "broken tokenizer", "tokenizer config without its vocabulary", "a weight dropped", "config of fewer layers",
        "config without its depth"])
def test_a_damaged_model_folder_is_refused_with_a_typed_error(damage, says, tmp_path, capsys):
    # Each used to escape as the library's own exception (a traceback from the CLI), and a tokenizer config
    # without tokenizer.json loaded as an empty tokenizer that turned every prompt into no tokens.
    folder = tmp_path / "tiny"
    assert cli_main(["export-model", "tiny", str(folder), "--dtype", "float32"]) == 0
    damage(folder)
    with pytest.raises(ModelLoadError, match=says):
        Engine.from_pretrained(folder, dtype="float32", config=EngineConfig(page_size=16, num_pages=16))
    capsys.readouterr()
    assert cli_main(["generate", "--model", str(folder), "--dtype", "float32", "a cat"]) == 1
    err = capsys.readouterr().err  # after transformers' own progress lines and reports
    assert "\nmmcache generate: ModelLoadError: " in "\n" + err.replace("\r", "\n") and "Traceback" not in err


def test_fingerprint_names_model_weights_dtype_backend_and_page_size():
    model, tok = build_model("tiny", "bfloat16")
    eng = Engine(model, tok, EngineConfig(page_size=32, num_pages=16))
    fp = eng.fingerprint
    assert (fp.kv_dtype, fp.attention_backend, fp.page_size) == ("bfloat16", eng.backend, 32)
    assert eng.backend.startswith(ATTENTION_BACKEND)
    assert fp.model_digest == model_digest(model)
    assert eng.managers["main"].pool.kv.dtype == torch.bfloat16
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1
    assert model_digest(model) != fp.model_digest


def test_models_needing_unsupported_attention_features_are_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, attn_logit_softcapping=50.0)
    with pytest.raises(UnsupportedModel):
        Engine(Gemma2ForCausalLM(cfg), None, EngineConfig(page_size=16, num_pages=8))


def _unsupported(kind):
    import transformers as tf

    ids = dict(vocab_size=512, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    small = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, **ids)
    if kind == "falcon":  # its attention does not go through AttentionInterface: set_attn_implementation is ignored
        config = tf.FalconConfig(new_decoder_architecture=True, num_kv_heads=2, alibi=False, **small)
        return tf.FalconForCausalLM(config)
    if kind == "lfm2":  # a convolutional layer keeps state between forwards that the engine does not hold
        return tf.Lfm2ForCausalLM(tf.Lfm2Config(intermediate_size=128, num_key_value_heads=2,
                                                layer_types=["conv", "full_attention"], **small))
    if kind == "stablelm":  # its decoder layer does not pass the engine's keyword argument to the attention
        return tf.StableLmForCausalLM(tf.StableLmConfig(intermediate_size=128, num_key_value_heads=2, **small))
    # gemma2: transformers refuses the backend by its name (sdpa-like) for a model that does not support sdpa
    return tf.Gemma2ForCausalLM(tf.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                                attn_logit_softcapping=None, **ids))


def test_left_over_tensors_of_kinds_the_model_lacks_are_ignored_as_transformers_ignores_them(tmp_path):
    # Older transformers saved buffers such as rotary inv_freq or GPT-2's masked_bias; the model has no such
    # tensor at any layer, so they are not a layer the config dropped.
    folder = tmp_path / "tiny"
    assert cli_main(["export-model", "tiny", str(folder), "--dtype", "float32"]) == 0
    _edit_weights(folder, lambda t: t.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8)
                                              for i in range(2)}))
    model, _ = load_model(folder, "float32")
    assert model_digest(model) == model_digest(build_model("tiny", "float32")[0])


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "mamba"])
def test_a_folder_of_an_architecture_the_engine_cannot_serve_is_refused_as_unsupported(kind, tmp_path):
    # Gemma 2 and GPT-OSS have no sdpa path: loading them asking for sdpa raised transformers' ValueError, which
    # became a ModelLoadError; Mamba has no attention heads and raised AttributeError.
    import transformers as tf

    ids = dict(vocab_size=512, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    config = {"gemma2": lambda: tf.Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=2, num_key_value_heads=1, head_dim=16, **ids),
              "gpt_oss": lambda: tf.GptOssConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                                 num_local_experts=2, num_experts_per_tok=1, **ids),
              "mamba": lambda: tf.MambaConfig(hidden_size=32, num_hidden_layers=1, state_size=4, **ids)}[kind]()
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / kind)
    with pytest.raises(UnsupportedModel):
        Engine.from_pretrained(tmp_path / kind, dtype="float32", config=EngineConfig(page_size=8, num_pages=16))


@pytest.mark.parametrize("kind", ["falcon", "lfm2", "stablelm", "gemma2"])
def test_models_whose_layers_do_not_all_attend_through_the_paged_backend_are_refused(kind):
    # Falcon and LFM2 were accepted and returned wrong logits without a word (relative errors near 1: Falcon's
    # forwards never read the pool, LFM2's convolution restarted at every forward); StableLM failed every request
    # at its first forward; Gemma2 raised transformers' ValueError.
    torch.manual_seed(0)
    with pytest.raises(UnsupportedModel):
        Engine(_unsupported(kind).eval(), None, EngineConfig(page_size=8, num_pages=16))


def test_multimodal_embeddings_replace_placeholders_and_media_digests_name_pages():
    model, tok = build_model("tiny", "float32")
    eng = Engine(model, tok, EngineConfig(page_size=16, num_pages=128, prefill_chunk_tokens=16))
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, 512, size=60).tolist()
    placeholder = list(prompt)
    placeholder[20:40] = [5] * 20
    image_a, image_b = rng.integers(10, 512, size=20).tolist(), rng.integers(10, 512, size=20).tolist()

    def embeds(ids):
        with torch.no_grad():
            return model.get_input_embeddings()(torch.tensor(ids))

    def mm_request(ids, digest):
        return Request(placeholder, GREEDY, mm=MultimodalInput(media=[MediaItem(digest, 20)], embeds=[(20, embeds(ids))]))

    da, db = media_digest(b"image a"), media_digest(b"image b")
    # The item spans three one-page chunks; substituted rows must equal the real tokens' embeddings.
    want_a = eng.generate([prompt[:20] + image_a + prompt[40:]], GREEDY)[0].output_ids
    want_b = eng.generate([prompt[:20] + image_b + prompt[40:]], GREEDY)[0].output_ids
    first = eng.generate([mm_request(image_a, da)], GREEDY)[0]
    same = eng.generate([mm_request(image_a, da)], GREEDY)[0]
    other = eng.generate([mm_request(image_b, db)], GREEDY)[0]
    assert first.output_ids == same.output_ids == want_a and other.output_ids == want_b != want_a
    assert first.matched_tokens == 16  # page 0 (before the item) is shared with the plain prompts above
    assert same.matched_tokens == 48  # the same image: pages 0-2 are reused
    assert other.matched_tokens == 16  # another image behind the same placeholder ids: only page 0
    bad = Request(placeholder, GREEDY, mm=MultimodalInput(embeds=[(50, embeds(image_a))]))
    assert eng.generate([bad])[0].finish_reason == "error"
    eng.check_invariants()

    # Malformed multimodal input is refused at intake, for that request alone: found in a step, it would fail
    # the whole forward (an integer embedding tensor) or raise out of the call (the rest used to).
    released = []
    rows = embeds(image_a)
    malformed = [MultimodalInput(embeds=[(20, rows.long())]), MultimodalInput(embeds=rows),
                 MultimodalInput(embeds=[(20, rows, "extra")]), MultimodalInput(embeds=[(True, rows)]),
                 MultimodalInput(media=MediaItem(da, 20)), MultimodalInput(release="not callable"),
                 MultimodalInput(embeds=[(20, rows)], release=lambda: released.append(1))]
    malformed[-1].mrope_positions = torch.zeros(3, 60, dtype=torch.long)  # 3-D positions for a 1-D model
    outs = eng.generate([Request(placeholder, GREEDY, mm=m) for m in malformed] + [mm_request(image_a, da)])
    assert all(o.finish_reason == "error" and isinstance(o.error, InvalidRequest) for o in outs[:-1]), outs
    assert outs[-1].output_ids == want_a and released == [1]  # a refused request's release still runs once
    eng.check_invariants()


def test_a_release_callback_that_raises_does_not_lose_the_end_of_its_request(caplog):
    model, tok = build_model("tiny", "float32")
    eng = Engine(model, tok, EngineConfig(page_size=16, num_pages=64))

    def broken():
        raise RuntimeError("a front end's bug")

    mm = MultimodalInput(release=broken)
    outs = eng.generate([Request([5, 6, 7, 8], GREEDY, mm=mm), Request([5, 6, 7, 9], GREEDY)])
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert any("release callback" in r.getMessage() for r in caplog.records)
    eng.check_invariants()


def test_qwen2_vl_language_model_with_3d_positions_matches_its_own_forward():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.15, bos_token_id=0,
                eos_token_id=0, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2)
    def config():
        return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=500, video_token_id=501,
                             vision_start_token_id=502)

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen2VLForConditionalGeneration(config()).eval()
        ref = Qwen2VLForConditionalGeneration(config()).eval()  # its own config: attach() sets the model's
    ref.load_state_dict(model.state_dict())
    eng = Engine(model, None, EngineConfig(page_size=16, num_pages=64, prefill_chunk_tokens=16))
    assert isinstance(eng.adapter, MRopeAdapter)
    prompt = list(range(2, 42))
    pos = torch.arange(40).repeat(3, 1)
    pos[1, 10:26] = 10 + torch.arange(16) // 4  # a 4x4 "image" grid at positions 10..25
    pos[2, 10:26] = 10 + torch.arange(16) % 4
    pos[:, 26:] -= 12
    delta = int(pos.max()) + 1 - 40
    grid = [MediaItem(media_digest(b"grid"), 10)]  # names the pages whose positions differ from a text request's
    out = eng.generate([Request(prompt, GREEDY, mm=MultimodalInput(media=grid, mrope_positions=pos,
                                                                   mrope_delta=delta))])[0]
    seq = prompt + out.output_ids
    full = torch.cat([pos, (torch.arange(40, len(seq)) + delta).repeat(3, 1)], dim=1)
    toks = []
    with torch.no_grad():
        for i in range(len(out.output_ids)):
            n = 40 + i
            logits = ref(input_ids=torch.tensor([seq[:n]]), position_ids=full[:, None, :n]).logits[0, -1]
            toks.append(int(torch.argmax(logits)))
    assert out.output_ids == toks
    plain = eng.generate([prompt], GREEDY)[0].output_ids
    assert plain != out.output_ids  # the 3-D positions were used


def record_logits(eng: Engine) -> list:
    """Every logits tensor the engine's runner returns, in order."""
    out = []
    run = eng.runner.run

    def recording(works):
        out.append(run(works))
        return out[-1]

    eng.runner.run = recording
    return out


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma"])
def test_packed_linears_compute_what_plain_linears_compute(name, monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "tune_malloc", lambda: calls.append(1) or True)
    plain_model, tok = build_model(name, "float32")
    plain = Engine(plain_model, tok, EngineConfig(page_size=16, num_pages=64, compute=ComputeConfig(
        packed_linears=False, tune_malloc=False, layer_kernels=False)))
    assert plain.compute.num_packed_linears == 0 and calls == []
    # the native kernels' paths are named apart
    assert plain.backend.removesuffix("+native-decode") == ATTENTION_BACKEND  # float32: no chunk kernel
    model, _ = build_model(name, "float32")
    fresh = build_model(name, "float32")[0].state_dict()
    packed = Engine(model, tok, EngineConfig(page_size=16, num_pages=64, compute=ComputeConfig(layer_kernels=False)))
    assert calls == [1]
    assert packed.compute.num_packed_linears == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; the head
    assert isinstance(model.model.layers[0].mlp, kernels.PackedGatedMLP)  # SiLU (llama), tanh-GELU (gemma)
    assert packed.backend != plain.backend and packed.fingerprint.model_digest == plain.fingerprint.model_digest
    state = model.state_dict()
    assert state.keys() == fresh.keys() and all(torch.equal(state[k], fresh[k]) for k in fresh)
    rows = {id(plain): record_logits(plain), id(packed): record_logits(packed)}
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 512, size=n).tolist() for n in (7, 40)]
    a, b = plain.generate(prompts, GREEDY), packed.generate(prompts, GREEDY)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    for x, y in zip(rows[id(plain)], rows[id(packed)]):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-5 * float(x.abs().max()))
    kernels.pack_linears(model.model.layers)  # idempotent: nothing is packed twice
    assert packed.compute.num_packed_linears == 2 * 7 + 1


def test_a_model_serves_engines_of_one_compute_path():
    """An engine replaces its model's modules in place (packed linears, the layer kernels' norms), so every
    engine on one model object computes with the same modules: a second engine with the same settings shares
    them, one asking for others is refused with a typed error before anything changes, and a copy of the
    model may take other settings."""
    import copy

    from mmcache.engine import ComputeConfigError

    model, tok = build_model("tiny-qwen2", "float32")
    spare = copy.deepcopy(model)
    plain = ComputeConfig(packed_linears=False, layer_kernels=False)
    first = Engine(model, tok, EngineConfig(page_size=16, num_pages=64, compute=plain))
    prompts = [list(range(5, 45)), list(range(9, 30))]
    before = [o.output_ids for o in first.generate(prompts, GREEDY)]
    same = Engine(model, tok, EngineConfig(page_size=16, num_pages=64, compute=plain))
    assert same.backend == first.backend
    others = [EngineConfig(page_size=16, num_pages=64, compute=ComputeConfig(layer_kernels=False))]
    if native.library() is not None:  # without the kernel, asking for the layer kernels changes nothing
        others.append(EngineConfig(page_size=16, num_pages=64, compute=ComputeConfig(packed_linears=False)))
    for config in others:
        with pytest.raises(ComputeConfigError, match="copy"):
            Engine(model, tok, config)
    modules = {name: type(m) for name, m in model.named_modules()}
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert first.compute.num_packed_linears == 0 and first.compute.num_native_norms == 0
    assert [o.output_ids for o in first.generate(prompts, GREEDY)] == before
    other = Engine(spare, tok, EngineConfig(page_size=16, num_pages=64))  # a copy takes other settings
    assert other.compute.num_packed_linears > 0 and other.backend != first.backend
    assert {name: type(m) for name, m in model.named_modules()} == modules


def test_transformers_builds_no_mask_for_the_paged_backend():
    from transformers.masking_utils import AttentionMaskInterface, create_causal_mask

    model, tok = build_model("tiny", "float32")
    Engine(model, tok, EngineConfig(page_size=16, num_pages=8))
    embeds = torch.zeros(1, 12, model.config.hidden_size)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])  # two packed sequences
    assert create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None, cache=None,
                              position_ids=positions) is None
    # Registered, so code that looks the mask function up by backend name (VLM token-type masks) finds one.
    assert AttentionMaskInterface()[ATTENTION_BACKEND](batch_size=1, q_length=12, kv_length=12) is None


def _small_llama_like(**extra):
    return dict(vocab_size=256, bos_token_id=0, eos_token_id=0, pad_token_id=1, hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=256, initializer_range=0.15, **extra)


@pytest.mark.parametrize("kind", ["qwen2_moe_sliding", "phimoe_sliding", "llama4_chunked"])
def test_windows_kept_in_the_mask_alone_are_refused(kind):
    # These models apply their sliding window or attention chunks only through transformers' mask, which the
    # paged backend does not build: they were accepted and computed with full causal attention (relative logit
    # errors of 1.07, 1.48 and 1.37 against their own forwards on 60 tokens with windows of 16).
    import transformers as tf

    moe = dict(num_experts_per_tok=2)
    make = {
        "qwen2_moe_sliding": lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**_small_llama_like(
            moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, use_sliding_window=True,
            sliding_window=16, max_window_layers=2, **moe))),
        "phimoe_sliding": lambda: tf.PhimoeForCausalLM(tf.PhimoeConfig(**_small_llama_like(
            num_local_experts=4, sliding_window=16, **moe))),
        "llama4_chunked": lambda: tf.Llama4ForCausalLM(tf.Llama4TextConfig(**_small_llama_like(
            intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1, attention_chunk_size=16,
            no_rope_layers=[1, 0], use_qk_norm=False, moe_layers=[], interleave_moe_layer_step=0))),
    }[kind]
    torch.manual_seed(0)
    with pytest.raises(UnsupportedModel, match="sliding window|chunked attention"):
        Engine(make().eval(), None, EngineConfig(page_size=8, num_pages=32))


def test_windows_passed_to_the_attention_are_served_as_the_model_computes_them():
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**_small_llama_like(use_sliding_window=True, sliding_window=16,
                                                                   max_window_layers=1))).eval()
    reference = copy.deepcopy(model)
    eng = Engine(model, None, EngineConfig(page_size=8, num_pages=32))
    rows = record_logits(eng)
    prompt = [(7 * i) % 250 + 2 for i in range(60)]  # longer than the window of layer 1
    out = eng.generate([Request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))])[0]
    with torch.no_grad():
        want = reference(torch.tensor(prompt + out.output_ids)[None]).logits[0, 59:62]
    got = torch.cat([r[-1:] for r in rows])
    assert torch.allclose(got, want, atol=2e-5 * float(want.abs().max()), rtol=0)


def test_a_longrope_model_is_served_up_to_its_original_context():
    # transformers takes the short or long rotary factors for a whole forward from its longest position, so
    # a token's keys depended on the other tokens of its forward: a request's greedy tokens changed with the
    # company it was batched with. Below original_max_position_embeddings the short factors always hold.
    import transformers as tf

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 64}
    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(tf.Phi3Config(**_small_llama_like(original_max_position_embeddings=64,
                                                                  rope_parameters=rope))).eval()
    reference = copy.deepcopy(model)
    eng = Engine(model, None, EngineConfig(page_size=8, num_pages=64, prefill_chunk_tokens=16))
    assert eng.max_model_len == 64
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    short, longer = list(range(2, 22)), [(7 * i) % 250 + 2 for i in range(50)]
    alone = eng.generate([Request(short, params)])[0].output_ids
    together = eng.generate([Request(short, params), Request(longer, params)])
    assert together[0].output_ids == alone
    with torch.no_grad():
        want = reference(torch.tensor(longer + together[1].output_ids)[None]).logits[0, 49:55].argmax(-1)
    assert together[1].output_ids == want.tolist()
    too_long = eng.generate([Request(longer + longer, params)])[0]
    assert isinstance(too_long.error, InvalidRequest) and "max_model_len 64" in str(too_long.error)
    eng.check_invariants()


def test_a_max_model_len_past_what_the_model_serves_is_lowered_with_a_warning(caplog):
    model, tok = build_model("tiny", "float32")
    limit = model.config.max_position_embeddings
    with caplog.at_level("WARNING", logger="mmcache.engine"):
        eng = Engine(model, tok, EngineConfig(page_size=16, num_pages=16, max_model_len=limit + 1))
    assert eng.max_model_len == limit
    assert f"max_model_len {limit + 1} is more than this model serves; using {limit}" in caplog.text
