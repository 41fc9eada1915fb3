"""How many KV blocks a memory budget buys, and whether a deployment fits: the one
implementation of that arithmetic (the engine's start-up and `tokenmill plan memory`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.dist.expert_replicas import ExpertReplicas
from tokenmill.dist.pipeline import PipelineStage
from tokenmill.kv.quant import SCALE_DTYPE, is_quantized, storage_dtype
from tokenmill.layers.linear import Linear
from tokenmill.layers.products import ProductPolicy, product_policy
from tokenmill.layers.timing import host_available_memory
from tokenmill.model.arch import ArchConfig
from tokenmill.model.loader import (
    linear_weight_formats,
    read_config,
    resolve_device,
    resolve_dtype,
    saved_quantized_layers,
)
from tokenmill.model.prequantized import saved_quantization
from tokenmill.model.registry import resolve_model_class
from tokenmill.quant.gguf_blocks import block_products
from tokenmill.quant.policy import quantized_products
from tokenmill.quant.saved import saved_products
from tokenmill.speculative.factory import ProposerFootprint, proposer_context, proposer_footprint


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int
    # One block's bytes over every pool that holds it: the target's, and a speculative
    # proposer's own (a draft model's or EAGLE head's pool has as many blocks).
    bytes_per_block: int
    max_model_len: int
    kv_cache_dtype: str = "auto"
    # Of bytes_per_block, the proposer's share.
    proposer_bytes_per_block: int = 0

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrent_sequences(self) -> int:
        """Full-context sequences the pool holds at once."""
        return self.num_blocks // blocks_for(self.max_model_len, self.block_size)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def kv_bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype,
                       kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block over all layers, K and V, scales included when quantized."""
    storage = storage_dtype(kv_cache_dtype, dtype)
    per_head = arch.head_dim * storage.itemsize
    if is_quantized(storage):
        per_head += SCALE_DTYPE.itemsize  # one scale per token per KV head
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * per_head


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return host_available_memory()


def target_products(config: EngineConfig, base: ProductPolicy, dtype: torch.dtype,
                    stage: PipelineStage | None = None) -> ProductPolicy:
    """The policy the target model loads with: weight quantization, a pre-quantized
    checkpoint's saved codes or a GGUF file's kept block formats on top of the base
    policy (which proposers keep). A pipeline stage's layers are named by their number
    within it."""
    model = config.model.model
    saved = saved_quantization(model)
    if saved is not None:
        if config.parallel.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size: a pre-quantized checkpoint loads on one "
                             "rank (its codes are not split); quantize the float checkpoint "
                             "at load under tensor parallelism")
        layers = _stage_names(model, {layer: set() for layer in saved_quantized_layers(model)},
                              stage)
        return saved_products(saved, set(layers), base, dtype, config.quant)
    target = quantized_products(config.quant, base, dtype)
    return block_products(target, _stage_names(model, linear_weight_formats(model), stage),
                          dtype)


def _stage_names(model: str, layers: dict[str, set[str]], stage: PipelineStage | None
                 ) -> dict[str, set[str]]:
    """Layer name -> value, with the names a pipeline stage gives the layers it holds."""
    if stage is None:
        return layers
    tied = read_config(model).tie_word_embeddings

    def local(layer: str) -> str | None:
        if tied and layer == "lm_head":
            # The tied head is the embedding table: the first stage holds it too.
            return layer if stage.local_name("model.embed_tokens.weight", tied) else None
        name = stage.local_name(f"{layer}.weight", tied)
        return name.removesuffix(".weight") if name is not None else None

    return {name: value for layer, value in layers.items()
            if (name := local(layer)) is not None}


def plan_kv_blocks(config: EngineConfig, arch: ArchConfig, dtype: torch.dtype,
                   device: torch.device, proposer: ProposerFootprint | None = None) -> KVPlan:
    """Blocks for the budget; with a proposer that has a model, its pool's blocks (its
    geometry, stored in the model dtype) come out of the same budget."""
    cache = config.cache
    max_model_len = config.model.max_model_len or arch.max_position_embeddings
    proposer_per_block = (kv_bytes_per_block(proposer.arch, cache.block_size, dtype)
                          if proposer is not None else 0)
    per_block = (kv_bytes_per_block(arch, cache.block_size, dtype, cache.kv_cache_dtype)
                 + proposer_per_block)
    blocks_per_seq = blocks_for(max_model_len, cache.block_size)
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
    return KVPlan(num_blocks, cache.block_size, per_block, max_model_len, cache.kv_cache_dtype,
                  proposer_per_block)


# ---- whole-deployment plan (`tokenmill plan memory`) ----------------------------------------

def activation_bytes(arch: ArchConfig, dtype: torch.dtype, context: int, concurrency: int,
                     max_batched_tokens: int, block_size: int) -> int:
    """Peak transient memory of one step (an estimate: one layer's tensors live at once).

    Terms: one layer's projections and MLP over the step's tokens; the score matrix of
    a prefill chunk against its whole context (float32); the decode rows' K/V gathered
    (and dequantised) in the compute dtype for one layer; the sampled rows' logits.
    """
    tokens = min(max_batched_tokens, context * concurrency)
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    layer = tokens * (3 * arch.hidden_size + 2 * q_size + 2 * kv_size + 3 * arch.intermediate_size)
    scores = arch.num_heads * min(tokens, context) * context * 4
    gathered = concurrency * blocks_for(context, block_size) * block_size * 2 * kv_size
    logits = concurrency * arch.vocab_size * 4
    return (layer + gathered) * dtype.itemsize + scores + logits


@dataclass(frozen=True)
class MemoryPlan:
    num_parameters: int
    weights_bytes: int
    kv: KVPlan  # the blocks `concurrency` sequences of `context` tokens need
    activation_bytes: int
    device_memory: int
    context: int
    concurrency: int
    dtype: torch.dtype
    # The product policy's name: how the weights are kept (e.g. "onednn, int4-rtn-g128").
    products: str = ""

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv.total_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device_memory

    @property
    def max_concurrency(self) -> int:
        """Sequences of `context` tokens the memory left after weights and activations holds."""
        left = self.device_memory - self.weights_bytes - self.activation_bytes
        per_seq = blocks_for(self.context, self.kv.block_size) * self.kv.bytes_per_block
        return max(left, 0) // per_seq

    def format(self) -> str:
        def row(name: str, size: int, note: str = "") -> str:
            return f"{name:<12} {size / 2**20:>12.1f} MiB  {note}".rstrip()
        kv = self.kv
        lines = [
            f"context {self.context} tokens x {self.concurrency} sequences, "
            f"weights {str(self.dtype).removeprefix('torch.')}, KV {kv.kv_cache_dtype}"
            + (f", products {self.products}" if self.products else ""),
            row("weights", self.weights_bytes, f"{self.num_parameters / 1e6:.1f}M parameters"
                + (", a speculative proposer's included" if kv.proposer_bytes_per_block else "")),
            row("kv cache", kv.total_bytes, f"{kv.num_blocks} blocks x {kv.block_size} tokens, "
                f"{kv.bytes_per_block} B/block"),
            row("activations", self.activation_bytes, "estimate, one step"),
            row("total", self.total_bytes),
            row("device", self.device_memory),
            f"fits: {'yes' if self.fits else 'NO'}; at this context the memory holds "
            f"{self.max_concurrency} concurrent sequences",
        ]
        return "\n".join(lines)


def model_weight_bytes(arch: ArchConfig, num_parameters: int, dtype: torch.dtype,
                       repacks_weights: bool) -> int:
    """Bytes of a model's weights: a product policy that repacks weights keeps a tied
    LM head twice (the packed copy, and the plain one the embedding reads)."""
    tied_copy = arch.vocab_size * arch.hidden_size if (
        repacks_weights and arch.tie_word_embeddings) else 0
    return (num_parameters + tied_copy) * dtype.itemsize


def planned_weight_bytes(arch: ArchConfig, dtype: torch.dtype, policy: ProductPolicy) -> int:
    """Bytes of a model's weights in the forms the policy's methods keep (quantized
    codes included), read off the model built on the meta device: nothing allocated."""
    with torch.device("meta"):
        model = resolve_model_class(arch.architecture)(arch, 1)
    linear_bytes = linear_params = 0
    for name, layer in model.named_modules():
        if isinstance(layer, Linear):
            linear_bytes += policy.planned_weight_bytes(name, layer, dtype)
            linear_params += layer.out_features * layer.in_features
    return (arch.num_parameters - linear_params) * dtype.itemsize + linear_bytes


def plan_memory(config: EngineConfig, arch: ArchConfig, dtype: torch.dtype, context: int,
                concurrency: int, device_memory: int, proposer: ProposerFootprint | None = None,
                repacks_weights: bool = False, policy: ProductPolicy | None = None
                ) -> MemoryPlan:
    """Weights + KV for `concurrency` sequences of `context` tokens + activations; a
    speculative proposer's model and KV pool included. With a product policy, the
    target's weights are counted in the forms its methods keep (quantized or packed)."""
    if context < 1 or concurrency < 1:
        raise ValueError(f"context and concurrency must be >= 1, got {context}, {concurrency}")
    cache = config.cache
    proposer_per_block = (kv_bytes_per_block(proposer.arch, cache.block_size, dtype)
                          if proposer is not None else 0)
    per_block = kv_bytes_per_block(arch, cache.block_size, dtype, cache.kv_cache_dtype)
    num_blocks = blocks_for(context, cache.block_size) * concurrency
    kv = KVPlan(num_blocks, cache.block_size, per_block + proposer_per_block, context,
                cache.kv_cache_dtype, proposer_per_block)
    params = arch.num_parameters
    if policy is not None:
        repacks_weights = policy.repacks_weights
        weights = planned_weight_bytes(arch, dtype, policy)
    else:
        weights = model_weight_bytes(arch, params, dtype, repacks_weights)
    if proposer is not None:
        params += proposer.num_parameters
        weights += model_weight_bytes(proposer.arch, proposer.num_parameters, dtype,
                                      repacks_weights and proposer.has_lm_head)
    acts = activation_bytes(arch, dtype, context, concurrency,
                            config.scheduler.max_num_batched_tokens, cache.block_size)
    return MemoryPlan(params, weights, kv, acts, device_memory, context, concurrency, dtype,
                      policy.name if policy is not None else "")


def plan_deployment_memory(config: EngineConfig, context: int, concurrency: int,
                           device_memory: int | None = None) -> MemoryPlan:
    """plan_memory for a config as the worker would start it: the checkpoint's shape,
    the device's dtype and products, the configured proposer (none of it loaded). Under
    tensor parallelism, one rank's share: its shard, or under expert parallelism its
    whole experts, replicas included (MoE memory follows the experts held, not those
    a token uses)."""
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    arch = read_config(config.model.model)
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1:
        size, slots = parallel.tensor_parallel_size, None
        if parallel.expert_redundant_slots:  # every rank holds (E + R) / TP slots
            slots = ExpertReplicas(arch.num_experts, size, 0, parallel.expert_redundant_slots,
                                   parallel.expert_routing).local_slots
        arch = arch.sharded(size, 0 if parallel.expert_parallel else None, slots)
    policy = target_products(config, product_policy(config.model.cpu_blas, device, dtype),
                             dtype)
    proposer = proposer_footprint(proposer_context(config, arch, device, dtype))
    return plan_memory(config, arch, dtype, context, concurrency,
                       device_memory or available_memory(device), proposer, policy=policy)
