"""Shared test settings: deterministic torch, a bounded hypothesis profile, the repository's data folder."""

import io
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from transformers.utils import logging as transformers_logging

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
# transformers' log handler writes to the stderr of its first use: set it up now, not inside a test capturing
# stderr, whose stream closes with the test (later warnings would print "--- Logging error ---" tracebacks)
transformers_logging.get_logger("transformers")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def datasets_dir() -> Path:
    return REPO / "datasets"


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``): the tiny
    models gain nothing from intra-op threads, and on a shared 2-core machine they lose a lot."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def photo_crops(datasets_dir):
    """``fn(names)`` -> two crops (the top-left and bottom-right two thirds) of each named photo in
    ``datasets/images``, as PNG bytes: distinct real images."""
    from PIL import Image

    def fn(names) -> list[bytes]:
        out = []
        for name in names:
            image = Image.open(datasets_dir / "images" / name).convert("RGB")
            w, h = image.size
            for box in ((0, 0, w * 2 // 3, h * 2 // 3), (w // 3, h // 3, w, h)):
                buf = io.BytesIO()
                image.crop(box).save(buf, format="PNG")
                out.append(buf.getvalue())
        return out

    return fn


class Traffic:
    """Random-traffic bookkeeping for one engine: ``fail_next_forward()`` makes its next forward raise;
    ``take(events)`` records streamed tokens and each request's end, failing if a request ends twice or streams
    after its end."""

    def __init__(self, engine):
        self.finished: dict = {}
        self.tokens: dict = {}
        self._fail = False
        run = engine.runner.run

        def flaky(works):
            if self._fail:
                self._fail = False
                raise RuntimeError("injected failure")
            return run(works)

        engine.runner.run = flaky

    def fail_next_forward(self) -> None:
        self._fail = True

    def take(self, events) -> None:
        for ev in events:
            assert ev.request_id not in self.finished, f"{ev.request_id} ended twice or streamed after its end"
            if ev.finished:
                self.finished[ev.request_id] = ev.output
            else:
                self.tokens.setdefault(ev.request_id, []).append(ev.token_id)


@pytest.fixture
def traffic():
    """``traffic(engine)`` -> a ``Traffic`` wired into that engine's forwards."""
    return Traffic


@pytest.fixture
def tower_calls():
    """``count(vlm)`` -> a list that grows by one per forward of a VLM engine's vision tower; the hooks go when
    the test ends (the presets' models are shared by a module's tests)."""
    handles = []

    def count(vlm) -> list:
        calls = []
        handles.append(vlm.tower.register_forward_hook(lambda *_: calls.append(1)))
        return calls

    yield count
    for handle in handles:
        handle.remove()


@pytest.fixture(scope="session")
def hf_vlm_logits():
    """``fn(preset, token_ids, image_bytes, model=None)``: logits of the VLM's own forward from pixel values (its
    processor, its placeholder scatter, its positions); ``model`` defaults to the preset's."""
    from encoders.media import decode_image, read_image

    def fn(preset, token_ids, image_bytes, model=None):
        model = preset.model if model is None else model
        ids = torch.tensor([token_ids])
        batch = preset.image_processor(images=[decode_image(read_image(b)) for b in image_bytes], return_tensors="pt")
        with torch.no_grad():
            if preset.name == "tiny-qwen2-vl":
                types = (ids == model.config.image_token_id).int()
                return model(input_ids=ids, pixel_values=batch["pixel_values"],
                             image_grid_thw=batch["image_grid_thw"], mm_token_type_ids=types).logits[0]
            return model(input_ids=ids, pixel_values=batch["pixel_values"]).logits[0]

    return fn


def _require_native_kernel(monkeypatch):
    """``MMCACHE_NATIVE=require`` for the test, and the loaded kernel; a skip, with the reason, only where the
    kernel cannot be built (no C compiler, neither AVX-512 nor AVX2). That is never the case on the development
    and CI machines: ``test_native_decode.py::test_the_kernel_builds_where_the_machine_can_run_it`` fails there
    instead of skipping, so a kernel that stops building cannot hide behind these skips."""
    from mmcache.engine.compute import native

    monkeypatch.setenv(native.ENV_CHOICE, "require")
    try:
        return native.library()
    except native.NativeKernelUnavailable as exc:
        pytest.skip(f"the decode kernel cannot be built here: {exc}")


@pytest.fixture
def native_kernel(monkeypatch):
    """The compiled decode kernel (see ``_require_native_kernel``)."""
    return _require_native_kernel(monkeypatch)


@pytest.fixture(params=["native", "aten"])
def decode_path(request, monkeypatch):
    """Runs a test once on the compiled decode kernel (``mmcache.engine.compute.native``) and once on ATen's flash
    attention (``MMCACHE_NATIVE=off``)."""
    if request.param == "aten":
        monkeypatch.setenv("MMCACHE_NATIVE", "off")
    else:
        _require_native_kernel(monkeypatch)
    return request.param


@pytest.fixture(scope="module")
def wan():
    """The tiny Wan text-to-video pipeline (mmcache.presets.diffusion), one per module, progress bars off."""
    from mmcache.presets.diffusion import tiny_wan_pipeline

    pipe = tiny_wan_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def sd3():
    """The tiny Stable Diffusion 3 text-to-image pipeline, one per module, progress bars off."""
    from mmcache.presets.diffusion import tiny_sd3_pipeline

    pipe = tiny_sd3_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


# The skip guard (tests/skips.py): every skip of the run must be one this machine is expected to take.
_skipped: list = []


def pytest_runtest_logreport(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        _skipped.append((report.nodeid, report.longrepr[2].removeprefix("Skipped: ")))


def pytest_sessionfinish(session, exitstatus):
    from skips import Machine, unexpected

    machine = Machine.here()
    wrong = [(nodeid, reason, why) for nodeid, reason in _skipped if (why := unexpected(reason, machine))]
    if not wrong:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(wrong)} skip(s) this machine should not take ({machine}):"]
    lines += [f"  {nodeid}: {reason!r}: {why}" for nodeid, reason, why in wrong]
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True)
    else:
        print("\n".join(lines), file=sys.stderr)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
