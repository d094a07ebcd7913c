"""tp ranks as threads of one process, their torch.distributed calls answered among themselves.

The graded tests of Part 8 run on this: the grader swaps a submission's functions into the test's
own process, which processes started afresh would not see. Each thread is one rank; all_reduce and
all_gather meet at a barrier, sum (in rank order, so every rank gets the same bits) or collect, and
write the result in place, as gloo would. The real thing, several processes over gloo, is checked by
tests/test_parallel.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist


class SimulatedRanks:
    def __init__(self, tp: int):
        self.tp = tp
        self.barrier = threading.Barrier(tp, timeout=120)
        self.slots: list = [None] * tp
        self.local = threading.local()
        self.calls: list[list[tuple[str, int]]] = [[] for _ in range(tp)]  # per rank: (name, bytes)

    def rank(self, group=None) -> int:
        return self.local.rank

    def world_size(self, group=None) -> int:
        return self.tp

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.rank()] = tensor.detach().clone()
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before all have read it
        return everyone

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        self.calls[self.rank()].append(("all_reduce", tensor.numel() * tensor.element_size()))
        parts = self._exchange(tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        tensor.copy_(total)

    def all_gather(self, tensors, tensor, group=None, async_op=False):
        self.calls[self.rank()].append(("all_gather", tensor.numel() * tensor.element_size()))
        for out, part in zip(tensors, self._exchange(tensor), strict=True):
            out.copy_(part)

    def run(self, fn: Callable[[int], object]) -> list:
        """fn(rank) on every rank at once; their results, rank 0 first (a rank's error is raised)."""
        results: list = [None] * self.tp
        errors: list = [None] * self.tp

        def one(rank: int) -> None:
            self.local.rank = rank
            try:
                with torch.inference_mode():  # thread-local: entered in the rank's own thread
                    results[rank] = fn(rank)
            except BaseException as e:  # let the others stop waiting at the barrier
                errors[rank] = e
                self.barrier.abort()

        patches = dict(
            all_reduce=self.all_reduce, all_gather=self.all_gather, get_rank=self.rank,
            get_world_size=self.world_size, is_initialized=lambda: True,
        )  # fmt: skip
        with mock.patch.multiple(dist, **patches):
            threads = [threading.Thread(target=one, args=(r,)) for r in range(self.tp)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        first = next(
            (e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None
        )
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results


def on_ranks(tp: int, fn: Callable[[int], object]) -> list:
    return SimulatedRanks(tp).run(fn)
