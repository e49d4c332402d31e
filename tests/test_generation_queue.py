"""``GenerationQueue.check_room``: it refuses exactly when ``submit`` would, for the same owner at the same moment
(the queue full, the owner at its share, the queue closing), counts no cancelled job, and queues nothing."""

import pytest

from mmcache.server.engine_host import QueueFull
from mmcache.server.job_queue import GenerationQueue
from server_helpers import Blocked


def _would_submit(queue: GenerationQueue, owner) -> bool:
    """Whether ``submit`` takes a job of ``owner`` now (the job, taken, is cancelled again)."""
    try:
        queue.submit(lambda job: None, owner).cancel()
    except QueueFull:
        return False
    return True


def _room(queue: GenerationQueue, owner) -> bool:
    try:
        queue.check_room(owner)
    except QueueFull:
        return False
    return True


@pytest.fixture
def queue():
    q = GenerationQueue("test", max_waiting=3, owner_share=2)
    yield q
    q.close()


def test_check_room_agrees_with_submit_and_queues_nothing(queue):
    with Blocked(queue):  # the worker busy: what is submitted waits
        for owners in ([], ["a"], ["a", "a"], ["a", "a", "b"]):
            jobs = [queue.submit(lambda job: None, owner) for owner in owners]
            for owner in ("a", "b", None):
                waiting = queue.waiting
                assert _room(queue, owner) == _would_submit(queue, owner), (owners, owner)
                assert queue.waiting == waiting
            for job in jobs:
                job.cancel()


def test_its_refusals_name_the_queue_limit_or_the_share(queue):
    with Blocked(queue):
        jobs = [queue.submit(lambda job: None, "a") for _ in range(2)]
        with pytest.raises(QueueFull, match="share is 2"):
            queue.check_room("a")
        queue.check_room("b")  # another owner still has room
        jobs.append(queue.submit(lambda job: None, "b"))
        with pytest.raises(QueueFull, match="limit is 3"):
            queue.check_room("c")
        jobs[0].cancel()  # a cancelled job holds no place
        queue.check_room("c")
        queue.check_room("a")
        for job in jobs:
            job.cancel()


def test_a_closing_queue_has_no_room():
    queue = GenerationQueue("test", max_waiting=1)
    queue.check_room()
    queue.close()
    with pytest.raises(QueueFull, match="closing"):
        queue.check_room()
