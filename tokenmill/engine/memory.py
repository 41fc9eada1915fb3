"""How many KV blocks a memory budget buys: the one implementation of that arithmetic."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.model.arch import ArchConfig


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrent_sequences(self) -> int:
        """Full-context sequences the pool holds at once."""
        return self.num_blocks // -(-self.max_model_len // self.block_size)


def kv_bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * element


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def plan_kv_blocks(config: EngineConfig, arch: ArchConfig, dtype: torch.dtype,
                   device: torch.device) -> KVPlan:
    cache = config.cache
    max_model_len = config.model.max_model_len or arch.max_position_embeddings
    per_block = kv_bytes_per_block(arch, cache.block_size, dtype)
    blocks_per_seq = -(-max_model_len // cache.block_size)
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    else:
        budget = cache.kv_cache_memory
        if budget is None:
            budget = int(available_memory(device) * cache.kv_cache_memory_fraction)
            if device.type == "cpu":
                # Host memory is shared with everything else: take no more than
                # max_num_seqs full-length sequences need.
                budget = min(budget, per_block * blocks_per_seq * config.scheduler.max_num_seqs)
        num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory: the budget holds no KV block of {per_block} bytes")
    return KVPlan(num_blocks, cache.block_size, per_block, max_model_len)
