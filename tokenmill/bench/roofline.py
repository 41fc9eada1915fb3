"""How close a run came to the machine's limits.

For a run we count the bytes that had to stream and the matmul FLOPs that had to
happen, and divide by the measured bandwidth and matmul rate (tokenmill.bench.ceilings):

- bytes: every step streams the weights once (the input embedding excepted: a lookup
  reads only its rows), and each decode token reads its context's KV;
- FLOPs: 2 x (body parameters) per processed token, plus 2 x (LM head) per sampled
  token (logits are computed only where a token is sampled). Attention score FLOPs
  are left out (small next to the projections at these context lengths).

The roofline time max(bytes / bandwidth, FLOPs / matmul rate) is a lower bound on the
run's wall time; `efficiency` = that bound / the measured time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tokenmill.bench.ceilings import Ceilings
from tokenmill.model.arch import ArchConfig


@dataclass(frozen=True)
class ModelCost:
    body_params: int  # attention + MLP projections of all layers
    lm_head_params: int
    dtype_bytes: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, arch: ArchConfig, dtype_bytes: int) -> ModelCost:
        q = arch.num_heads * arch.head_dim
        kv = arch.num_kv_heads * arch.head_dim
        hidden = arch.hidden_size
        per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * arch.intermediate_size
        return cls(body_params=arch.num_layers * per_layer,
                   lm_head_params=arch.vocab_size * hidden, dtype_bytes=dtype_bytes,
                   kv_bytes_per_token=2 * arch.num_layers * kv * dtype_bytes)

    @property
    def streamed_weight_bytes(self) -> int:
        return (self.body_params + self.lm_head_params) * self.dtype_bytes


@dataclass(frozen=True)
class Roofline:
    bytes_moved: float
    flops: float
    bandwidth_fraction: float  # achieved bytes/s / measured bandwidth
    compute_fraction: float  # achieved matmul FLOP/s / measured matmul rate
    roofline_s: float
    efficiency: float  # roofline_s / measured seconds (1 = at the limit)

    def to_json(self) -> dict:
        return asdict(self)


def run_roofline(cost: ModelCost, ceilings: Ceilings, prompt_lens: Sequence[int],
                 output_lens: Sequence[int], num_steps: int, elapsed_s: float) -> Roofline:
    """Roofline of a run whose request i had prompt_lens[i] and output_lens[i] tokens."""
    kv_reads = 0
    for prompt, output in zip(prompt_lens, output_lens, strict=True):
        # decode k (k = 1 .. output-1) attends over prompt + k tokens
        decodes = max(0, output - 1)
        kv_reads += decodes * prompt + decodes * (decodes + 1) // 2
    bytes_moved = num_steps * cost.streamed_weight_bytes + kv_reads * cost.kv_bytes_per_token
    processed = sum(prompt_lens) + sum(max(0, o - 1) for o in output_lens)
    flops = 2 * cost.body_params * processed + 2 * cost.lm_head_params * sum(output_lens)
    memory_s = bytes_moved / (ceilings.bandwidth_gbs * 1e9)
    compute_s = flops / (ceilings.matmul_gflops * 1e9)
    bound = max(memory_s, compute_s)
    return Roofline(bytes_moved, flops, memory_s / elapsed_s, compute_s / elapsed_s, bound,
                    bound / elapsed_s)


def format_roofline(roof: Roofline, ceilings: Ceilings) -> str:
    return (f"roofline ({ceilings.bandwidth_gbs:.1f} GB/s, {ceilings.matmul_gflops:.0f} GFLOP/s, "
            f"{ceilings.threads} threads): bandwidth {100 * roof.bandwidth_fraction:.1f}%, "
            f"matmul {100 * roof.compute_fraction:.1f}%, wall time at "
            f"{100 * roof.efficiency:.1f}% of the roofline bound ({roof.roofline_s:.3f} s)")
