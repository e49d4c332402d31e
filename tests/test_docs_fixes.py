"""Behaviour the documentation promises: a model whose pad row is zero is served, a partly given session
distribution keeps its key's defaults, explicit benchmark options win over ``--quick``, an export's files have
ordinary permissions, and a subcommand missing from an install says so."""

import json
import os
import sys

import pytest
import torch

from mmcache.engine import ComputeConfig, Engine, EngineConfig, SamplingParams, UnsupportedModel

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest

SMALL = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
             num_key_value_heads=2, max_position_embeddings=256)


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_a_model_whose_pad_embedding_is_zero_is_served(kind):
    # The construction probe ran token 0 through the model: with pad_token_id=0 (nn.Embedding's padding_idx)
    # that row is zero, every layer wrote zero keys and values, and the model was refused as not attending.
    import transformers as tf

    config = (tf.LlamaConfig(pad_token_id=0, **SMALL) if kind == "llama"
              else tf.GemmaConfig(pad_token_id=0, head_dim=16, **SMALL))
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    assert not model.get_input_embeddings().weight[0].any()
    prompt = list(range(2, 40))
    expected = _greedy(model, prompt, 4)
    rng = torch.get_rng_state()
    engine = Engine(model, None, EngineConfig(page_size=16, num_pages=32, compute=ComputeConfig(packed_linears=False)))
    assert torch.equal(torch.get_rng_state(), rng)  # the probe draws from its own generator
    out = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert out.error is None and out.output_ids == expected


def test_a_model_with_convolutional_state_is_still_refused_whatever_its_pad_id():
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Lfm2ForCausalLM(tf.Lfm2Config(layer_types=["conv", "full_attention"], pad_token_id=0,
                                             **SMALL)).eval()
    with pytest.raises(UnsupportedModel, match=r"layer\(s\) \[0\]"):
        Engine(model, None, EngineConfig(page_size=8, num_pages=16))


def test_a_partly_given_distribution_keeps_its_keys_defaults(tmp_path):
    from mmcache.replay.sessions import Dist, MediaParams, load_params

    path = tmp_path / "p.json"
    path.write_text(json.dumps({"turns": {"mean": 20}, "output_tokens": {"kind": "lognormal", "sigma": 0.2},
                                "task_tokens": {"kind": "constant", "mean": 50}, "media": {"probability": 0.5}}))
    params = load_params(path)
    assert params.turns == Dist("lognormal", 20, 0.6, 5, 150)
    assert params.output_tokens == Dist("lognormal", 200, 0.2, 10, 2000)
    assert params.task_tokens == Dist("constant", 50)  # another kind takes only what it names
    assert params.media == MediaParams(probability=0.5, distinct=1, image_tokens=256)


def _parse(module, name, argv):
    from benchmarks.runner import bench_parser

    return bench_parser(name, module).parse_args(argv)


@pytest.mark.parametrize("argv, repeats, tokens", [
    ([], 7, 1 << 20), (["--quick"], 3, 1 << 18),
    (["--quick", "--repeats", "5", "--tokens", "2048"], 5, 2048), (["--quick", "--tokens", "2048"], 3, 2048)])
def test_core_options_given_win_over_quick(monkeypatch, argv, repeats, tokens):
    from benchmarks import core

    seen = {}
    monkeypatch.setattr(core, "bench_naming", lambda t, r: seen.update(tokens=t, naming=r) or {})
    monkeypatch.setattr(core, "bench_lookup", lambda r: {})
    monkeypatch.setattr(core, "bench_evict", lambda r: seen.update(repeats=r) or 0.0)
    monkeypatch.setattr(core, "bench_metadata", lambda: {"traced": 0, "arrays": 0})
    core.run(_parse(core, "core", argv))
    assert seen == {"tokens": tokens, "naming": 3 * repeats, "repeats": repeats}


@pytest.mark.parametrize("argv, expected", [
    ([], (24, 4, 8)), (["--quick"], (6, 2, 4)),
    (["--quick", "--requests", "12", "--negative-repeat", "3", "--max-tokens", "7"], (12, 3, 7)),
    (["--quick", "--max-tokens", "7"], (6, 2, 7))])
def test_cfg_options_given_win_over_quick(monkeypatch, argv, expected):
    from benchmarks import cfg

    class Built(Exception):
        pass

    def engine(args, mode):
        raise Built((args.requests, args.negative_repeat, args.max_tokens))

    monkeypatch.setattr(cfg, "_engine", engine)
    with pytest.raises(Built) as built:
        cfg.run(_parse(cfg, "cfg", argv))
    assert built.value.args[0] == expected


def test_workload_size_help_gives_defaults_and_ranges():
    from benchmarks import prefix, vlm

    text = {name: _help(module, name) for name, module in (("prefix", prefix), ("vlm", vlm))}
    assert "Shape" not in text["prefix"] and "BOUNDS" not in text["vlm"]
    assert "default 9, quick 3; at most 1000" in text["prefix"]  # --probe-repeats
    assert "default 1152:1280, quick 640:768" in text["prefix"]  # --vpc-input-range
    assert "default 4, quick 1; 1 to 4" in text["vlm"]  # --images


def _help(module, name) -> str:
    from benchmarks.runner import bench_parser

    return " ".join(bench_parser(name, module).format_help().split())


def test_an_export_gives_every_file_the_mode_of_an_ordinary_write(tmp_path):
    # safetensors made model.safetensors 0600 while the other files were 0666 less the umask.
    from mmcache.presets.export import export_model

    old = os.umask(0o027)
    try:
        out = export_model("tiny", tmp_path / "out", "float32")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, modes


def test_a_subcommand_missing_from_the_install_says_so(monkeypatch, capsys):
    from mmcache import cli

    monkeypatch.setitem(sys.modules, "benchmarks", None)  # a build without the benchmarks package
    monkeypatch.setitem(sys.modules, "benchmarks.runner", None)
    assert cli.main(["bench", "core", "--json", "x.json"]) == 2
    err = capsys.readouterr().err
    assert "bench is not available in this install" in err and "benchmarks" in err
    assert "not available in this install" in " ".join(cli.build_parser().format_help().split())
    with pytest.raises(SystemExit) as done:
        cli.main(["replay", "--help"])  # the others are there
    assert done.value.code == 0


@pytest.mark.parametrize("name, argv, expected", [
    ("voice", [], (4, 3)), ("voice", ["--quick"], (2, 1)),
    ("voice", ["--quick", "--rounds", "5", "--runs", "2"], (5, 2)),
    ("diffusion", [], (64, 3)), ("diffusion", ["--quick"], (24, 1)),
    ("diffusion", ["--quick", "--requests", "40", "--runs", "2"], (40, 2))])
def test_voice_and_diffusion_options_given_win_over_quick(monkeypatch, name, argv, expected):
    import importlib

    module = importlib.import_module(f"benchmarks.{name}")

    class Sized(Exception):
        pass

    def stop(args):
        raise Sized((args.rounds, args.runs) if name == "voice" else (args.requests, args.runs))

    # The first thing each run builds after sizing itself: stop there.
    monkeypatch.setattr(module, "load_cases" if name == "voice" else "tiny_wan_pipeline", lambda *a, **k: stop(args))
    args = _parse(module, name, argv)
    with pytest.raises(Sized) as sized:
        module.run(args)
    assert sized.value.args[0] == expected
