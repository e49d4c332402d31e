"""Voice cloning: reference audio read and decoded (encoders/audio.py), the codec's encode served through the
store (encoders/codec.py) inside transformers' CSM pipeline, and the voice benchmark's stream and figures."""

import base64
import io
import types

import numpy as np
import pytest
import soundfile
import torch

from benchmarks import voice
from encoders.audio import AudioLimits, RawAudio, decode_audio, ogg_unended, read_audio
from encoders.codec import CachedCodecEncode
from encoders.media import SOURCE_BYTES, SOURCE_DATA_URL, SOURCE_PATH, MediaRef
from encoders.voice import SAMPLING_RATE, voice_prompt
from mmcache.presets.tts import csm_pipeline
from mmcache.errors import InvalidRequest, MediaDecodeError
from mmcache.store import EncoderOutputStore

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(scope="module")
def cases():
    return voice.load_cases()


@pytest.fixture(scope="module")
def pipe():
    return csm_pipeline(codec="tiny")


def wav(samples: np.ndarray, rate: int = SAMPLING_RATE, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="WAV", subtype=subtype)
    return buf.getvalue()


def tone(seconds: float, rate: int = SAMPLING_RATE, freq: float = 220.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


TRUSTED = AudioLimits(allow_paths=True)  # the tests read the dataset's clips by path


def inputs(pipe, case):
    wave = decode_audio(read_audio(case.reference_wav, limits=TRUSTED), SAMPLING_RATE)
    return pipe.processor(text=[voice_prompt(case.reference_text, case.target_text)], audio=[wave],
                          return_tensors="pt", sampling_rate=SAMPLING_RATE)


def codec_runs(codec) -> list:
    """Counts the codec's encoder forwards with a hook, independently of the wrapper's own count."""
    runs = []
    codec.encoder.register_forward_hook(lambda *a: runs.append(1))
    return runs


# ---- reading and decoding reference audio -----------------------------------------------------------
def test_every_source_kind_yields_the_bytes_as_sent_and_the_same_waveform(cases, tmp_path):
    path = cases[0].reference_wav
    data = path.read_bytes()
    url = "data:audio/wav;base64," + base64.b64encode(data).decode()
    for kind, source in {SOURCE_BYTES: data, SOURCE_PATH: str(path), SOURCE_DATA_URL: url}.items():
        raw = read_audio(source, index=2, limits=TRUSTED)
        assert raw.data == data and raw.ref == MediaRef(2, kind, "audio")
    wave = decode_audio(read_audio(path, limits=TRUSTED), SAMPLING_RATE)
    want, rate = soundfile.read(path, dtype="float32")
    assert rate == SAMPLING_RATE and wave.dtype == np.float32 and np.array_equal(wave, want)


@pytest.mark.parametrize("data, reason", [
    (b"", "empty"),
    (b"RIFF\x00\x00\x00\x00WAVEjunk", "not a readable audio file"),
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 64, "not a readable audio file"),
])
def test_corrupt_or_empty_bytes_raise_media_decode_error(data, reason):
    with pytest.raises(MediaDecodeError, match=reason) as e:
        decode_audio(read_audio(data, index=4), SAMPLING_RATE)
    assert e.value.item == MediaRef(4, SOURCE_BYTES, "audio") and "audio #4" in str(e.value)


def test_truncated_files_are_refused_not_shortened():
    # libsndfile decodes a WAV cut short to the frames it still holds, and says so only in its log.
    data = wav(tone(0.1))
    assert len(decode_audio(read_audio(data), SAMPLING_RATE)) == 2400
    for cut in (data[:-1], data[:len(data) // 2]):
        with pytest.raises(MediaDecodeError, match="truncated WAV: its data chunk declares 4800 bytes"):
            decode_audio(read_audio(cut), SAMPLING_RATE)
    at = data.index(b"data") + 4  # a streaming writer's unknown length: the data runs to the end of the file
    streamed = data[:at] + (0xFFFFFFFF).to_bytes(4, "little") + data[at + 4:]
    assert np.array_equal(decode_audio(read_audio(streamed), SAMPLING_RATE), decode_audio(read_audio(data),
                                                                                           SAMPLING_RATE))
    aiff = io.BytesIO()  # libsndfile shortens a cut AIFF silently too: outside the default formats
    soundfile.write(aiff, tone(0.1), SAMPLING_RATE, format="AIFF")
    with pytest.raises(MediaDecodeError, match=r"container AIFF is not accepted \(accepted: WAV, FLAC, OGG\)"):
        decode_audio(read_audio(aiff.getvalue()), SAMPLING_RATE)
    assert len(decode_audio(read_audio(aiff.getvalue()), SAMPLING_RATE, AudioLimits(formats=("AIFF",)))) == 2400
    flac = io.BytesIO()
    soundfile.write(flac, tone(0.1), SAMPLING_RATE, format="FLAC")
    with pytest.raises(MediaDecodeError):
        decode_audio(read_audio(flac.getvalue()[:len(flac.getvalue()) // 2]), SAMPLING_RATE)


@pytest.mark.parametrize("subtype", ["VORBIS", "OPUS"])
def test_an_ogg_file_cut_short_is_refused_not_shortened(subtype):
    # An Ogg file declares no length before its last page: cut at a page boundary or inside a page, libsndfile
    # decoded the pages it held (or fewer samples), as if the clip were shorter.
    # (libsndfile decoded 85,376 of the 120,000 samples of this Vorbis clip cut at its last page, 117,444 of
    # the Opus one.)
    buf = io.BytesIO()
    soundfile.write(buf, tone(5.0), SAMPLING_RATE, format="OGG", subtype=subtype)
    data = buf.getvalue()
    whole = decode_audio(read_audio(data), SAMPLING_RATE)
    assert len(whole) == 120000 and ogg_unended(data) is None
    last_page = data.rindex(b"OggS")
    middle_page = data.index(b"OggS", len(data) // 2)
    for cut, why in ((data[:last_page], "without their end-of-stream page"), (data[:last_page + 40], "runs past"),
                     (data[:-1], "runs past"), (data[:middle_page], "without their end-of-stream page"),
                     (data + b"\0" * 7, "not a whole Ogg page header")):
        with pytest.raises(MediaDecodeError, match=f"truncated OGG: .*{why}"):
            decode_audio(read_audio(cut), SAMPLING_RATE)
    assert ogg_unended(wav(tone(0.1))) is None  # other formats are not walked


def test_another_sample_rate_is_resampled_and_one_above_the_limit_refused():
    # was refused ("sampled at 16000 Hz; the encoder takes 24000 Hz"); tests/test_audio_resample.py covers it
    assert len(decode_audio(read_audio(wav(tone(0.5, 16000), 16000)), SAMPLING_RATE)) == 12000
    with pytest.raises(MediaDecodeError, match="96000 Hz, above the limit of 48000 Hz"):
        decode_audio(read_audio(wav(tone(0.1, 96000), 96000)), SAMPLING_RATE)


def test_duration_and_byte_limits_apply_before_decoding(monkeypatch):
    data = wav(tone(2.0))
    with pytest.raises(MediaDecodeError, match="exceed the limit of 1.5 s"):
        decode_audio(read_audio(data), SAMPLING_RATE, AudioLimits(max_seconds=1.5))
    assert len(decode_audio(read_audio(data), SAMPLING_RATE, AudioLimits(max_seconds=2.0))) == 48000
    with pytest.raises(MediaDecodeError, match="exceed the limit"):
        read_audio(data, limits=AudioLimits(max_bytes=1000))


def test_channels_are_averaged_and_non_finite_samples_refused():
    left, right = tone(0.2), tone(0.2, freq=330.0)
    wave = decode_audio(read_audio(wav(np.stack([left, right], axis=1), subtype="FLOAT")), SAMPLING_RATE)
    np.testing.assert_array_equal(wave, np.stack([left, right], axis=1).mean(axis=1, dtype=np.float32))
    # Float samples near float32's largest are finite, so their mean is too (a float32 sum overflowed to inf).
    loud = np.full((2400, 2), 3e38, dtype=np.float32)
    np.testing.assert_array_equal(decode_audio(read_audio(wav(loud, subtype="FLOAT")), SAMPLING_RATE),
                                  np.full(2400, 3e38, dtype=np.float32))
    bad = tone(0.2)
    bad[10] = np.nan
    with pytest.raises(MediaDecodeError, match="non-finite"):
        decode_audio(read_audio(wav(bad, subtype="FLOAT")), SAMPLING_RATE)


def test_source_policy_and_bad_arguments(cases, tmp_path):
    with pytest.raises(MediaDecodeError, match="not accepted"):
        read_audio(str(cases[0].reference_wav), limits=AudioLimits(allow_paths=False))
    with pytest.raises(MediaDecodeError, match="no readable audio file at this path inside the folder"):
        read_audio(str(cases[0].reference_wav), limits=AudioLimits(path_root=tmp_path))
    with pytest.raises(MediaDecodeError, match="remote URLs"):
        read_audio("https://example.com/voice.wav")
    with pytest.raises(MediaDecodeError, match="not an audio type"):
        read_audio("data:image/png;base64,AAAA")
    with pytest.raises(MediaDecodeError, match="must be bytes"):
        read_audio(12)
    for bad in ({"max_seconds": 0}, {"max_seconds": float("nan")}, {"max_bytes": -1}, {"allow_paths": "yes"},
                {"max_channels": 0}):
        with pytest.raises(InvalidRequest):
            AudioLimits(**bad)
    with pytest.raises(InvalidRequest):
        decode_audio(b"RIFF", SAMPLING_RATE)  # bytes, not a RawAudio
    with pytest.raises(InvalidRequest):
        decode_audio(RawAudio(b"x", MediaRef(0, SOURCE_BYTES, "audio")), 0)
    for data in (12, None, "RIFF"):  # a RawAudio built by hand with the wrong type of data (was a TypeError)
        with pytest.raises(InvalidRequest, match="RawAudio.data must be bytes"):
            decode_audio(RawAudio(data, MediaRef(0, SOURCE_BYTES, "audio")), SAMPLING_RATE)
    with pytest.raises(InvalidRequest):
        read_audio(b"RIFF", limits=None)
    with pytest.raises(MediaDecodeError, match="host"):
        read_audio("file://elsewhere" + str(cases[0].reference_wav))
    assert read_audio("file://localhost" + str(cases[0].reference_wav), limits=TRUSTED).data == \
        cases[0].reference_wav.read_bytes()
    with pytest.raises(MediaDecodeError, match="not valid text"):
        read_audio("data:audio/wav,\udc80")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(MediaDecodeError):
        read_audio(str(loop), limits=AudioLimits(path_root=tmp_path))


def test_channels_beyond_the_limit_are_refused_before_decoding():
    # Eight channels of silence compress to almost nothing, and decode to eight float32 streams.
    data = wav(np.zeros((24000, 8), dtype=np.float32), subtype="FLOAT")
    with pytest.raises(MediaDecodeError, match="8 channels exceed the limit of 2"):
        decode_audio(read_audio(data), SAMPLING_RATE)
    assert decode_audio(read_audio(data), SAMPLING_RATE, AudioLimits(max_channels=8)).shape == (24000,)


# ---- the codec through the store ----------------------------------------------------------------------
def test_interruptible_checks_before_every_backbone_layer_and_leaves_no_hook(pipe):
    layers = pipe.model.backbone_model.layers
    hooks = [len(layer._forward_pre_hooks) for layer in layers]
    prompt = pipe.processor(text=[voice_prompt("A reference.", "Hello.")], audio=[tone(0.5)], return_tensors="pt",
                            sampling_rate=SAMPLING_RATE)
    checks = []
    with pipe.interruptible(lambda: checks.append(1)), torch.no_grad():
        pipe.model.generate(**prompt, max_new_tokens=2, do_sample=False)
    assert len(checks) == 2 * len(layers)  # the prefill's forward and the second frame's, each layer once

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    forwards = []
    counter = layers[0].register_forward_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(Stop), pipe.interruptible(stop), torch.no_grad():
            pipe.model.generate(**prompt, max_new_tokens=2, do_sample=False)
    finally:
        counter.remove()
    assert forwards == []  # stopped before the prefill's first layer
    assert [len(layer._forward_pre_hooks) for layer in layers] == hooks  # removed on every way out
    assert pipe.context_length == pipe.model.config.max_position_embeddings == 2048


def test_csm_outputs_are_bit_identical_and_each_reference_is_encoded_once(pipe, cases):
    # Four requests over two references, store off then on, through CSM's own generate.
    stream = [cases[0], cases[2], cases[1], cases[3]]
    assert len({c.reference_wav for c in stream}) == 2
    runs = codec_runs(pipe.codec)
    outputs = {}
    for store in (None, EncoderOutputStore(2**24)):
        before = len(runs)
        with CachedCodecEncode(pipe.codec, store) as enc, torch.inference_mode():
            outputs[store is None] = [pipe.model.generate(**inputs(pipe, c), max_new_tokens=2, do_sample=False,
                                                          output_audio=True, return_dict_in_generate=True)
                                      for c in stream]
        assert enc.calls == len(runs) - before
        if store is None:
            assert enc.calls == 4 and enc.hits == 0
        else:
            assert enc.calls == 2 and enc.hits == 2 and len(store) == 2
            store.check_invariants()
            assert all(store.held(k) == 0 for k in list(store._entries))
    for off, on in zip(outputs[True], outputs[False]):
        assert torch.equal(off.sequences, on.sequences) and torch.equal(off.audio[0], on.audio[0])
    assert "encode" not in pipe.codec.__dict__  # detached: the class's own encode again


def test_the_seeded_codec_gives_codes_that_depend_on_the_audio(pipe, cases):
    # Mimi's codebooks are zero after a random initialization (every code 0); the preset draws them.
    with torch.no_grad():
        a, b = (type(pipe.codec).encode(pipe.codec, inputs(pipe, c)["input_values"]).audio_codes
                for c in (cases[0], cases[2]))
    assert a.unique().numel() > 100 and not torch.equal(a[..., :20], b[..., :20])


def test_generated_frames_hold_only_codes_the_codec_decodes(pipe, cases):
    # Random heads would pick CSM's padding/end ids (2048-2050) inside frames, which Mimi cannot decode.
    with torch.inference_mode():
        for case in cases[:4]:
            out = pipe.model.generate(**inputs(pipe, case), max_new_tokens=12, do_sample=False, output_audio=True,
                                      return_dict_in_generate=True)
            assert int(out.sequences.max()) < pipe.codec.config.codebook_size and out.audio[0].numel() > 0


def test_keys_name_the_samples_the_settings_and_the_weights(pipe):
    enc = CachedCodecEncode(pipe.codec, EncoderOutputStore(2**20))
    x = torch.from_numpy(tone(0.5))[None, None]
    k = enc.key(x)
    assert enc.key(x.clone()) == k
    y = x.clone()
    y[0, 0, 100] += 1e-3
    assert enc.key(y) != k
    assert enc.key(x, num_quantizers=8) != k
    with pytest.raises(InvalidRequest, match="cast the waveform"):
        enc.key(x.double())  # the codec's convolution would refuse it
    with torch.autocast("cpu", dtype=torch.bfloat16):  # another computation: another key
        assert enc.key(x) != k and enc.key(x.double()) not in (k, enc.key(x))
    assert enc.key(x, padding_mask=torch.ones(1, 1, x.shape[-1], dtype=torch.long)) != k
    assert enc.key(x, salt="tenant-b") != k
    with enc.salted("tenant-b"):
        assert enc.key(x) == enc.key(x, salt="tenant-b")
    other = csm_pipeline(codec="tiny", seed=1)
    assert CachedCodecEncode(other.codec, None).fingerprint != enc.fingerprint


def test_new_weights_between_attaches_never_meet_old_entries(pipe):
    store = EncoderOutputStore(2**20)
    x = torch.from_numpy(tone(0.4))[None, None]
    codec = csm_pipeline(codec="tiny").codec  # its own copy: the weights change below
    enc = CachedCodecEncode(codec, store)
    with enc:
        before = codec.encode(x).audio_codes
    fresh = csm_pipeline(codec="tiny", seed=1).codec
    codec.load_state_dict(fresh.state_dict())
    # Mimi's codebooks cache their centroids at first use and never again: the adapter drops that cache when
    # it sees new weights, or the codes filed under the new weights' key were the old centroids' (all differed)
    with enc:
        after = codec.encode(x).audio_codes
    with torch.no_grad():
        truth = type(fresh).encode(fresh, x).audio_codes
    assert enc.hits == 0 and enc.calls == 2 and len(store) == 2
    assert torch.equal(after, truth) and not torch.equal(before, truth)
    with CachedCodecEncode(fresh, store) as other:  # another instance of the new weights hits that entry
        assert torch.equal(fresh.encode(x).audio_codes, truth) and other.hits == 1
    off = csm_pipeline(codec="tiny").codec
    with CachedCodecEncode(off, None):  # the store-off path drops it too: on and off stay equal
        off.encode(x)
        off.load_state_dict(fresh.state_dict())
        assert torch.equal(off.encode(x).audio_codes, truth)


def test_the_encoders_own_attention_kernel_is_keyed():
    # Mimi's encoder runs on a copy of the encoder config, whose kernel is set apart from the codec's config:
    # the key followed only the codec's, so eager codes were served sdpa ones (they differ in the last bits of
    # the latents, and so in codes near a codebook boundary).
    x = torch.from_numpy(tone(0.4))[None, None]
    codec = csm_pipeline(codec="tiny").codec
    assert codec.encoder.config is not codec.config.encoder_config
    enc = CachedCodecEncode(codec, EncoderOutputStore(2**20))
    sdpa = enc.key(x)
    codec.encoder.set_attn_implementation("eager")
    assert codec.encoder.config._attn_implementation == "eager" and codec.config._attn_implementation == "sdpa"
    assert enc.key(x) != sdpa  # seen at the next call, without refresh or attach
    codec.encoder.set_attn_implementation("sdpa")
    assert enc.key(x) == sdpa


def test_weights_replaced_through_data_are_seen_and_refresh_covers_writes_through_it():
    store = EncoderOutputStore(2**20)
    x = torch.from_numpy(tone(0.4))[None, None]
    codec = csm_pipeline(codec="tiny").codec
    other = dict(csm_pipeline(codec="tiny", seed=1).codec.named_parameters())
    enc = CachedCodecEncode(codec, store)
    with enc:
        codec.encode(x)
        for name, p in codec.named_parameters():  # new storage behind the same Parameter objects
            p.data = other[name].data.clone()
        codec.encode(x)
        assert enc.calls == 2 and enc.hits == 0
        for name, p in codec.named_parameters():  # written through .data: no version bump, so say so
            p.data.copy_(other[name].data * 0.5)
        enc.refresh()
        codec.encode(x)
        assert enc.calls == 3 and enc.hits == 0


def test_a_call_carrying_an_empty_cache_object_passes_through(pipe):
    from transformers import DynamicCache

    store = EncoderOutputStore(2**20)
    x = torch.from_numpy(tone(0.2))[None, None]
    with CachedCodecEncode(pipe.codec, store) as enc, torch.no_grad():
        pipe.codec.encode(x, encoder_cache=DynamicCache())  # falsy, but streaming state all the same
    assert enc.passthrough == 1 and len(store) == 0


def test_the_full_quantizer_count_and_none_share_one_key(pipe):
    enc = CachedCodecEncode(pipe.codec, None)
    x = torch.from_numpy(tone(0.3))[None, None]
    assert enc.key(x) == enc.key(x, num_quantizers=32) == enc.key(x, num_quantizers=np.int64(32))
    assert enc.key(x, num_quantizers=8) != enc.key(x)


def test_calls_the_store_cannot_serve_pass_through(pipe, monkeypatch):
    store = EncoderOutputStore(2**20)
    x = torch.from_numpy(tone(0.2))[None, None]
    with CachedCodecEncode(pipe.codec, store) as enc, torch.no_grad():
        out = pipe.codec(x)  # MimiModel.forward calls encode with a positional cache argument
        assert out.audio_codes is not None and enc.passthrough == 1
        monkeypatch.setattr(pipe.codec.encoder.config, "output_hidden_states", True)  # the encoder's own copy
        assert pipe.codec.encode(x).hidden_states is not None and enc.passthrough == 2
        monkeypatch.undo()
        monkeypatch.setattr(pipe.codec.config, "return_dict", False)
        assert isinstance(pipe.codec.encode(x), tuple) and enc.passthrough == 3
    assert len(store) == 0


def test_detach_puts_back_an_earlier_instance_patch(pipe):
    def mine(*a, **k):
        return "patched"

    pipe.codec.encode = mine
    try:
        with CachedCodecEncode(pipe.codec, None):
            assert isinstance(pipe.codec.__dict__["encode"], CachedCodecEncode)
        assert pipe.codec.__dict__["encode"] is mine
    finally:
        del pipe.codec.encode


def test_returned_codes_are_copies_and_hits_equal_misses(pipe):
    store = EncoderOutputStore(2**20)
    x = torch.from_numpy(tone(0.4))[None, None]
    with CachedCodecEncode(pipe.codec, store) as enc:
        first = pipe.codec.encode(x).audio_codes
        first.zero_()
        second = pipe.codec.encode(x).audio_codes
    assert enc.hits == 1 and enc.calls == 1
    with torch.no_grad():
        assert torch.equal(second, type(pipe.codec).encode(pipe.codec, x).audio_codes)


@pytest.mark.parametrize("bad", [
    np.zeros((1, 1, 100), dtype=np.float32),  # not a tensor
    torch.zeros(1, 100),  # no channel axis
    torch.zeros(1, 1, 100, dtype=torch.int16),  # not floating point
    torch.zeros(1, 2, 100),  # Mimi is mono
    torch.zeros(1, 1, 0),  # no samples
    torch.zeros(1, 1, 100, dtype=torch.float64),  # another dtype than the codec's (the convolution raised)
    torch.zeros(1, 1, 100, dtype=torch.bfloat16),
])
def test_bad_input_is_refused_before_anything_runs_or_is_stored(pipe, bad):
    store = EncoderOutputStore(2**20)
    runs = codec_runs(pipe.codec)
    with CachedCodecEncode(pipe.codec, store) as enc, pytest.raises(InvalidRequest):
        pipe.codec.encode(bad)
    assert not runs and enc.calls == 0 and len(store) == 0
    x = torch.from_numpy(tone(0.2))[None, None]
    for kw in ({"num_quantizers": 0}, {"num_quantizers": 33}, {"num_quantizers": True},
               {"padding_mask": torch.ones(2, 1, 7)}):
        with CachedCodecEncode(pipe.codec, store), pytest.raises(InvalidRequest):
            pipe.codec.encode(x, **kw)
    assert len(store) == 0


def test_a_failing_encode_stores_and_holds_nothing(pipe, monkeypatch):
    store = EncoderOutputStore(2**20)
    x = torch.from_numpy(tone(0.2))[None, None]

    def broken(*a, **k):
        raise RuntimeError("codec down")

    monkeypatch.setattr(pipe.codec.encoder, "forward", broken)
    with CachedCodecEncode(pipe.codec, store), pytest.raises(RuntimeError, match="codec down"):
        pipe.codec.encode(x)
    assert len(store) == 0 and not store._computing
    monkeypatch.undo()
    with CachedCodecEncode(pipe.codec, store) as enc:
        pipe.codec.encode(x)
    assert enc.calls == 1 and len(store) == 1


def test_other_calls_pass_through_and_wrong_setups_are_refused(pipe):
    store = EncoderOutputStore(2**20)
    x = torch.from_numpy(tone(0.2))[None, None]
    with CachedCodecEncode(pipe.codec, store) as enc, torch.no_grad():
        out = pipe.codec.encode(x, return_dict=False)  # not the plain call: the codec runs, nothing is stored
        assert isinstance(out, tuple) and enc.passthrough == 1 and len(store) == 0
        with pytest.raises(InvalidRequest, match="already"):
            CachedCodecEncode(pipe.codec, store).attach()
    with pytest.raises(InvalidRequest, match="MimiModel"):
        CachedCodecEncode(torch.nn.Linear(2, 2), store)
    with pytest.raises(InvalidRequest, match="store"):
        CachedCodecEncode(pipe.codec, {})
    with pytest.raises(InvalidRequest):
        voice_prompt("transcript", "  ")
    for injected in ("<|AUDIO|>", "<|audio_eos|>", "<|endoftext|>[3]"):
        with pytest.raises(InvalidRequest, match="special token"):
            voice_prompt(f"transcript {injected}", "text")
        with pytest.raises(InvalidRequest, match="special token"):
            voice_prompt("transcript", f"text {injected}")


def test_salts_are_per_call_two_salts_share_nothing_and_one_salt_hits(pipe):
    store = EncoderOutputStore(2**22)
    x = torch.from_numpy(tone(0.3))[None, None]
    runs = codec_runs(pipe.codec)
    with CachedCodecEncode(pipe.codec, store) as enc, torch.no_grad():
        with enc.salted("tenant-a"):
            a = pipe.codec.encode(x).audio_codes
        with enc.salted(b"tenant-b"):
            b = pipe.codec.encode(x).audio_codes  # the same clip under another salt: a miss, not a hit
        assert (enc.calls, enc.hits, len(store), len(runs)) == (2, 0, 2, 2)
        with enc.salted("tenant-a"):
            again = pipe.codec.encode(x).audio_codes
        assert (enc.calls, enc.hits) == (2, 1) and torch.equal(a, again) and torch.equal(a, b)
        assert enc.salt == b""  # outside every block: no salt, a third key
        pipe.codec.encode(x)
        assert (enc.calls, enc.hits, len(store)) == (3, 1, 3)
        for bad in (5, "\ud800", "x" * 10_000):
            with pytest.raises(InvalidRequest, match="salt"):
                with enc.salted(bad):
                    pass
    assert {enc.key(x, salt=s) for s in ("tenant-a", "tenant-b", "")} == set(store._entries)
    store.check_invariants()


def test_two_threads_with_two_salts_on_one_attached_codec_each_get_their_own(pipe):
    import threading

    store = EncoderOutputStore(2**22)
    x = torch.from_numpy(tone(0.25, freq=330.0))[None, None]
    both_set = threading.Barrier(2)
    seen, errors = {}, []

    def request(salt: str) -> None:
        try:
            with enc.salted(salt), torch.no_grad():
                both_set.wait(timeout=30)  # each thread set its salt before either encodes
                seen[salt] = (enc.salt, enc.key(x))
                pipe.codec.encode(x)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    with CachedCodecEncode(pipe.codec, store) as enc:
        threads = [threading.Thread(target=request, args=(s,)) for s in ("left", "right")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert not errors
    assert seen["left"] == (b"left", enc.key(x, salt="left")) and seen["right"] == (b"right", enc.key(x, salt="right"))
    assert set(store._entries) == {enc.key(x, salt="left"), enc.key(x, salt="right")} and enc.hits == 0


# ---- the benchmark ------------------------------------------------------------------------------------
def test_cases_and_stream(cases, tmp_path):
    assert len(cases) == 10 and len({c.reference_wav for c in cases}) == 5
    assert all(c.reference_wav.is_file() and c.target_text for c in cases)
    s = voice.voice_stream(cases, 3, seed_=7)
    assert len(s) == 30 and s == voice.voice_stream(cases, 3, seed_=7) and s != voice.voice_stream(cases, 3, 8)
    assert sorted(c.utt_id for c in s) == sorted(c.utt_id for c in cases * 3)
    (tmp_path / "meta.lst").write_text("a|b|c\n")
    with pytest.raises(voice.VoiceDataMissing, match="4 '|'-separated"):
        voice.load_cases(tmp_path)
    with pytest.raises(voice.VoiceDataMissing):
        voice.load_cases(tmp_path / "absent")


def test_benchmark_run_reports_calls_identity_and_its_table(pipe, monkeypatch):
    monkeypatch.setattr(voice, "csm_pipeline", lambda codec: pipe)
    args = types.SimpleNamespace(quick=False, rounds=1, runs=1, frames=1, codec="tiny", threads=1, seed=0,
                                 no_estimate=False)  # the FLOP estimate needs the published codec: skipped, said
    r = voice.run(args)
    assert r["stream"] == {"requests": 10, "unique_references": 5}
    assert r["off"]["reference_encoder_calls"] == 10 and r["on"]["reference_encoder_calls"] == 5
    assert r["on"]["store_hits"] == 5 and r["on"]["bit_identical"] and r["targets"]["calls_met"]
    assert r["targets"]["encoder_time_cut_ideal"] == 0.5
    assert r["targets"]["encoder_time_cut_runs"] == [r["targets"]["encoder_time_cut"]]  # one run
    assert r["targets"]["latency_ratio_per_request"] > 0
    assert "estimate" not in r and "--codec mimi" in r["estimate_skipped"]
    rows = voice.table_rows(r)
    assert [row.metric for row in rows][:3] == ["reference-encoder calls", "reference-encoder time",
                                                "time to first audio p50"]


def test_the_latency_ratio_is_paired_by_request():
    # The same three requests with the store off and on: the middle one's p50 pair says 2.0, while the
    # requests' own ratios are 1.11, 2.0 and 1.03.
    off, on = [1.0, 2.0, 4.0], [0.9, 1.0, 3.9]
    assert voice.per_request_ratio(off, on) == pytest.approx(1.0 / 0.9)
    with pytest.raises(ValueError):
        voice.per_request_ratio(off, on[:2])


def _fake_run(encoder_off: float, encoder_on: float, per_request: float, of_p50s: float) -> dict:
    side = lambda encoder: {"latency_p50_s": 1.0, "latency_mean_s": 1.0, "reference_encoder_s": encoder,
                            "reference_encoder_calls": 10, "store_hits": 0, "bit_identical": True}
    return {"off": side(encoder_off), "on": side(encoder_on), "latency_ratio": of_p50s,
            "latency_ratio_per_request": per_request}


def test_the_targets_are_medians_of_per_run_figures_and_both_sides_are_warmed(pipe, monkeypatch):
    """Cuts 0.5, 0.8, 0.25: their median is 0.5 where the cut between the medians over runs (0.5 / 2.0) is 0.75;
    the table's paired "better by" is the per-request figure. Before the runs one store-off and one store-on
    request warm each side (the store-on one through a throwaway store)."""
    fake = [_fake_run(1.0, 0.5, 1.5, 1.1), _fake_run(2.0, 0.4, 2.0, 1.0), _fake_run(4.0, 3.0, 1.2, 1.3)]
    monkeypatch.setattr(voice, "csm_pipeline", lambda codec: pipe)
    monkeypatch.setattr(voice, "_run_once", lambda pipe_, stream, frames, r: fake[r])
    warmed = []
    real_mode = voice._Mode
    monkeypatch.setattr(voice, "_Mode", lambda pipe_, store_on: warmed.append(store_on) or real_mode(pipe_, store_on))
    args = types.SimpleNamespace(quick=False, rounds=1, runs=3, frames=1, codec="tiny", threads=1, seed=0,
                                 no_estimate=True)
    result = voice.run(args)
    t = result["targets"]
    assert warmed == [False, True]
    assert t["encoder_time_cut_runs"] == pytest.approx([0.5, 0.8, 0.25]) and t["encoder_time_cut"] == 0.5
    assert t["latency_ratio_per_request"] == 1.5 and t["latency_ratio_paired"] == 1.1  # the latter: by run only
    row = voice.table_rows(result)[2]
    assert row.metric == "time to first audio p50" and row.ratio == 1.5 and row.paired == 1.5


def test_the_extensible_wav_header_is_read_as_wav():
    # ffmpeg and SoX write 24-bit and multichannel WAV files with the extensible header (libsndfile: WAVEX)
    buf = io.BytesIO()
    samples = tone(0.2)
    soundfile.write(buf, samples, SAMPLING_RATE, format="WAVEX", subtype="PCM_24")
    raw = read_audio(buf.getvalue())
    assert soundfile.info(io.BytesIO(raw.data)).format == "WAVEX"
    wave = decode_audio(raw, SAMPLING_RATE)
    assert np.array_equal(wave, soundfile.read(io.BytesIO(raw.data), dtype="float32")[0])
    with pytest.raises(MediaDecodeError, match="container WAVEX is not accepted"):
        decode_audio(raw, SAMPLING_RATE, AudioLimits(formats=("FLAC",)))
    with pytest.raises(MediaDecodeError, match="truncated WAV"):
        decode_audio(RawAudio(raw.data[:-10], raw.ref), SAMPLING_RATE)
