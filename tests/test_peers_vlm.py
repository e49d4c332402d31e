"""The vLLM peer's VLM side without vLLM: the server's options for a VLM folder, a failed VLM start that names
the torchvision fix, and the torchvision script's edit (idempotent, refusing a layout it does not know)."""

import json

import pytest

from benchmarks.peers import torchvision_python_only as tpo
from benchmarks.peers import vllm_server as vs


def _folder(tmp_path, model_type):
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(folder)


def _value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_a_vlm_folder_gets_the_pil_processor_and_an_image_limit(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_PEER_PYTHON", "/bin/true")  # an executable; nothing is started here
    for kind in vs.VLM_MODEL_TYPES:
        srv = vs.VllmOpenAIServer(_folder(tmp_path, kind), "m", str(tmp_path / "log"), "float32", 32, 1024, 4, 1024,
                                  images_per_prompt=2)
        assert srv.vlm
        assert json.loads(_value(srv.cmd, "--mm-processor-kwargs")) == {"backend": "pil"}
        assert json.loads(_value(srv.cmd, "--limit-mm-per-prompt")) == {"image": 2, "video": 0}
        assert "--chat-template" not in srv.cmd  # vLLM reads the folder's chat_template.jinja
    text = vs.VllmOpenAIServer(_folder(tmp_path, "qwen2"), "m", str(tmp_path / "log"), "float32", 32, 1024, 4, 1024)
    assert not text.vlm and "--limit-mm-per-prompt" not in text.cmd and "--mm-processor-kwargs" not in text.cmd
    forced = vs.VllmOpenAIServer(str(tmp_path / "absent"), "m", str(tmp_path / "log"), "float32", 32, 1024, 4, 1024,
                                 vlm=True, chat_template="t.jinja")
    assert _value(forced.cmd, "--chat-template") == "t.jinja"


@pytest.mark.parametrize("count", [0, -1, 1.5, True, "2"])
def test_a_bad_image_count_is_refused(count):
    with pytest.raises(ValueError, match="images_per_prompt"):
        vs.vlm_options(count)


def test_a_vlm_start_that_fails_on_torchvision_names_the_fix(tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torchvision'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("VLLM_PEER_PYTHON", str(fake))
    srv = vs.VllmOpenAIServer(_folder(tmp_path, "llava"), "m", str(tmp_path / "vllm.log"), "float32", 32, 1024, 4,
                              1024, start_timeout_s=30)
    with pytest.raises(vs.VllmUnavailable, match="exited with 1 \\(its VLM modules need torchvision: run "
                                                 "benchmarks/peers/torchvision_python_only.py"):
        srv.start()
    assert srv.proc is None


REGISTRATIONS = '''import torchvision.extension


@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    pass


@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    pass
'''


def test_the_torchvision_edit_gates_both_fake_kernels_once(tmp_path):
    path = tmp_path / "_meta_registrations.py"
    path.write_text(REGISTRATIONS)
    assert tpo.patch(path)
    edited = path.read_text()
    for op in tpo.FAKE_KERNELS:
        assert (f'@(torch.library.register_fake("{op}") if torchvision.extension._has_ops() else (lambda fn: fn))'
                f"  {tpo.MARK}\n") in edited
    assert edited.count(tpo.MARK) == 2 and "def meta_nms" in edited
    assert not tpo.patch(path)  # a second run changes nothing
    assert path.read_text() == edited
    compile(edited, str(path), "exec")


def test_the_torchvision_edit_refuses_a_layout_it_does_not_know(tmp_path):
    path = tmp_path / "_meta_registrations.py"
    path.write_text(REGISTRATIONS.replace('"torchvision::qnms"', "'torchvision::qnms'"))
    with pytest.raises(tpo.PeerSetupError, match="does not hold the line"):
        tpo.patch(path)
    assert "mmcache" not in path.read_text()  # nothing written


def test_only_known_torch_releases_get_a_torchvision(monkeypatch):
    monkeypatch.setattr(tpo.importlib.metadata, "version", lambda name: "2.13.0+cpu")
    assert tpo.matching_torchvision() == "0.28.0"
    monkeypatch.setattr(tpo.importlib.metadata, "version", lambda name: "2.99.0")
    with pytest.raises(tpo.PeerSetupError, match="no matching torchvision"):
        tpo.matching_torchvision()


def test_the_first_turn_check_refuses_bad_arguments_before_starting_anything(tmp_path, capsys):
    from benchmarks.peers import vlm_first_turn as ft

    for argv, said in ((["--model", str(tmp_path)], "holds no config.json"),
                       (["--model", str(tmp_path), "--max-tokens", "0"], "--max-tokens must be at least 1"),
                       (["--model", str(tmp_path), "--images", "9"], "invalid choice"),
                       (["--model", str(tmp_path), "--dtypes", "float16"], "invalid choice")):
        with pytest.raises(SystemExit) as e:
            ft.main(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err
    assert len(ft.questions(2)) == 2 and ft.photo_url(ft.PHOTOS[0]).startswith("data:image/png;base64,")
