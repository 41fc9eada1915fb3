"""Block pool and prefix cache: reference counts, LRU reuse, collision safety."""

from __future__ import annotations

from tokenmill.core.kv_manager import KVCacheManager
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), 0.0, 16)


def compute_all(kv: KVCacheManager, req: Request) -> None:
    cached = kv.find_cached_blocks(req)
    req.num_computed_tokens = len(cached) * kv.block_size
    assert kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens, cached)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req)


def test_shared_prefix_blocks_are_reference_counted():
    kv = KVCacheManager(16, 4)
    a, b = request("a", list(range(10))), request("b", list(range(8)) + [50, 51, 52])
    compute_all(kv, a)
    compute_all(kv, b)
    assert kv.block_tables["a"][:2] == kv.block_tables["b"][:2]
    assert kv.blocks[kv.block_tables["a"][0]].ref_count == 2
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16
    kv.check_integrity()


def test_freed_cached_blocks_are_reused_before_eviction_and_evicted_lru():
    kv = KVCacheManager(4, 2)
    first = request("x", [1, 2, 3, 4, 5])
    compute_all(kv, first)
    kv.free(first)
    again = request("y", [1, 2, 3, 4, 9])
    assert len(kv.find_cached_blocks(again)) == 2
    # A different request needing all blocks evicts the cached ones.
    other = request("z", [7] * 8)
    compute_all(kv, other)
    assert kv.find_cached_blocks(request("w", [1, 2, 3, 4, 5])) == []
    kv.check_integrity()


def test_hash_collision_cannot_return_wrong_blocks():
    # A hash function that collides on everything: lookups must still verify content.
    kv = KVCacheManager(16, 2, hash_fn=lambda parent, tokens: b"same")
    compute_all(kv, request("a", [1, 2, 3, 4, 5]))
    assert kv.find_cached_blocks(request("b", [9, 9, 3, 4, 5])) == []
    assert len(kv.find_cached_blocks(request("c", [1, 2, 8, 8, 8]))) == 1


def test_stale_child_does_not_match_a_reused_parent():
    # Parent hashes collide by construction; only the block chain identity tells apart.
    kv = KVCacheManager(3, 2, hash_fn=lambda parent, tokens: bytes(tokens))
    a = request("a", [1, 2, 3, 4, 0])
    compute_all(kv, a)
    kv.free(a)
    kv.reset_prefix_cache()
    b = request("b", [1, 2, 3, 4, 0])
    assert kv.find_cached_blocks(b) == []
    kv.check_integrity()


def test_a_block_whose_parent_content_differs_is_not_returned():
    """A hash that ignores the parent makes "[1, 2] then [3, 4]" and "[7, 8] then [3, 4]"
    collide on their second block, whose own tokens match too: only the parent
    identity check tells that its K/V was computed after other tokens."""
    kv = KVCacheManager(16, 2, hash_fn=lambda parent, tokens: bytes(tokens))
    compute_all(kv, request("a", [1, 2, 3, 4, 0]))
    compute_all(kv, request("f", [7, 8, 0]))  # caches [7, 8] in a block of its own
    found = kv.find_cached_blocks(request("d", [7, 8, 3, 4, 0]))
    assert found == kv.block_tables["f"][:1]  # [7, 8] only, not a's [3, 4]
    kv.check_integrity()


def test_a_reservation_keeps_blocks_free():
    kv = KVCacheManager(4, 2)
    assert not kv.allocate_slots(request("a", [1] * 6), 6, reserve=2)  # 3 of 4, 2 kept
    assert kv.allocate_slots(request("b", [1] * 4), 4, reserve=2)
    assert kv.num_free_blocks == 2
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(2, 4)
    req = request("a", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert kv.num_free_blocks == 2 and not kv.block_tables
    kv.check_integrity()
