"""Run a function on W ranks over real gloo process groups, reusing the worker processes.

Starting torch (and transformers) costs seconds, so each world size gets one pool of worker
processes for the whole session. ``run_on_ranks(W, fn, *args)`` sends ``fn`` (by module and
name, so it must be a top-level function of an importable module) to every rank, and returns
the per-rank results in rank order. If any rank raises, a ``RankError`` carries every failing
rank's traceback. If the ranks do not all answer within ``timeout`` seconds the pool is killed
and ``RankTimeout`` is raised: a hang fails the test instead of freezing the suite.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import socket
import sys
import traceback
from typing import Any, Callable


class RankError(RuntimeError):
    def __init__(self, failures: dict[int, tuple[str, str, str]]) -> None:
        self.failures = failures  # rank -> (exception type name, message, traceback)
        first = min(failures)
        kind, message, tb = failures[first]
        super().__init__(f"rank {first} raised {kind}: {message}\n{tb}")

    @property
    def messages(self) -> list[str]:
        return [message for _, message, _ in self.failures.values()]


class RankTimeout(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, conn: Any, path: list[str], pg_timeout: float | None) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    sys.path[:0] = [p for p in path if p not in sys.path]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from datetime import timedelta

    timeout = {} if pg_timeout is None else {"timeout": timedelta(seconds=pg_timeout)}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, **timeout)
    import shardwrap.collectives

    # The test models are tiny: every data collective takes the pairwise path the large ones take
    # (design/notes/cpu-collectives.md); test_collectives.py covers torch's path against it.
    shardwrap.collectives.PAIRWISE_MIN_BYTES = 1
    shardwrap.collectives.PIECES_MIN_BYTES = 1  # and the per-piece form of it; test_collectives.py runs the one-message form
    while True:
        message = conn.recv()
        if message is None:
            break
        module_name, qualname, args, kwargs = message
        try:
            fn: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                fn = getattr(fn, part)
            conn.send((True, fn(*args, **kwargs)))
        except BaseException as exc:  # report everything, keep serving
            conn.send((False, (type(exc).__name__, str(exc), traceback.format_exc())))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world_size: int, pg_timeout: float | None = None) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.world_size = world_size
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, port, child, list(sys.path), pg_timeout), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        for conn in self.conns:
            conn.send((fn.__module__, fn.__qualname__, args, kwargs))
        results: list[Any] = []
        failures: dict[int, tuple[str, str, str]] = {}
        for rank, conn in enumerate(self.conns):
            if not conn.poll(timeout):
                raise RankTimeout(
                    f"{fn.__qualname__} on {self.world_size} ranks: rank {rank} gave no answer in {timeout:.0f} s (hang)"
                )
            try:
                ok, value = conn.recv()
            except (EOFError, ConnectionError) as exc:
                raise RankTimeout(f"{fn.__qualname__}: rank {rank} died ({exc!r}); see its stderr above") from None
            if ok:
                results.append(value)
            else:
                failures[rank] = value
                results.append(None)
        if failures:
            raise RankError(failures)
        return results

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()


_pools: dict[tuple[int, float | None], RankPool] = {}


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 180.0,
    fresh: bool = False,
    pg_timeout: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """``[fn(*args, **kwargs) on rank r for r in range(world_size)]``, over gloo.

    ``fresh=True`` runs it in newly started processes (as a job resumed after a restart would).
    ``pg_timeout`` (seconds) runs it in a pool whose process group has that timeout.
    """
    key = (world_size, pg_timeout)
    if fresh:
        _drop(key, kill=False)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = RankPool(world_size, pg_timeout)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except RankTimeout:
        _drop(key, kill=True)
        raise
    except RankError as err:
        # Ranks that all failed the same way (validation before any collective) stay in step;
        # anything else may have left a collective half-done, so start afresh.
        if len(err.failures) < world_size or len(set(err.messages)) > 1:
            _drop(key, kill=True)
        raise


def _drop(key: tuple[int, float | None], *, kill: bool) -> None:
    pool = _pools.pop(key, None)
    if pool is not None:
        if kill:
            for proc in pool.procs:
                proc.kill()
        else:
            pool.close()


@atexit.register
def _shutdown() -> None:
    for key in list(_pools):
        _drop(key, kill=False)
