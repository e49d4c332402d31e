"""A server in its own process, as ``mmcache serve`` runs, for the parts of ``mmcache bench serve`` that time
what a client sees.

``ServerProcess(config, threads)`` spawns a child process that runs ``mmcache.presets.serve(config)`` (what
``mmcache serve`` runs) on a free loopback port with ``threads`` torch threads; the benchmark's client then no
longer shares the server's interpreter and GIL, as no real client does. The child answers the parent over a pipe:

* ``check_idle()`` waits (at most ``timeout_s``) until the server's engine has nothing waiting or running, then
  returns what it still holds (``serve_soak.held_after``, which runs ``check_invariants``); ``LeftHeld`` is raised
  in the parent when anything is held, an invariant broke or it never went idle.
* ``quiet_openmp()`` keeps Intel OpenMP's idle threads from spinning, in this process and in a server started
  inside the block: that runtime (which ``mmcache.launcher.openmp`` starts the command line on) spins a process's threads
  for 200 ms after each parallel region (``KMP_BLOCKTIME``), so with the engines of two processes taking turns
  on two cores, each turn would share the cores with the other engine's spinning threads. Both sides get the
  same setting: the pairs still compare like with like.
* Leaving the block stops the server (nothing held, as ``start_server`` guarantees) and ends the child; a child
  that fails to start or dies raises ``ServerProcessError`` with its error.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

from mmcache.errors import MmcacheError

IDLE_TIMEOUT_S = 30.0
_POLL_S = 0.2
_STOP_TIMEOUT_S = 60.0


@contextmanager
def quiet_openmp(runtime=None):
    """Inside the block Intel OpenMP's threads sleep as soon as a parallel region ends, here and in processes
    started in it (module docstring). ``runtime`` (default: this process's global symbols) is for tests; with
    another OpenMP runtime (GNU's, which spins far shorter) only the environment is set."""
    lib = runtime if runtime is not None else ctypes.CDLL(None)
    get, set_ = getattr(lib, "kmp_get_blocktime", None), getattr(lib, "kmp_set_blocktime", None)
    before_env, before = os.environ.get("KMP_BLOCKTIME"), get() if get is not None else None
    os.environ["KMP_BLOCKTIME"] = "0"
    if set_ is not None:
        set_(ctypes.c_int(0))
    try:
        yield
    finally:
        if before_env is None:
            os.environ.pop("KMP_BLOCKTIME", None)
        else:
            os.environ["KMP_BLOCKTIME"] = before_env
        if set_ is not None and before is not None:
            set_(ctypes.c_int(before))


class ServerProcessError(MmcacheError, RuntimeError):
    """The server's process failed to start, died, or could not answer."""


@dataclass
class ServerProcess:
    """``with ServerProcess(config, threads) as srv:`` ``srv.url``, ``srv.base_url`` and ``srv.config`` as on
    ``start_server``'s ``RunningServer``."""

    config: object  # a ServerConfig
    threads: int = 1
    url: str = ""
    base_url: str = ""
    _proc: object = field(default=None, repr=False)
    _conn: object = field(default=None, repr=False)

    def __enter__(self) -> "ServerProcess":
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of the bench's state
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.config, self.threads), name="mmcache-bench-server",
                                 daemon=True)
        self._proc.start()
        child.close()
        try:
            self.url = self._answer()
        except BaseException:
            self._end()
            raise
        self.base_url = self.url + "/v1"
        return self

    def __exit__(self, *exc) -> None:
        self._end()

    def check_idle(self, timeout_s: float = IDLE_TIMEOUT_S) -> dict:
        """What the idle server holds (all zero), else ``LeftHeld``."""
        from .serve_soak import LeftHeld

        self._conn.send(("check_idle", timeout_s))
        idle, held, broken = self._answer()
        if broken or not idle or any(held.values()):
            raise LeftHeld(f"after a measured part: idle {idle}, held {held}, invariants {broken or 'ok'}")
        return held

    def _answer(self):
        while not self._conn.poll(_POLL_S):
            if not self._proc.is_alive():
                raise ServerProcessError(f"the server's process ended (exit code {self._proc.exitcode})")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise ServerProcessError("the server's process closed its pipe") from None
        if kind == "error":
            raise ServerProcessError(f"the server's process failed: {value}")
        return value

    def _end(self) -> None:
        if self._proc is None:
            return
        if self._proc.is_alive():
            try:
                self._conn.send(("stop", None))
            except OSError:  # the child has gone already
                pass
            self._proc.join(_STOP_TIMEOUT_S)
            if self._proc.is_alive():  # a server that does not stop is not left running
                self._proc.terminate()
                self._proc.join()
        self._conn.close()
        self._proc = None


def _serve(conn, config, threads: int) -> None:
    """The child: serve until told to stop, answering ``check_idle``."""
    import torch

    from mmcache.presets import serve

    torch.set_num_threads(threads)
    try:
        with serve(config) as srv:
            conn.send(("ok", srv.url))
            while True:
                command, arg = conn.recv()
                if command == "stop":
                    break
                conn.send(("ok", _idle_report(srv.host, arg)))
    except BaseException as e:  # the parent raises it as ServerProcessError
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def _idle_report(host, timeout_s: float) -> tuple[bool, dict, str | None]:
    from .serve_soak import held_after, wait_idle

    idle = wait_idle(host, timeout_s)
    try:
        return idle, held_after(host), None
    except Exception as e:  # check_invariants: a broken invariant is a finding, reported by the parent
        return idle, {}, f"{type(e).__name__}: {e}"
