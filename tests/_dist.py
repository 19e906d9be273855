"""Run a function on N real processes with gloo, never hanging: the helper for tests/parallel/test_parallel_*."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pystronghold.parallel.groups import free_local_port


def _entry(rank: int, fn, world: int, port: int, init: bool, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # the machine is small; ranks must not fight over cores
    torch.manual_seed(0)
    if init:
        from pystronghold.parallel import init_parallel
        init_parallel(tp_size=1, timeout_s=30)  # the default group only; the test makes its grid
    try:
        fn(rank, world, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, init: bool = True, timeout_s: float = 60.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes; re-raise the first failure.

    ``fn`` must be a module-level function. With ``init`` the default gloo group exists when it
    runs (30 s collective timeout). Processes still running after ``timeout_s`` are killed and
    TimeoutError is raised, so a broken collective fails the test instead of hanging it.
    """
    # NOTE: forkserver: children fork from one server that imported torch once (a fresh spawn
    # costs seconds per process on a busy machine), and no child inherits the test's threads.
    mp.set_forkserver_preload(["torch", "torch.distributed", "pystronghold.models", "pytest"])
    ctx = mp.start_processes(_entry, args=(fn, world, free_local_port(), init, args), nprocs=world, join=False,
                   start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=0.2):  # raises ProcessRaisedException/ProcessExitedException
        if time.monotonic() > deadline:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{fn.__name__} on {world} ranks still running after {timeout_s} s")
