"""pipeline/heap.py: freed heap memory goes back to the OS, rate-limited."""

import sys

import pytest
import torch

from sparkrelay.pipeline.heap import HeapTrimmer


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_trims_at_most_every_period():
    heap = HeapTrimmer(every_s=3600.0)
    assert not heap.maybe_trim()  # the period starts when the trimmer is made
    heap.every_s = 0.0
    assert heap.maybe_trim() == heap.available
    assert heap.count == int(heap.available)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc")
def test_freed_memory_below_a_live_block_goes_back():
    heap = HeapTrimmer(every_s=0.0)
    assert heap.available, "glibc without malloc_trim"
    heap.maybe_trim()
    # 128 blocks of 1 MiB, each followed by a small block kept alive: freeing the big ones leaves holes that plain
    # free() does not return (they are not at the top of the heap, and below glibc's raised mmap threshold)
    torch.empty(16 << 20, dtype=torch.uint8)  # a freed mmapped block raises glibc's mmap threshold above 1 MiB
    big, small = [], []
    for _ in range(128):
        big.append(torch.ones(1 << 20, dtype=torch.uint8))
        small.append(torch.ones(64, dtype=torch.uint8))
    before = resident_mib()
    big.clear()
    freed = resident_mib()
    heap.maybe_trim()
    after = resident_mib()
    assert freed - after > 64, (before, freed, after)
