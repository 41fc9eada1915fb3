"""Paged KV-cache bookkeeping: block pool, block tables, reference counts, prefix cache.

Pure Python: the tensors live in the model runner; this file only decides which
physical block holds which tokens of which request.

Invariants (checked by `check_integrity`):
- every block is either referenced (ref_count > 0) or in free_queue, never both;
- a block in free_queue may still hold a cached prefix (block_hash set): it is reused
  in LRU order, and its hash is dropped only when it is handed out again;
- `cached` maps a hash to a block whose block_hash is that hash.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)

HashFn = Callable[[bytes | None, tuple[int, ...]], bytes]


class Sequence(Protocol):
    """What the block manager reads of a sequence of tokens: an engine `Request`, or a
    speculative proposer's own view of one (a draft model's shadow, an EAGLE head's
    pairs)."""

    request_id: str
    num_computed_tokens: int
    all_token_ids: list[int]


def chained_block_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """sha256(parent hash || token ids): a block's identity includes its whole prefix."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block holds a full, cached block of tokens.
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    # (block_id, epoch) of the cached block before this one in its chain; together with
    # token_ids it makes a lookup exact even when two chains' hashes collide.
    parent: tuple[int, int] | None = None
    # Bumped whenever the block stops holding its cached content, so a stale child
    # cannot match a reused parent.
    epoch: int = 0

    @property
    def identity(self) -> tuple[int, int]:
        return (self.block_id, self.epoch)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = chained_block_hash) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, front = next to hand out. Blocks with no cached content go to the
        # front; cached ones to the back, so eviction is least-recently-used.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        # Hashes of each request's full blocks, in order (grown as tokens arrive).
        self._block_hashes: dict[str, list[bytes]] = {}
        # How many leading blocks of each request are registered in the cache (or shared).
        self._num_registered: dict[str, int] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    # ---- prefix cache lookup -----------------------------------------------------------
    def _hashes_for(self, request: Sequence, num_full_blocks: int) -> list[bytes]:
        hashes = self._block_hashes.setdefault(request.request_id, [])
        tokens, size = request.all_token_ids, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(self.hash_fn(parent, tuple(tokens[i * size:(i + 1) * size])))
        return hashes

    def find_cached_blocks(self, request: Sequence) -> list[int]:
        """Blocks already holding this request's leading tokens (full blocks only).

        At least one token is always left to compute, so that the step that computes it
        yields the logits of the next token.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(request.all_token_ids) - 1) // self.block_size
        hashes = self._hashes_for(request, max_blocks)
        tokens, size = request.all_token_ids, self.block_size
        found: list[int] = []
        parent: tuple[int, int] | None = None
        for i, block_hash in enumerate(hashes):
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent != parent or block.token_ids != tuple(tokens[i * size:(i + 1) * size]):
                break  # hash collision: same hash, different content
            found.append(block_id)
            parent = block.identity
        return found

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(self, request: Sequence, num_new_tokens: int,
                       cached_blocks: list[int] | None = None, reserve: int = 0) -> bool:
        """Make room for num_new_tokens beyond the request's computed tokens.

        cached_blocks (from find_cached_blocks, at admission) become the head of the
        block table. Returns False, changing nothing, when the pool is too small or
        would keep fewer than `reserve` blocks free.
        """
        cached_blocks = cached_blocks or []
        table = self.block_tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens) - len(table) - len(cached_blocks)
        # Cached hits that sit in the free queue are taken by reference, not allocation.
        reclaimed = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if needed > 0 and needed > len(self.free_queue) - reclaimed - reserve:
            return False
        table = self.block_tables.setdefault(request.request_id, table)
        if self.enable_prefix_caching and request.num_computed_tokens == 0 and not table:
            self.prefix_queries += len(request.all_token_ids)
            self.prefix_hits += len(cached_blocks) * self.block_size
        for block_id in cached_blocks:
            self._take(block_id)
            table.append(block_id)
        if cached_blocks:
            self._num_registered[request.request_id] = len(table)
        for _ in range(max(needed, 0)):
            block_id = next(iter(self.free_queue))
            self._evict(block_id)
            self._take(block_id)
            table.append(block_id)
        return True

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        """Drop whatever cached content a free block holds before it is reused."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = None
            block.parent = None
            block.epoch += 1

    def cache_full_blocks(self, request: Sequence) -> None:
        """Register the request's blocks that are full and computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._hashes_for(request, num_full)
        size, tokens = self.block_size, request.all_token_ids
        for i in range(start, num_full):
            block = self.blocks[table[i]]
            parent_block = self.blocks[table[i - 1]] if i else None
            if parent_block is not None and parent_block.block_hash is None:
                break  # the chain is broken (a duplicate above): nothing below can match
            if block.block_hash is None and hashes[i] not in self.cached:
                block.block_hash = hashes[i]
                block.token_ids = tuple(tokens[i * size:(i + 1) * size])
                block.parent = parent_block.identity if parent_block is not None else None
                self.cached[hashes[i]] = block.block_id
            elif block.block_hash is None:
                break  # same content cached in another block; keep this one private
        self._num_registered[request.request_id] = num_full

    def free(self, request: Sequence) -> None:
        """Release the request's blocks (on finish, abort or preemption)."""
        table = self.block_tables.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        # Tail blocks first: a chain's later blocks are the least likely to be reused.
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)

    def forget(self, request: Sequence) -> None:
        """Drop per-request hash state once the request is finished for good."""
        self._block_hashes.pop(request.request_id, None)

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.free_queue):
            self._evict(block_id)

    # ---- integrity -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        refs = [0] * self.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                refs[block_id] += 1
        for block in self.blocks:
            in_free = block.block_id in self.free_queue
            assert block.ref_count == refs[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]} "
                "references from block tables")
            assert block.ref_count >= 0, f"block {block.block_id}: negative ref_count"
            assert in_free == (block.ref_count == 0), (
                f"block {block.block_id}: ref_count {block.ref_count} but in_free={in_free}")
            if block.block_hash is not None:
                assert block.token_ids is not None and len(block.token_ids) == self.block_size
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"stale cache entry {block_id}"
        assert len(self.free_queue) + sum(1 for b in self.blocks if b.ref_count) == self.num_blocks
