"""bench/kernel_time.py: a trace's GPU time by kernel, overlapping launches counted once."""
from bench.kernel_time import charge


def test_overlapping_kernels_are_charged_once_and_short_gaps_are_idle():
    kernels = [(0.0, 10.0, "a"), (8.0, 15.0, "b"),   # b starts under a (PDL): charged from 10
               (17.0, 20.0, "a"),                    # a gap of 2 us: idle
               (120.0, 125.0, "c"),                  # a gap of 100 us: the host's, not charged
               (121.0, 124.0, "d")]                  # inside c: nothing left to charge
    assert charge(kernels, idle_gap_us=20) == {"a": 13.0, "b": 5.0, "c": 5.0, "(idle)": 2.0}
    assert charge(kernels, idle_gap_us=None) == {"a": 13.0, "b": 5.0, "c": 5.0}
    assert charge([], idle_gap_us=20) == {}
