"""Text workloads of the prefix benchmark, generated from a seed in the shapes of public benchmark tools.

* ``probe``: one 2048-token prompt cold, the same prompt again, its first 1920 tokens plus 128 new ones, and an
  unrelated 2048-token prompt cold; one request per round, one output token each (latency = time to first token).
* ``vllm_prefix_caching``: vLLM's ``benchmark_prefix_caching.py`` with random tokens: one shared prefix of
  ``prefix_len`` tokens, each prompt's total length drawn uniformly from ``input_range`` (so its unique tail
  has ``input_range - prefix_len`` tokens), the list repeated ``repeat_count`` times and shuffled, greedy,
  ``output_len`` tokens, everything submitted at once.
* ``generated_shared_prefix``: SGLang's ``generated-shared-prefix`` dataset: ``num_groups`` random system prompts,
  ``prompts_per_group`` random questions behind each, shuffled, submitted at once.
* ``multi_turn``: vLLM's ``benchmarks/multi_turn`` generator shape read from its JSON configuration (see
  ``datasets/traces/vllm_generate_multi_turn.json``): a common prefix shared by every conversation, a
  conversation-specific prefix, user turns and answer lengths drawn from the configured distributions. Each
  conversation is a session: a turn's prompt is the previous prompt, the model's own answer to it, then the new
  user turn, so every turn extends the one before. Turn ``t`` of every conversation forms round ``t``.

Invariants: the same arguments give the same token ids on every machine (``random.Random(seed)``; no global
random state); token ids lie in ``TokenSpace``; distinct workloads and distinct seeds draw unrelated tokens, so
one workload never hits the cache of another except by the intended shared parts.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from mmcache.errors import MmcacheError

from .peers.protocol import Request, Workload

MULTI_TURN_SPEC = Path(__file__).resolve().parents[1] / "datasets" / "traces" / "vllm_generate_multi_turn.json"


class WorkloadShapeError(MmcacheError, ValueError):
    """Workload parameters that cannot produce the shape asked for (lengths out of range, unknown distribution)."""


@dataclass(frozen=True)
class TokenSpace:
    """Token ids are drawn uniformly from ``[low, high)``; ``low`` skips the special ids at the bottom."""

    low: int
    high: int

    def __post_init__(self):
        if not 0 <= self.low < self.high:
            raise WorkloadShapeError(f"empty token space [{self.low}, {self.high})")

    def draw(self, rng: random.Random, n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(self.low, self.high) for _ in range(n))


def probe(space: TokenSpace, seed: int, prompt_len: int = 2048, shared_len: int = 1920,
          max_tokens: int = 1) -> Workload:
    """Four single-request rounds: ``cold``, ``same``, ``shared`` (first ``shared_len`` tokens + new), ``cold2``."""
    if not 0 < shared_len < prompt_len:
        raise WorkloadShapeError(f"probe: shared_len {shared_len} must lie in (0, {prompt_len})")
    rng = random.Random(f"probe:{seed}")
    first = space.draw(rng, prompt_len)
    shared = first[:shared_len] + space.draw(rng, prompt_len - shared_len)
    second = space.draw(rng, prompt_len)
    rounds = tuple((Request(f"probe{seed}-{name}", toks, max_tokens),)
                   for name, toks in (("cold", first), ("same", first), ("shared", shared), ("cold2", second)))
    return Workload("probe", rounds, {"prompt_len": prompt_len, "shared_len": shared_len, "max_tokens": max_tokens})


def vllm_prefix_caching(space: TokenSpace, seed: int, prefix_len: int, input_range: tuple[int, int],
                        num_prompts: int, repeat_count: int, output_len: int = 10) -> Workload:
    lo, hi = input_range
    if not (0 <= prefix_len < lo <= hi):
        raise WorkloadShapeError(f"vllm_prefix_caching: need 0 <= prefix_len ({prefix_len}) < min length ({lo}) "
                                 f"<= max length ({hi})")
    if num_prompts < 1 or repeat_count < 1 or output_len < 1:
        raise WorkloadShapeError("vllm_prefix_caching: num_prompts, repeat_count and output_len must be positive")
    rng = random.Random(f"vllm_prefix_caching:{seed}")
    prefix = space.draw(rng, prefix_len)
    prompts = [prefix + space.draw(rng, rng.randint(lo, hi) - prefix_len) for _ in range(num_prompts)]
    order = [i for i in range(num_prompts) for _ in range(repeat_count)]
    rng.shuffle(order)
    seen: dict[int, int] = {}
    requests = []
    for i in order:
        seen[i] = seen.get(i, 0) + 1
        requests.append(Request(f"vpc{seed}-p{i}-r{seen[i]}", prompts[i], output_len))
    params = {"prefix_len": prefix_len, "input_length_range": f"{lo}:{hi}", "num_prompts": num_prompts,
              "repeat_count": repeat_count, "output_len": output_len, "submitted": "all at once"}
    return Workload("vllm_prefix_caching", (tuple(requests),), params)


def generated_shared_prefix(space: TokenSpace, seed: int, num_groups: int, prompts_per_group: int,
                            system_prompt_len: int, question_len: int, output_len: int) -> Workload:
    if min(num_groups, prompts_per_group, system_prompt_len, question_len, output_len) < 1:
        raise WorkloadShapeError("generated_shared_prefix: every count and length must be positive")
    rng = random.Random(f"generated_shared_prefix:{seed}")
    systems = [space.draw(rng, system_prompt_len) for _ in range(num_groups)]
    requests = [Request(f"gsp{seed}-g{g}-q{q}", systems[g] + space.draw(rng, question_len), output_len)
                for g in range(num_groups) for q in range(prompts_per_group)]
    rng.shuffle(requests)
    params = {"num_groups": num_groups, "prompts_per_group": prompts_per_group,
              "system_prompt_len": system_prompt_len, "question_len": question_len, "output_len": output_len,
              "submitted": "all at once, shuffled"}
    return Workload("generated_shared_prefix", (tuple(requests),), params)


@dataclass(frozen=True)
class Distribution:
    """One of the integer distributions of vLLM's multi-turn generator configuration."""

    kind: str  # constant | uniform | lognormal
    value: int = 0  # constant
    low: int = 0  # uniform, inclusive
    high: int = 0  # uniform, inclusive
    average: float = 0.0  # lognormal by average: the sample is rescaled to this mean, as the generator does
    median_ratio: float = 0.85  # lognormal by average: median / mean, the generator's default
    mu: float = 0.0  # lognormal by mean and sigma of the underlying normal (used when average is 0)
    sigma: float = 0.0
    cap: int | None = None  # lognormal: values above are clipped

    @classmethod
    def from_json(cls, d: dict, where: str) -> "Distribution":
        kind = d.get("distribution")
        try:
            if kind == "constant":
                return cls("constant", value=int(d["value"]))
            if kind == "uniform":
                lo, hi = int(d["min"]), int(d["max"])
                if not 0 < lo <= hi:
                    raise WorkloadShapeError(f"{where}: uniform needs 0 < min <= max, got {lo}, {hi}")
                return cls("uniform", low=lo, high=hi)
            if kind == "lognormal" and "average" not in d:
                if float(d["sigma"]) < 0:
                    raise WorkloadShapeError(f"{where}: lognormal sigma must be non-negative")
                return cls("lognormal", mu=float(d["mean"]), sigma=float(d["sigma"]),
                           cap=int(d["max"]) if "max" in d else None)
            if kind == "lognormal":
                ratio = float(d.get("median_ratio", 0.85))
                if not 0 < ratio < 1 or float(d["average"]) < 1:
                    raise WorkloadShapeError(f"{where}: lognormal needs average >= 1 and 0 < median_ratio < 1")
                return cls("lognormal", average=float(d["average"]), median_ratio=ratio,
                           cap=int(d["max"]) if "max" in d else None)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, WorkloadShapeError):
                raise
            raise WorkloadShapeError(f"{where}: malformed {kind} distribution: {e!r}") from e
        raise WorkloadShapeError(f"{where}: unsupported distribution {kind!r} (constant, uniform, lognormal)")

    def sample(self, rng: random.Random, n: int) -> list[int]:
        if self.kind == "constant":
            return [self.value] * n
        if self.kind == "uniform":
            return [rng.randint(self.low, self.high) for _ in range(n)]
        if self.average:
            # mean = exp(mu + sigma^2 / 2) and median = exp(mu) give mu and sigma from the average and the ratio
            mu, sigma = math.log(self.average * self.median_ratio), math.sqrt(2 * math.log(1 / self.median_ratio))
        else:
            mu, sigma = self.mu, self.sigma
        raw = [rng.lognormvariate(mu, sigma) for _ in range(n)]
        scale = self.average / (sum(raw) / n) if self.average else 1.0
        return [round(min(x * scale, self.cap) if self.cap else x * scale) for x in raw]


@dataclass(frozen=True)
class MultiTurnShape:
    """The conversation shape of vLLM's ``generate_multi_turn.json``. ``num_messages`` counts user and assistant
    messages alike (the generator rounds it up to an even number), so a conversation has half as many user turns."""

    num_conversations: int
    num_messages: Distribution
    common_prefix: Distribution
    conversation_prefix: Distribution
    user_tokens: Distribution
    answer_tokens: Distribution

    @classmethod
    def load(cls, path: Path = MULTI_TURN_SPEC) -> "MultiTurnShape":
        try:
            d = json.loads(Path(path).read_text())
            inp, out = d["prompt_input"], d["prompt_output"]
            common = inp.get("common_prefix_num_tokens", {"distribution": "constant", "value": 0})
            return cls(int(d["num_conversations"]),
                       Distribution.from_json(inp["num_turns"], "num_turns"),
                       Distribution.from_json(common, "common_prefix_num_tokens"),
                       Distribution.from_json(inp["prefix_num_tokens"], "prefix_num_tokens"),
                       Distribution.from_json(inp["num_tokens"], "prompt_input.num_tokens"),
                       Distribution.from_json(out["num_tokens"], "prompt_output.num_tokens"))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise WorkloadShapeError(f"{path}: not a multi-turn generator configuration: {e!r}") from e


def multi_turn(shape: MultiTurnShape, space: TokenSpace, seed: int, num_conversations: int | None = None,
               max_user_turns: int | None = None, max_answer_tokens: int | None = None) -> Workload:
    """Conversations in ``shape``, optionally fewer of them, cut to ``max_user_turns`` user turns each and with
    answers capped at ``max_answer_tokens``.

    The first user turn is the common prefix, the conversation's own prefix, then a question of the user-turn
    length; later user turns are a question each. Answers are the model's own greedy outputs of the drawn length.
    """
    n = shape.num_conversations if num_conversations is None else num_conversations
    if n < 1 or any(x is not None and x < 1 for x in (max_user_turns, max_answer_tokens)):
        raise WorkloadShapeError("multi_turn: num_conversations, max_user_turns and max_answer_tokens must be positive")
    rng = random.Random(f"multi_turn:{seed}")
    common = space.draw(rng, shape.common_prefix.sample(rng, 1)[0])
    messages = [max(2, m) for m in shape.num_messages.sample(rng, n)]
    user_turns = [(m + m % 2) // 2 for m in messages]
    if max_user_turns is not None:
        user_turns = [min(t, max_user_turns) for t in user_turns]
    own_prefix_lens = shape.conversation_prefix.sample(rng, n)
    rounds: list[list[Request]] = [[] for _ in range(max(user_turns))]
    for c in range(n):
        questions = shape.user_tokens.sample(rng, user_turns[c])
        answers = [max(1, min(a, max_answer_tokens or a)) for a in shape.answer_tokens.sample(rng, user_turns[c])]
        for t in range(user_turns[c]):
            toks = space.draw(rng, questions[t])
            if t == 0:
                toks = common + space.draw(rng, own_prefix_lens[c]) + toks
            rounds[t].append(Request(f"mt{seed}-c{c}-t{t}", toks, answers[t], session=f"mt{seed}-c{c}"))
    params = {"num_conversations": n, "of_configured": shape.num_conversations,
              "user_turns": user_turns, "max_user_turns": max_user_turns, "max_answer_tokens": max_answer_tokens,
              "common_prefix_len": len(common),
              "conversation_prefix_lens": own_prefix_lens, "submitted": "turn t of every conversation together"}
    return Workload("multi_turn", tuple(tuple(r) for r in rounds), params)
