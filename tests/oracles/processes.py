"""Gloo process groups for multi-process tests: ``spawn(target, args, world)`` runs
``target(rank, world, *args)`` (a module-level function) on ``world`` fresh CPU processes on
127.0.0.1, each in an initialised default group, with a time limit; a worker that raises fails
the caller, and the processes are always torn down. A worker killed by a signal (gloo aborts
on a lost connection, e.g. a port taken between choosing and binding it) is retried once."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["spawn", "gloo_available"]


def gloo_available() -> bool:
    return dist.is_available() and dist.is_gloo_available()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, timeout_s: float, target, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        target(rank, world, *args)
        dist.barrier()  # nobody tears down while another rank still talks to it
    finally:
        dist.destroy_process_group()


def spawn(target, args: tuple, world: int, timeout_s: float = 120, attempts: int = 2) -> None:
    import torch.multiprocessing as mp

    for attempt in range(attempts):
        try:
            return _spawn_once(target, args, world, timeout_s)
        except mp.ProcessExitedException as e:
            if e.signal_name is None or attempt == attempts - 1:
                raise


def _spawn_once(target, args: tuple, world: int, timeout_s: float) -> None:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(world, _free_port(), timeout_s, target, args), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):  # raises if a worker raised
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target.__name__} on {world} processes ran past {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
