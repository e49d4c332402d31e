"""The replica router: rendezvous affinity on a page name later turns share, and its fallback past the threshold
(random by default, or the least-loaded replica)."""

import numpy as np
import pytest

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


def test_the_default_fallback_is_the_runtimes_random_choice():
    """Past the threshold the RFC falls back to the runtime's own choice (a uniform draw over all replicas),
    seeded when asked; under the threshold the preferred replica, as before."""
    assert RouterConfig(("a",)).fallback == "random"
    router = ReplicaRouter(RouterConfig.numbered(4, depth_pages=1, load_factor=1.5, min_load=3, seed=3))
    names = names_of(np.arange(2 * PAGE))
    hot = router.preferred(names)
    calm = [1, 1, 1, 1]
    assert all(router.route(names, calm) == hot for _ in range(50))
    loads = [1, 1, 1, 1]
    loads[hot] = 9
    picks = [router.route(names, loads) for _ in range(400)]
    counts = np.bincount(picks, minlength=4)
    assert counts.min() > 60  # every replica, the overloaded one included, about a quarter of the time
    again = ReplicaRouter(RouterConfig.numbered(4, depth_pages=1, load_factor=1.5, min_load=3, seed=3))
    assert [again.route(names, loads) for _ in range(400)] == picks
    least = ReplicaRouter(RouterConfig.numbered(4, depth_pages=1, load_factor=1.5, min_load=3,
                                                fallback="least_loaded"))
    loads[least.ranking(least.routing_name(names))[2]] = 0
    assert {least.route(names, loads) for _ in range(20)} == {loads.index(0)}
