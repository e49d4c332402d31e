"""The replica router: rendezvous affinity on a page name later turns share, and its fallback past the threshold
(the ranking of a page twice as deep by default, a uniform draw, or the least-loaded replica)."""

import gc
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmcache import Fingerprint, InvalidRequest, Namer
from mmcache.router import ReplicaRouter, RouterConfig

PAGE = 4


def names_of(ids) -> np.ndarray:
    namer = Namer(Fingerprint.for_tests(PAGE))
    arr = np.asarray(ids, dtype=np.int32)
    return namer.names(arr, namer.root())


def random_prompts(n, length, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, length) for _ in range(n)]


def test_equal_prefixes_go_to_one_replica():
    router = ReplicaRouter(RouterConfig.numbered(4, depth_pages=3))
    idle = [0, 0, 0, 0]
    for prefix in random_prompts(20, 3 * PAGE, seed=1):
        tails = random_prompts(10, 5 * PAGE, seed=int(prefix[0]))
        chosen = {router.route(names_of(np.concatenate([prefix, t])), idle) for t in tails}
        assert chosen == {router.preferred(names_of(prefix))}


def test_route_depth_decides_what_counts_as_the_prefix():
    shallow = ReplicaRouter(RouterConfig.numbered(8, depth_pages=1))
    deep = ReplicaRouter(RouterConfig.numbered(8, depth_pages=2))
    first_page = np.arange(PAGE)
    prompts = [np.concatenate([first_page, p]) for p in random_prompts(40, 2 * PAGE, seed=2)]
    assert len({shallow.preferred(names_of(p)) for p in prompts}) == 1
    assert len({deep.preferred(names_of(p)) for p in prompts}) > 1
    # A prompt shorter than the depth routes by its first full page.
    assert deep.routing_name(names_of(first_page)) == int(names_of(first_page)[0])
    three = names_of(np.arange(3 * PAGE))
    assert ReplicaRouter(RouterConfig.numbered(8, depth_pages=4)).routing_name(three) == int(three[0])


def test_preference_spreads_distinct_prefixes_over_replicas():
    router = ReplicaRouter(RouterConfig.numbered(4, depth_pages=1))
    counts = np.bincount([router.preferred(names_of(p)) for p in random_prompts(2000, PAGE, seed=3)], minlength=4)
    assert counts.min() > 400 and counts.max() < 600


def test_removing_a_replica_moves_only_its_prefixes():
    four = ReplicaRouter(RouterConfig(("a", "b", "c", "d"), depth_pages=1))
    three = ReplicaRouter(RouterConfig(("a", "b", "d"), depth_pages=1))
    moved = 0
    for p in random_prompts(500, PAGE, seed=4):
        before = four.config.replicas[four.preferred(names_of(p))]
        after = three.config.replicas[three.preferred(names_of(p))]
        if before != "c":
            assert after == before
        else:
            moved += 1
    assert moved > 0


def test_hot_prefix_past_threshold_goes_to_least_loaded_under_that_fallback():
    router = ReplicaRouter(RouterConfig.numbered(4, depth_pages=1, load_factor=1.5, min_load=3,
                                                 fallback="least_loaded"))
    names = names_of(np.arange(2 * PAGE))
    ranking = router.ranking(router.routing_name(names))
    hot = ranking[0]
    loads = [1, 1, 1, 1]
    loads[hot] = 3  # at the floor (the mean-based bound is 1.5 x 1.5 = 2.25): still preferred
    assert router.threshold(loads) == 3
    assert router.route(names, loads) == hot
    loads[hot] = 4  # past it: the least-loaded replica
    loads[ranking[3]] = 0
    assert router.threshold(loads) == 3
    assert router.route(names, loads) == ranking[3]
    loads[ranking[3]] = 1  # a tie among the least loaded is broken by the rendezvous ranking
    assert router.route(names, loads) == ranking[1]


def test_threshold_follows_the_mean_load():
    router = ReplicaRouter(RouterConfig.numbered(4, depth_pages=1, load_factor=1.5, min_load=3,
                                                 fallback="least_loaded"))
    names = names_of(np.arange(PAGE))
    ranking = router.ranking(router.routing_name(names))
    busy = [20, 20, 20, 20]
    busy[ranking[0]] = 29  # mean 22.25, bound 33.4: a busy deployment keeps its affinity
    assert router.route(names, busy) == ranking[0]
    busy[ranking[0]] = 60  # mean 30, bound 45: this replica is far above its share
    assert router.route(names, busy) == ranking[1]


def test_overloaded_replica_that_is_also_least_loaded_keeps_its_prefix():
    router = ReplicaRouter(RouterConfig.numbered(3, depth_pages=1, load_factor=1, min_load=0))
    names = names_of(np.arange(PAGE))
    assert router.route(names, [5, 5, 5]) == router.preferred(names)


def test_prompt_without_a_full_page_goes_where_the_fallback_sends_it():
    router = ReplicaRouter(RouterConfig.numbered(3, fallback="least_loaded"))
    empty = names_of(np.arange(PAGE - 1))
    assert len(empty) == 0 and router.preferred(empty) is None
    assert router.route(empty, [2, 0, 1]) == 1
    drawn = ReplicaRouter(RouterConfig.numbered(3, seed=7))
    assert {drawn.route(empty, [2, 0, 1]) for _ in range(200)} == {0, 1, 2}  # the runtime's own (random) choice


def test_routing_is_a_pure_function_of_names_and_loads():
    router = ReplicaRouter(RouterConfig.numbered(5, depth_pages=2))
    prompts = [names_of(p) for p in random_prompts(50, 3 * PAGE, seed=5)]
    first = [router.route(n, [0] * 5) for n in prompts]
    again = [router.route(n, [0] * 5) for n in reversed(prompts)][::-1]
    fresh = ReplicaRouter(RouterConfig.numbered(5, depth_pages=2))
    assert first == again == [fresh.route(n, [0] * 5) for n in prompts]


@pytest.mark.parametrize("kwargs", [dict(replicas=()), dict(replicas=("a", "a")),
                                    dict(replicas=("a",), depth_pages=0), dict(replicas=("a",), min_load=-1),
                                    dict(replicas=("a",), load_factor=0.5),
                                    dict(replicas=("a",), load_factor=float("nan")),
                                    dict(replicas=("a", 3)), dict(replicas="ab"), dict(replicas=("a",), load_factor="2"),
                                    dict(replicas=("a",), min_load=None), dict(replicas=("a",), min_load=True),
                                    dict(replicas=("\ud800", "b")),  # the router's seed raised UnicodeEncodeError
                                    dict(replicas=("a",), fallback="least"), dict(replicas=("a",), fallback=None),
                                    dict(replicas=("a",), seed=-1), dict(replicas=("a",), seed=1.5),
                                    dict(replicas=("a",), seed=True)])
def test_bad_config_is_refused(kwargs):
    with pytest.raises(InvalidRequest):
        RouterConfig(**kwargs)


def test_wrong_number_of_loads_is_refused():
    with pytest.raises(InvalidRequest):
        ReplicaRouter(RouterConfig.numbered(2)).route(names_of(np.arange(PAGE)), [0, 0, 0])


@pytest.mark.parametrize("loads", [[float("nan"), 1, 2], [1, 2, float("nan")], [float("inf")] * 3, [-1, 0, 0],
                                   ["a", 1, 2], [None, 1, 2], [True, 0, 0]])
def test_loads_that_are_not_finite_non_negative_numbers_are_refused(loads):
    # Each is refused by name: NaN would otherwise route wherever the comparisons happened to leave it.
    with pytest.raises(InvalidRequest, match="loads"):
        ReplicaRouter(RouterConfig.numbered(3)).route(names_of(np.arange(PAGE)), loads)


def test_a_replica_list_is_kept_as_a_tuple():
    config = RouterConfig(["a", "b"])
    assert config.replicas == ("a", "b") and hash(config)  # the frozen config stays hashable and immutable


@pytest.mark.parametrize("loads", [{0, 1, 2}, (x for x in [0, 1, 2]), None, 3])
def test_loads_that_are_not_a_list_are_refused(loads):  # a typed error naming loads, not a TypeError
    router = ReplicaRouter(RouterConfig.numbered(3))
    with pytest.raises(InvalidRequest, match="loads"):
        router.route(names_of(np.arange(PAGE)), loads)
    with pytest.raises(InvalidRequest, match="loads"):
        router.threshold(loads)
    with pytest.raises(InvalidRequest, match="loads"):  # ZeroDivisionError before
        ReplicaRouter(RouterConfig.numbered(1)).threshold([])


@pytest.mark.parametrize("name", [-1, 2**64, 1.5, True, "7"])
def test_a_routing_name_outside_64_bits_is_refused(name):  # OverflowError before
    with pytest.raises(InvalidRequest, match="page name"):
        ReplicaRouter(RouterConfig.numbered(3)).ranking(name)


@pytest.mark.parametrize("names", [np.array([1.5]), np.array([-1]), np.array([[1, 2]]), ["x"], [[1], [2, 3]]])
def test_page_names_that_are_not_a_vector_of_names_are_refused(names):
    router = ReplicaRouter(RouterConfig.numbered(3))
    with pytest.raises(InvalidRequest, match="page names"):
        router.route(names, [0, 0, 0])
    with pytest.raises(InvalidRequest, match="page names"):
        router.preferred(names)


def test_page_names_as_a_list_route_as_the_same_names_in_a_uint64_array():
    # Half of all xxh64 names are >= 2**63: numpy turns a list mixing them with smaller ones into float64
    # (lossy), which was refused although the same names in a uint64 array route.
    router = ReplicaRouter(RouterConfig.numbered(5, depth_pages=2))
    for names in ([2**64 - 1, 7], [7, 2**63], [np.uint64(2**63 + 5), 3], (1, 2**64 - 2)):
        assert router.preferred(names) == router.preferred(np.array(names, dtype=np.uint64))
        assert router.route(names, [0] * 5) == router.route(np.array(names, dtype=np.uint64), [0] * 5)
    for bad in ([2**64, 1], [-1, 1], [True, 1], [1.0, 2]):
        with pytest.raises(InvalidRequest, match="page names"):
            router.preferred(bad)


def test_loads_of_another_shape_and_a_config_of_another_type_are_refused():
    router = ReplicaRouter(RouterConfig.numbered(3))
    for loads in (np.array(5), np.zeros((3, 1)), [1, [2], 3]):  # TypeError (iterating a 0-d array) before
        with pytest.raises(InvalidRequest, match="loads"):
            router.route([1], loads)
    for config in (("a", "b"), None, 3):  # AttributeError before
        with pytest.raises(InvalidRequest, match="RouterConfig"):
            ReplicaRouter(config)


def test_finite_loads_whose_sum_overflows_still_shed_an_overloaded_replica():
    router = ReplicaRouter(RouterConfig.numbered(3, load_factor=1.0, min_load=0, fallback="least_loaded"))
    names = [next(n for n in range(1000) if router.preferred([n]) == 0)]
    loads = [1.7e308, 8.5e307, 0.0]  # their sum is inf: the threshold was inf and nothing was shed
    assert router.threshold(loads) == pytest.approx(8.5e307) and router.route(names, loads) == 2


def chat_turns(first_turn_pages: int, turns: int, seed: int) -> list[np.ndarray]:
    """The prompts of one chat: each turn's prompt is the previous one plus the reply and a new message."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 1000, first_turn_pages * PAGE)
    out = []
    for _ in range(turns):
        out.append(names_of(prompt))
        prompt = np.concatenate([prompt, rng.integers(0, 1000, PAGE + int(rng.integers(0, 2 * PAGE)))])
    return out


def test_the_turns_of_a_short_chat_stay_on_one_replica():
    """Each turn extends the previous one, all shorter than the routing depth: one replica for the whole chat
    (routing by the last full page sent nearly every turn elsewhere), and distinct chats still spread."""
    router = ReplicaRouter(RouterConfig.numbered(8, depth_pages=16))
    preferred = []
    for chat in range(40):
        turns = chat_turns(1, 5, seed=100 + chat)
        assert all(len(t) < 16 for t in turns)
        chosen = {router.route(t, [0] * 8) for t in turns}
        assert len(chosen) == 1
        preferred.append(chosen.pop())
    assert len(set(preferred)) >= 6


def test_a_chat_changes_replica_at_most_once_at_the_depth():
    router = ReplicaRouter(RouterConfig.numbered(8, depth_pages=4))
    moves = 0
    for chat in range(30):
        turns = chat_turns(1, 8, seed=200 + chat)
        picks = [router.preferred(t) for t in turns]
        for before, after, prev, cur in zip(picks, picks[1:], turns, turns[1:]):
            if before != after:  # only where the turn crossed the depth
                assert len(prev) < 4 <= len(cur)
                moves += 1
        deep = [p for p, t in zip(picks, turns) if len(t) >= 4]
        assert len(set(deep)) == 1
    assert moves > 0


def test_the_random_fallback_is_the_runtimes_seeded_choice():
    """Past the threshold ``random`` falls back to the runtime's own choice (a uniform draw over all replicas),
    seeded when asked; under the threshold the preferred replica, as before."""
    config = dict(depth_pages=1, load_factor=1.5, min_load=3, fallback="random", seed=3)
    router = ReplicaRouter(RouterConfig.numbered(4, **config))
    names = names_of(np.arange(2 * PAGE))
    hot = router.preferred(names)
    calm = [1, 1, 1, 1]
    assert all(router.route(names, calm) == hot for _ in range(50))
    loads = [1, 1, 1, 1]
    loads[hot] = 9
    picks = [router.route(names, loads) for _ in range(400)]
    counts = np.bincount(picks, minlength=4)
    assert counts.min() > 60  # every replica, the overloaded one included, about a quarter of the time
    again = ReplicaRouter(RouterConfig.numbered(4, **config))
    assert [again.route(names, loads) for _ in range(400)] == picks
    least = ReplicaRouter(RouterConfig.numbered(4, depth_pages=1, load_factor=1.5, min_load=3,
                                                fallback="least_loaded"))
    loads[least.ranking(least.routing_name(names))[2]] = 0
    assert {least.route(names, loads) for _ in range(20)} == {loads.index(0)}


def hot_prefix_chats(chats: int, depth_pages: int, turns: int, seed: int) -> list[list[np.ndarray]]:
    """Chats whose prompts all begin with one shared prefix of ``depth_pages + 2`` pages (a system prompt
    longer than the routing depth), then the chat's own pages; each turn extends the one before."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 1000, (depth_pages + 2) * PAGE)
    out = []
    for _ in range(chats):
        prompt = np.concatenate([system, rng.integers(0, 1000, depth_pages * PAGE)])
        chat = []
        for _ in range(turns):
            chat.append(names_of(prompt))
            prompt = np.concatenate([prompt, rng.integers(0, 1000, PAGE + int(rng.integers(0, 3 * PAGE)))])
        out.append(chat)
    return out


def test_the_default_rule_sends_a_hot_prefixs_overflow_by_its_deeper_page():
    """The default: threshold max(3, 2 x mean); past it, the first replica under the threshold in the ranking
    of the page twice as deep. Chats sharing a hot prefix all prefer one replica; once it is loaded, each chat
    overflows to one replica of its own, every turn, and the chats' overflow covers the other replicas."""
    config = RouterConfig.numbered(4, depth_pages=4)
    assert (config.fallback, config.load_factor, config.min_load) == ("deeper", 2.0, 3)
    router = ReplicaRouter(config)
    chats = hot_prefix_chats(40, 4, 6, seed=11)
    hot = router.preferred(chats[0][0])
    assert all(router.preferred(t) == hot for chat in chats for t in chat)
    calm = [0, 0, 0, 0]
    calm[hot] = 3  # at the floor: still the preferred replica
    assert router.threshold(calm) == 3 and all(router.route(t, calm) == hot for chat in chats for t in chat)
    busy = [0, 0, 0, 0]
    busy[hot] = 4  # mean 1, threshold 3: past it
    overflow = []
    for chat in chats:
        chosen = {router.route(t, busy) for t in chat}
        assert len(chosen) == 1 and hot not in chosen  # one replica for the whole chat's overflow
        deep = router.overflow_name(chat[-1])
        assert chosen == {next(i for i in router.ranking(deep) if i != hot)}
        overflow.append(chosen.pop())
    assert set(overflow) == set(range(4)) - {hot}
    # The deeper ranking is walked to the first replica under the threshold, skipping any past it.
    chat = chats[0][-1]
    skip = [i for i in router.ranking(router.overflow_name(chat)) if i != hot]
    loads = [0, 0, 0, 0]
    loads[hot], loads[skip[0]] = 8, 5  # mean 3.25, threshold 6.5: the hot one past it, skip[0] under
    assert router.route(chat, loads) == skip[0]
    strict = ReplicaRouter(RouterConfig.numbered(4, depth_pages=4, load_factor=1.0, min_load=0))
    loads = [0, 0, 0, 0]
    loads[hot], loads[skip[0]] = 6, 5  # mean 2.75, the threshold: both past it, so the next one
    assert strict.route(chat, loads) == skip[1]


def test_the_overflow_name_is_the_page_twice_as_deep_or_the_last():
    router = ReplicaRouter(RouterConfig.numbered(4, depth_pages=3))
    names = names_of(np.arange(10 * PAGE))
    assert router.overflow_name(names) == int(names[5])
    assert router.overflow_name(names[:4]) == int(names[3])
    assert router.overflow_name(names[:1]) == int(names[0])
    assert router.overflow_name(names[:0]) is None


def test_a_prompt_without_a_full_page_is_drawn_uniformly_by_default():
    router = ReplicaRouter(RouterConfig.numbered(3, seed=5))
    assert {router.route([], [9, 0, 0]) for _ in range(200)} == {0, 1, 2}


names_strategy = st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=12)
loads_strategy = st.lists(st.integers(0, 40), min_size=4, max_size=4)


@settings(max_examples=300, deadline=None)
@given(names=names_strategy, loads=loads_strategy, depth=st.integers(1, 6), factor=st.sampled_from([1.0, 1.25, 2.0]),
       min_load=st.sampled_from([0, 1, 3, 8]))
def test_the_default_rule_over_any_names_and_loads(names, loads, depth, factor, min_load):
    """Invariants of the default rule: the preferred replica depends on the routing name and the replica set
    only (not on loads, nor on the replicas' order); under the threshold (or least loaded) it is chosen;
    past it the choice is the first replica under the threshold in the deeper page's ranking; nothing
    depends on earlier calls."""
    config = RouterConfig(("a", "b", "c", "d"), depth_pages=depth, load_factor=factor, min_load=min_load)
    router = ReplicaRouter(config)
    reordered = ReplicaRouter(RouterConfig(("c", "a", "d", "b"), depth_pages=depth, load_factor=factor,
                                           min_load=min_load))
    name = router.routing_name(names)
    pref = router.preferred(names)
    assert config.replicas[pref] == reordered.config.replicas[reordered.preferred(names)]
    assert pref == router.ranking(name)[0]
    chosen = router.route(names, loads)
    threshold = router.threshold(loads)
    if loads[pref] <= threshold or loads[pref] == min(loads):
        assert chosen == pref
    else:
        assert chosen != pref and loads[chosen] <= threshold
        under = [i for i in router.ranking(router.overflow_name(names)) if loads[i] <= threshold]
        assert chosen == under[0]
    assert ReplicaRouter(config).route(names, loads) == chosen == router.route(names, loads)
    assert router.route_by_names(name, router.overflow_name(names), loads) == chosen
    assert config.replicas[chosen] == reordered.config.replicas[reordered.route(names, [
        loads[config.replicas.index(r)] for r in reordered.config.replicas])]


def _route_distinct_prefixes(router: ReplicaRouter, first: int, count: int) -> None:
    """Routes ``count`` prompts with distinct page names, under loads that send some past the threshold."""
    for k in range(first, first + count):
        names = np.array([k * 7 + 1, k * 7 + 2, k * 7 + 3, 2**63 + k], dtype=np.uint64)
        loads = [k % 5, (k * 3) % 11, 0, 9 if k % 2 else 1]
        router.route(names, loads)


def _container_sizes(router: ReplicaRouter) -> dict:
    return {key: len(value) for key, value in vars(router).items() if hasattr(value, "__len__")}


def _memory_growth(router: ReplicaRouter) -> int:
    """Bytes still allocated after routing 9,000 distinct prefixes more than after a warm-up of 1,000."""
    gc.collect()
    tracemalloc.start()
    try:
        _route_distinct_prefixes(router, 0, 1_000)
        gc.collect()
        warm = tracemalloc.get_traced_memory()[0]
        _route_distinct_prefixes(router, 1_000, 9_000)
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - warm
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("fallback", ["deeper", "random", "least_loaded"])
def test_the_routers_memory_is_flat_over_10000_distinct_prefixes(fallback):
    """No per-prefix state: after a warm-up of 1,000 distinct prefixes, 9,000 more leave the memory the router
    holds where it was (within 64 KiB, far below what keeping a record of each prefix would take: an int per
    prefix alone is 28 bytes, a dict entry more), and none of its containers grows."""
    router = ReplicaRouter(RouterConfig.numbered(4, depth_pages=2, fallback=fallback, seed=0))
    sizes = _container_sizes(router)
    assert _memory_growth(router) < 64 * 1024
    assert _container_sizes(router) == sizes
    assert set(vars(router)) == {"config", "_seeds", "_draw", "_draw_lock"}


def test_the_memory_check_sees_a_router_that_keeps_each_prefix():
    """The check above can fail: a router that remembers every routing name it saw grows past the bound."""

    class Remembering(ReplicaRouter):
        def route(self, names, loads):
            self.__dict__.setdefault("_seen", {})[self.routing_name(names)] = True
            return super().route(names, loads)

    assert _memory_growth(Remembering(RouterConfig.numbered(4, depth_pages=2))) > 64 * 1024
