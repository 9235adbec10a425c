"""Run a function on 2 processes joined in a gloo process group on 127.0.0.1 (spawned, as
torchrun would start them), and collect what each rank returns. Tests call `on_two_ranks`;
without torch.distributed or gloo they are skipped."""
from __future__ import annotations

import os
import queue as queue_module
import socket
import time
import traceback

import pytest
import torch

WORLD = 2


def gloo_available() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


requires_gloo = pytest.mark.skipif(not gloo_available(), reason="torch.distributed with gloo is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, fn, args: tuple, queue) -> None:
    import torch.distributed as dist

    import torchweld

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)  # two ranks on a small machine
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        with torchweld.config.patch(raise_internal_errors=True):
            result = fn(rank, *args)
        queue.put((rank, "ok", result))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def on_two_ranks(fn, *args, timeout: float = 240) -> list:
    """`fn(rank, *args)` on ranks 0 and 1; their results, by rank. A rank that raised fails
    the test with its traceback. `fn` must be importable (defined at a module's top level)."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    workers = [context.Process(target=_rank_main, args=(r, port, fn, args, queue)) for r in range(WORLD)]
    for w in workers:
        w.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < WORLD and not errors:
            try:
                rank, status, value = queue.get(timeout=1)
            except queue_module.Empty:
                dead = [r for r, w in enumerate(workers) if not w.is_alive() and r not in results]
                if dead and queue.empty():  # died before reporting (a crash, an import error)
                    errors.append(f"rank {dead[0]} exited with code {workers[dead[0]].exitcode} without a result")
                elif time.monotonic() > deadline:
                    errors.append(f"no result from ranks {sorted(set(range(WORLD)) - set(results))} in {timeout} s")
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank} raised:\n{value}")
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    return [results[r] for r in range(WORLD)]
