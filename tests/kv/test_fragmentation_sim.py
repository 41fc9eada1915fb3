"""The fragmentation benchmark's replay keeps both stores consistent."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_fragmentation as bench  # noqa: E402

MIB = 2**20


def test_caching_allocator_splits_merges_within_a_segment_and_releases():
    allocator = bench.CachingAllocator(budget=64 * MIB)
    a = allocator.malloc(3 * MIB)  # from a fresh 20 MiB segment, split
    b = allocator.malloc(3 * MIB)  # best fit: the 17 MiB remainder of the same segment
    assert a.segment is b.segment and allocator.reserved == 20 * MIB
    allocator.free(a)
    allocator.free(b)
    assert allocator.allocated == 0 and allocator.reserved == 20 * MIB  # cached, not returned
    assert allocator.segments[0].head.size == 20 * MIB  # merged back into one chunk
    big = allocator.malloc(50 * MIB)  # over budget with the cache: released, then fits
    assert big is not None and allocator.reserved == 50 * MIB
    assert allocator.malloc(20 * MIB) is None  # a true OOM


def test_replay_finishes_every_request_and_leaves_the_pool_whole():
    workload = bench.make_workload(40, context=512, max_seqs=8, seed=1)
    bytes_per_token = 1024 * 4
    paged = bench.PagedStore(64 * MIB, bytes_per_token, block_size=16)
    trace = bench.replay(paged, workload, max_seqs=8, bytes_per_token=bytes_per_token)
    assert paged.manager.num_free_blocks == paged.manager.num_blocks
    paged.manager.check_integrity()
    contiguous = bench.ContiguousStore(64 * MIB, bytes_per_token, num_layers=4)
    trace_c = bench.replay(contiguous, workload, max_seqs=8, bytes_per_token=bytes_per_token)
    assert contiguous.allocator.allocated == 0 and not contiguous.tensors
    for t in (trace, trace_c):
        assert all(live <= held for live, held in zip(t.live, t.held, strict=True))
        assert t.live[-1] == 0
    # Internal fragmentation of the pool is at most one partly filled block per request.
    slack = [held - live for live, held in zip(trace.live, trace.held, strict=True)]
    assert max(slack) <= 8 * 15 * bytes_per_token
