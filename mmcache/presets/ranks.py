"""The ranks of a tensor-parallel server (``mmcache serve --tensor-parallel-size N``).

Rank 0 is the serving process; ``start_group`` starts ranks 1 .. N-1 as child processes of it
(``python -m mmcache.presets.ranks``), hands each the server's config through its standard input, and joins the
group with them over gloo on the loopback address. Each child builds the same chat engine (``build_engine``: the
preset or folder the config names, cut to its slice) and follows rank 0 (``Engine.follow``) until rank 0 stops the
group. Invariants:

* A child that exits before the group is formed (a model it cannot build) fails the start with its exit code and
  the end of its output; the start does not wait out the group's timeout for it.
* ``FollowerGroup.close`` stops the followers (rank 0's engine sends stop) and waits for them, killing one that
  has not ended within the group's timeout; no child outlives the command.
* A child whose group fails (rank 0 died, or stopped answering past the timeout) exits with status 1.
"""

from __future__ import annotations

import datetime
import pickle
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass

from ..errors import GroupFailed

_ADDRESS = "127.0.0.1"


@dataclass
class FollowerGroup:
    processes: list
    timeout_s: float

    def close(self, engine=None) -> list[int]:
        """Stop the followers (``engine``: rank 0's core engine, which tells them) and reap them; their exit codes."""
        if engine is not None:
            engine.stop_group()
        codes = []
        for p in self.processes:
            try:
                codes.append(p.wait(timeout=self.timeout_s))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes


def check_splits(config, size: int) -> None:
    """``UnsupportedModel`` where the chat model ``config`` names cannot be split over ``size`` ranks, from its
    config (a text preset's or a folder's; a VLM preset is built, as the tiny ones are quick to), before any rank
    starts."""
    from transformers import AutoConfig

    from ..engine.models import ModelLoadError
    from ..engine.tensor_parallel import check_splits as check
    from .text import PRESETS, get_preset, preset_config
    from .vlm import build_vlm

    if config.preset in PRESETS:
        model_config, name = preset_config(get_preset(config.preset)), config.preset
    elif config.preset is not None:
        model_config, name = build_vlm(config.preset).model.config, config.preset
    else:
        try:
            model_config, name = AutoConfig.from_pretrained(config.model), str(config.model)
        except Exception as e:  # no config.json, a damaged one, an unknown model type
            raise ModelLoadError(f"cannot read the config of {config.model}: {type(e).__name__}: {e}") from e
    check(model_config.get_text_config(), size, name)


def start_group(config, size: int, timeout_s: float) -> FollowerGroup:
    """Start ranks 1 .. ``size - 1`` for ``config`` (a ``ServerConfig``) and join them as rank 0 (this process's
    default ``torch.distributed`` group). ``UnsupportedModel`` before any rank starts where the model cannot be
    split (``check_splits``); ``RuntimeError`` when a rank exits or the group does not form in time."""
    import torch.distributed as dist

    check_splits(config, size)
    with socket.socket() as s:
        s.bind((_ADDRESS, 0))
        port = s.getsockname()[1]
    payload = pickle.dumps(config)
    procs = []
    for rank in range(1, size):
        p = subprocess.Popen([sys.executable, "-m", "mmcache.presets.ranks", str(rank), str(size), str(port),
                              str(timeout_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
        p.stdin.write(payload)
        p.stdin.close()
        procs.append(p)
    group = FollowerGroup(procs, timeout_s)
    failure: list = []

    def join():
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{_ADDRESS}:{port}", rank=0, world_size=size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # the store's wait for the other ranks timed out
            failure.append(e)

    joining = threading.Thread(target=join, name="mmcache-tp-join", daemon=True)
    joining.start()
    while joining.is_alive():
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            group.close()
            out = dead[0].stdout.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"tensor-parallel rank {procs.index(dead[0]) + 1} exited with status "
                               f"{dead[0].returncode} before the group formed:\n{out}")
        joining.join(0.1)
    if failure:
        group.close()
        raise RuntimeError(f"the tensor-parallel group did not form: {type(failure[0]).__name__}: {failure[0]}")
    for p in procs:  # from here their output goes to ours (a thread each, so a full pipe never blocks them)
        threading.Thread(target=_relay, args=(p,), daemon=True).start()
    return group


def _relay(p) -> None:
    for line in p.stdout:
        sys.stderr.write(line.decode(errors="replace"))


def follower_main(argv: list[str]) -> int:
    """A follower rank: join the group, build the chat engine ``config`` names, follow rank 0."""
    import torch.distributed as dist

    from ..engine.tp_group import leave
    from .serving import build_engine

    rank, size, port, timeout_s = int(argv[0]), int(argv[1]), int(argv[2]), float(argv[3])
    config = pickle.loads(sys.stdin.buffer.read())  # from the parent process that started this one
    dist.init_process_group("gloo", init_method=f"tcp://{_ADDRESS}:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        _follow(build_engine(config))
    except GroupFailed as e:
        print(f"mmcache serve: tensor-parallel rank {rank}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        leave()  # the engine is gone by now (``_follow``'s frame holds it)
    return 0


def _follow(engine) -> None:
    getattr(engine, "engine", engine).follow()  # a VLM front end's own engine (the tower runs on rank 0)


if __name__ == "__main__":
    sys.exit(follower_main(sys.argv[1:]))
