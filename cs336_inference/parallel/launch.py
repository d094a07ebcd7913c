"""Starting tp processes from Python (tests, benchmarks, notebooks): torchrun's job, in-process.

spawn(fn, world_size, *args) starts world_size fresh processes joined in one torch.distributed
group (gloo on CPU, NCCL when backend="nccl"), through a rendezvous file in a temporary folder (no
network port: 127.0.0.1 at most), runs fn(*args) on each and returns what each rank returned, rank
0 first. fn must be importable by name (a module-level function), as multiprocessing requires.
A rank that raises fails the call with that rank's traceback.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, rendezvous: str, backend: str, threads: int, fn, args, results) -> None:
    try:
        torch.set_num_threads(threads)
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
        try:
            results.put((rank, True, fn(*args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    backend: str = "gloo",
    threads: int = 1,
    timeout_s: float = 1800,
) -> list[Any]:
    """fn(*args) on world_size new processes of one group; their return values, by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, rendezvous, backend, threads, fn, args, results))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        try:
            while len(out) < world_size:
                try:
                    rank, ok, value = results.get(timeout=timeout_s)
                except queue.Empty:
                    raise RuntimeError(f"tensor-parallel ranks silent for {timeout_s:.0f} s") from None
                if not ok:
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                out[rank] = value
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return [out[r] for r in range(world_size)]


def init_from_torchrun(tp: int, device: str = "cpu", script: str = "scripts/generate.py") -> tuple[int, str]:
    """Join the group torchrun set up (its RANK / WORLD_SIZE / MASTER_ADDR variables); returns this
    rank and its device. On the CPU: gloo. On CUDA: rank r takes GPU LOCAL_RANK (modulo the GPUs
    there are) and NCCL, or gloo where ranks must share GPUs (NCCL wants one GPU per rank).
    ValueError (one line) without torchrun, with a world size that is not tp, or with no GPU."""
    world = os.environ.get("WORLD_SIZE")
    if world is None or "RANK" not in os.environ:
        raise ValueError(
            f"--tensor-parallel {tp} runs one process per shard: launch with "
            f"torchrun --standalone --nproc-per-node {tp} {script} --tensor-parallel {tp} ..."
        )
    if int(world) != tp:
        raise ValueError(f"--tensor-parallel {tp} but torchrun started {world} processes (--nproc-per-node)")
    backend, where = "gloo", "cpu"
    if device.startswith("cuda"):
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise ValueError("--device cuda: this machine has no CUDA GPU")
        where = f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % gpus}"
        torch.cuda.set_device(where)
        backend = "nccl" if gpus >= tp else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist.get_rank(), where


def common_seed(seed: int | None) -> int:
    """One seed for every rank (rank 0's choice when none is given): seeding each rank's global RNG
    with it makes unseeded sampling draw the same tokens everywhere."""
    box = [seed if seed is not None else int(torch.randint(0, 2**62, ()).item())]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])
