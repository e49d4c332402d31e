"""Synthetic multi-turn agent sessions: each turn's prompt is the previous prompt, the previous output and a
tool result.

It stands in for the public mini-swe-agent traces (500 sessions, 25k requests, about 400M prefill tokens),
which are not reachable here. Shape of a session ``s`` with ``T_s`` turns::

    prompt(0)   = system prompt (shared by every session) + task (unique to the session)
    prompt(k+1) = prompt(k) + output(k) + tool result(k)
    turn k+1 arrives tool latency(k) seconds after turn k ends

The workload is closed-loop: ``concurrency`` sessions run at once; slot ``i`` runs sessions ``i``,
``i + concurrency``, ``i + 2 * concurrency`` ..., each starting when the previous one in the slot ends (slot
``i``'s first session starts at ``i * start_spacing_s``). A turn the deployment rejects ends its session.

Every length and latency is drawn once, from ``seed``, when the workload is built, and every token is a
deterministic stream keyed by (session, turn, part), so the same parameters always give the same sessions,
whatever the replay does with them. Optional media: a tool result carries an image (``image_tokens``
placeholder tokens whose page extras hold the image's digest) with probability ``probability``, the image
drawn from ``distinct`` images, so the duplicate-media rate can be measured.

Parameters live in a JSON file (``load_params``); the repository's defaults are
``datasets/sessions/agent_sessions.json``, described in the README beside it. Unknown keys, wrong types and
out-of-range values raise ``SessionParamsError`` naming the key. Sizes are bounded so that no parameter
file can ask for more than memory holds: at most ``MAX_SESSIONS`` sessions, each session's whole token sequence
at most ``MAX_SEQUENCE_TOKENS`` (checked as each session is drawn, before its tokens exist), ids below 2**31.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from ..checks import finite_number
from ..errors import MmcacheError
from ..names import MAX_TOKEN_ID, MediaItem, media_digest
from .tokens import stream, stream_key
from .workload import MAX_SEQUENCE_TOKENS, Arrival

DEFAULT_PARAMS = Path(__file__).resolve().parents[2] / "datasets" / "sessions" / "agent_sessions.json"
MAX_SESSIONS = 2**20
MAX_SIGMA = 10.0  # a log-space spread of e**10 (22,000-fold) per standard deviation; beyond it lognormal overflows
COUNT_DISTS = ("task_tokens", "turns", "output_tokens", "tool_output_tokens")


class SessionParamsError(MmcacheError, ValueError):
    """The sessions parameter file is malformed; ``key`` names the offending entry."""

    def __init__(self, path: str, key: str, reason: str):
        super().__init__(f"{path}: {key}: {reason}")
        self.path = path
        self.key = key
        self.reason = reason


@dataclass(frozen=True)
class Dist:
    """A distribution of a non-negative quantity: ``lognormal`` with arithmetic ``mean`` and log-space
    ``sigma``, clipped to [``low``, ``high``]; or ``constant`` (always ``mean``)."""

    kind: str = "constant"
    mean: float = 1.0
    sigma: float = 0.0
    low: float = 0.0
    high: float = math.inf

    def check(self, where: str) -> None:
        if self.kind not in ("lognormal", "constant"):
            raise ValueError(f"{where}.kind must be 'lognormal' or 'constant', got {self.kind!r}")
        for name in ("mean", "sigma", "low", "high"):
            v = getattr(self, name)
            if not (finite_number(v) or (name == "high" and v == math.inf)) or v < 0:
                raise ValueError(f"{where}.{name} must be a finite number >= 0, got {v!r}")
        if self.sigma > MAX_SIGMA:
            raise ValueError(f"{where}.sigma must be at most {MAX_SIGMA}, got {self.sigma!r}")
        if self.low > self.high or not self.low <= self.mean <= self.high:
            raise ValueError(f"{where} needs low <= mean <= high, got {self.low}, {self.mean}, {self.high}")
        if self.kind == "lognormal" and self.mean <= 0:
            raise ValueError(f"{where}.mean must be > 0 for a lognormal")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "constant":
            return np.full(n, float(self.mean))
        mu = math.log(self.mean) - self.sigma ** 2 / 2  # so that E[x] = mean before clipping
        return np.clip(rng.lognormal(mu, self.sigma, n), self.low, self.high)


@dataclass(frozen=True)
class MediaParams:
    probability: float = 0.0  # chance that a tool result carries an image
    distinct: int = 1  # images are drawn uniformly from this many distinct ones
    image_tokens: int = 256  # placeholder tokens per image


@dataclass(frozen=True)
class SessionParams:
    seed: int = 0
    sessions: int = 200
    concurrency: int = 8
    start_spacing_s: float = 0.5
    system_prompt_tokens: int = 1500
    task_tokens: Dist = Dist("lognormal", 800, 0.5, 100, 4000)
    turns: Dist = Dist("lognormal", 40, 0.6, 5, 150)
    output_tokens: Dist = Dist("lognormal", 200, 0.7, 10, 2000)
    tool_output_tokens: Dist = Dist("lognormal", 350, 1.0, 10, 4000)
    tool_latency_s: Dist = Dist("lognormal", 2.0, 0.8, 0.05, 60)
    vocab: int = 100_000
    media: MediaParams | None = None

    def check(self) -> None:
        # vocab: ids lie below it, and the image placeholder is vocab itself, so it must be a token id too
        for name, high in (("sessions", MAX_SESSIONS), ("concurrency", None), ("vocab", MAX_TOKEN_ID)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or (high is not None and v > high):
                raise ValueError(f"{name} must be an integer in [1, {high or 'any'}], got {v!r}")
        for name, high in (("seed", 2**63 - 1), ("system_prompt_tokens", MAX_SEQUENCE_TOKENS)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= high:
                raise ValueError(f"{name} must be an integer in [0, {high}], got {v!r}")
        if isinstance(self.start_spacing_s, bool) or not isinstance(self.start_spacing_s, (int, float)) \
                or not 0 <= self.start_spacing_s < math.inf:
            raise ValueError(f"start_spacing_s must be a finite number >= 0, got {self.start_spacing_s!r}")
        for name in COUNT_DISTS + ("tool_latency_s",):
            d = getattr(self, name)
            if not isinstance(d, Dist):
                raise ValueError(f"{name} must be a distribution object, got {d!r}")
            d.check(name)
            if name in COUNT_DISTS and d.low > MAX_SEQUENCE_TOKENS:  # every draw would be over the bound
                raise ValueError(f"{name}.low must be at most {MAX_SEQUENCE_TOKENS}, got {d.low!r}")
        if self.media is not None and not isinstance(self.media, MediaParams):
            raise ValueError(f"media must be an object or null, got {self.media!r}")
        if self.media is not None:
            m = self.media
            if isinstance(m.probability, bool) or not isinstance(m.probability, (int, float)) \
                    or not 0 <= m.probability <= 1:
                raise ValueError(f"media.probability must lie in [0, 1], got {m.probability!r}")
            for name, high in (("distinct", 2**63 - 1), ("image_tokens", MAX_SEQUENCE_TOKENS)):
                v = getattr(m, name)
                if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= high:
                    raise ValueError(f"media.{name} must be an integer in [1, {high}], got {v!r}")


def _build(cls, raw, where: str, path: str):
    if not isinstance(raw, dict):
        raise SessionParamsError(path, where or "(top level)", f"expected an object, got {type(raw).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise SessionParamsError(path, f"{where}.{unknown[0]}" if where else unknown[0], "unknown key")
    values = {}
    for name, value in raw.items():
        key = f"{where}.{name}" if where else name
        nested = {"task_tokens": Dist, "turns": Dist, "output_tokens": Dist, "tool_output_tokens": Dist,
                  "tool_latency_s": Dist, "media": MediaParams}.get(name) if cls is SessionParams else None
        if nested is Dist and isinstance(value, dict):
            value = _over_default(known[name].default, value)
        if nested is not None and value is not None:
            value = _build(nested, value, key, path)
        values[name] = value
    return cls(**values)


def _over_default(default: Dist, raw: dict) -> dict:
    """A distribution given partly, completed from its key's default when it is of the default's kind (or names
    none): a lognormal given only its mean keeps the default's sigma and bounds. One of another kind takes only
    what it names, beside ``Dist``'s own defaults (a constant needs only its mean)."""
    if raw.get("kind", default.kind) != default.kind:
        return raw
    return {**{f.name: getattr(default, f.name) for f in fields(default)}, **raw}


def params_to_dict(params: SessionParams) -> dict:
    """The JSON form of ``params`` (``load_params`` reads it back to an equal object)."""
    out = {}
    for f in fields(params):
        v = getattr(params, f.name)
        if isinstance(v, (Dist, MediaParams)):
            v = {g.name: getattr(v, g.name) for g in fields(v)}
            if v.get("high") == math.inf:
                v["high"] = None
        out[f.name] = v
    return out


def load_params(path: str | Path) -> SessionParams:
    """Read a parameter file; keys left out take ``SessionParams``'s defaults, and so do the fields left out of a
    distribution of its key's default kind. ``high: null`` means no bound."""
    where = str(path)
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise SessionParamsError(where, "(file)", f"cannot read: {e}") from e
    except json.JSONDecodeError as e:
        raise SessionParamsError(where, f"(line {e.lineno})", f"not JSON: {e.msg}") from e
    except RecursionError:
        raise SessionParamsError(where, "(file)", "JSON nested too deeply") from None
    if isinstance(raw, dict):
        for name in ("task_tokens", "turns", "output_tokens", "tool_output_tokens", "tool_latency_s"):
            if isinstance(raw.get(name), dict) and raw[name].get("high", 0) is None:
                raw[name] = {**raw[name], "high": math.inf}
    try:
        params = _build(SessionParams, raw, "", where)
        params.check()
    except TypeError as e:
        raise SessionParamsError(where, "(schema)", str(e)) from e
    except ValueError as e:
        if isinstance(e, SessionParamsError):
            raise
        key, _, reason = str(e).partition(" ")
        raise SessionParamsError(where, key, reason) from e
    return params


@dataclass(frozen=True)
class SessionTurn:
    """Turn ``turn`` of session ``session``; a ``RequestSpec``."""

    workload: "AgentSessions"
    session: int
    turn: int
    request_id: int
    prompt_len: int
    output_len: int

    def prompt_ids(self) -> np.ndarray:
        return self.workload.prompt_ids(self.session, self.turn)

    def output_ids(self) -> np.ndarray:
        return self.workload.output_ids(self.session, self.turn)

    def media(self) -> tuple[MediaItem, ...]:
        return self.workload.media(self.session, self.turn)


@dataclass
class _Session:
    task: int
    outputs: np.ndarray  # per turn
    tools: np.ndarray  # tool-result text tokens per turn (after each turn but the last)
    latency: np.ndarray  # seconds between turn k's end and turn k+1's arrival
    images: np.ndarray  # per tool result: image index, or -1
    first_id: int = 0
    prompt_lens: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))


class AgentSessions:
    """The sessions workload for one parameter set (a ``Workload``)."""

    def __init__(self, params: SessionParams | None = None, source: str = "defaults"):
        self.params = p = params or SessionParams()
        p.check()
        rng = np.random.default_rng(p.seed)
        self.description = f"sessions:{source}"
        self.image_tokens = p.media.image_tokens if p.media else 0
        self._placeholder = p.vocab  # one id above the text vocabulary, equal for every image
        self.sessions: list[_Session] = []
        self._recent: dict[int, np.ndarray] = {}  # session -> token sequence, least recently used first
        next_id = 0
        for number in range(p.sessions):
            drawn_turns, drawn_task = p.turns.sample(rng, 1)[0], p.task_tokens.sample(rng, 1)[0]
            if not p.system_prompt_tokens + drawn_task + drawn_turns <= MAX_SEQUENCE_TOKENS:  # before any array
                self._too_long(source, number, p.system_prompt_tokens + drawn_task + drawn_turns)
            turns, task = max(1, int(round(drawn_turns))), max(1, int(round(drawn_task)))
            outputs = np.maximum(1, np.round(p.output_tokens.sample(rng, turns)))
            tools = np.maximum(1, np.round(p.tool_output_tokens.sample(rng, turns)))
            s = _Session(task=task, outputs=outputs, tools=tools, latency=p.tool_latency_s.sample(rng, turns),
                         images=np.full(turns, -1, dtype=np.int64))
            if p.media is not None and p.media.probability > 0:
                has = rng.random(turns) < p.media.probability
                s.images[has] = rng.integers(0, p.media.distinct, int(has.sum()))
            # The whole sequence: every output, and every tool result (and its image) but the last turn's.
            total = (p.system_prompt_tokens + task + float(outputs.sum()) + float(tools[:-1].sum())
                     + self.image_tokens * int((s.images[:-1] >= 0).sum()))
            if total > MAX_SEQUENCE_TOKENS:  # as floats: the draws may be far past int64
                self._too_long(source, number, total)
            s.outputs, s.tools = outputs.astype(np.int64), tools.astype(np.int64)
            tool_total = s.tools + np.where(s.images >= 0, self.image_tokens, 0)
            step = s.outputs + tool_total
            s.prompt_lens = p.system_prompt_tokens + s.task + np.concatenate([[0], np.cumsum(step)[:-1]])
            s.first_id = next_id
            next_id += turns
            self.sessions.append(s)
        self.num_requests = next_id

    @staticmethod
    def _too_long(source: str, session: int, tokens: float) -> None:
        raise SessionParamsError(source, "(sessions)", f"session {session} would hold {tokens:.4g} tokens, over the "
                                                       f"{MAX_SEQUENCE_TOKENS} a replayed sequence may hold")

    def turn(self, session: int, turn: int) -> SessionTurn:
        s = self.sessions[session]
        return SessionTurn(self, session, turn, s.first_id + turn, int(s.prompt_lens[turn]),
                           int(s.outputs[turn]))

    def initial(self) -> list[Arrival]:
        p = self.params
        return [(i * float(p.start_spacing_s), self.turn(i, 0)) for i in range(min(p.concurrency, p.sessions))]

    def follow_ups(self, spec: SessionTurn, time_s: float, served: bool) -> list[Arrival]:
        s = self.sessions[spec.session]
        if served and spec.turn + 1 < len(s.outputs):
            return [(time_s + float(s.latency[spec.turn]), self.turn(spec.session, spec.turn + 1))]
        nxt = spec.session + self.params.concurrency
        return [(time_s, self.turn(nxt, 0))] if nxt < len(self.sessions) else []

    # ---- tokens ------------------------------------------------------------------------------------
    def _sequence(self, session: int) -> np.ndarray:
        """The session's whole token sequence (system, task, then output and tool result of every turn);
        prompt(k) and output(k) are slices of it. Recently used sequences are memoised, because the
        replay asks for the turns of ``concurrency`` sessions interleaved."""
        seq = self._recent.pop(session, None)
        if seq is None:
            p, s = self.params, self.sessions[session]
            parts = [stream(stream_key("sessions-system", p.seed), p.system_prompt_tokens, p.vocab),
                     stream(stream_key("sessions-task", p.seed, session), s.task, p.vocab)]
            for k in range(len(s.outputs)):
                key = stream_key("sessions-output", p.seed, session, k)
                parts.append(stream(key, int(s.outputs[k]), p.vocab))
                if k + 1 < len(s.outputs):
                    key = stream_key("sessions-tool", p.seed, session, k)
                    parts.append(stream(key, int(s.tools[k]), p.vocab))
                    if s.images[k] >= 0:
                        parts.append(np.full(self.image_tokens, self._placeholder, dtype=np.int32))
            seq = np.concatenate(parts)
            if len(self._recent) >= 4 * self.params.concurrency + 8:
                self._recent.pop(next(iter(self._recent)))
        self._recent[session] = seq
        return seq

    def prompt_ids(self, session: int, turn: int) -> np.ndarray:
        return self._sequence(session)[: self.sessions[session].prompt_lens[turn]].copy()

    def output_ids(self, session: int, turn: int) -> np.ndarray:
        s = self.sessions[session]
        start = int(s.prompt_lens[turn])
        return self._sequence(session)[start:start + int(s.outputs[turn])].copy()

    def media(self, session: int, turn: int) -> tuple[MediaItem, ...]:
        s = self.sessions[session]
        out = []
        for k in range(turn):
            if s.images[k] >= 0:
                # The image's placeholders close tool result k, which ends where prompt(k+1) ends.
                position = int(s.prompt_lens[k + 1]) - self.image_tokens
                out.append(MediaItem(self.image_digest(int(s.images[k])), position))
        return tuple(out)

    def image_digest(self, image: int) -> bytes:
        """The digest of synthetic image ``image``: as if its encoded bytes were this name."""
        raw = f"mmcache-sessions-image-{self.params.seed}-{image}".encode()
        return media_digest(raw, {"tokens": self.image_tokens})
