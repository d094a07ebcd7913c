"""cs336_inference.bench.timing: the median after warm-up on a fake clock, the timer, the bandwidth probe."""

import pytest
import torch

from cs336_inference.bench import timing


class FakeClock:
    """Returns the given instants in order; each timed call reads it twice (start, stop)."""

    def __init__(self, *instants: float):
        self.instants = list(instants)

    def __call__(self) -> float:
        return self.instants.pop(0)


def test_median_skips_the_warmup_and_takes_the_median():
    calls = []
    # Three timed calls lasting 5, 1 and 3 seconds; the warm-up call reads no clock.
    clock = FakeClock(0, 5, 10, 11, 20, 23)
    seconds = timing.median_seconds(lambda: calls.append(1), repeats=3, warmup=1, clock=clock)
    assert seconds == 3 and len(calls) == 4 and not clock.instants
    # An even count: the mean of the middle two (2 and 4 seconds among 1, 2, 4, 8).
    clock = FakeClock(0, 1, 0, 8, 0, 2, 0, 4)
    assert timing.median_seconds(lambda: None, repeats=4, warmup=0, clock=clock) == 3


def test_median_rejects_bad_counts():
    with pytest.raises(ValueError, match="repeats"):
        timing.median_seconds(lambda: None, repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        timing.median_seconds(lambda: None, warmup=-1)


def test_timer_measures_the_block():
    with timing.Timer(clock=FakeClock(2.5, 4.0)) as t:
        pass
    assert t.seconds == 1.5
    with timing.Timer() as t:  # the real clock: positive and small
        sum(range(1000))
    assert 0 < t.seconds < 1


def test_read_bandwidth_and_matmul_rate_are_plausible():
    bandwidth = timing.read_bandwidth(8 * 2**20, repeats=3)
    assert 1e8 < bandwidth < 1e13  # 0.1 GB/s .. 10 TB/s
    assert 1e6 < timing.matmul_flops_per_second(128, repeats=3) < 1e16
    with pytest.raises(ValueError, match="n_bytes"):
        timing.read_bandwidth(0)


def test_last_level_cache_is_a_size_or_unknown():
    size = timing.last_level_cache_bytes()
    assert size is None or 2**10 <= size <= 2**34
    if torch.cuda.is_available():
        assert timing.last_level_cache_bytes("cuda") > 0
