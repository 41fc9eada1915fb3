"""KV memory fragmentation: tokenmill's block pool vs per-request contiguous tensors.

A discrete-event replay (no model forward): requests arrive over time with random
prompt and output lengths up to the context, are admitted FIFO up to --max-seqs, get
their prompt's K/V at admission and one token per step after, and free their memory
when done. The same workload and the same scheduling policy run through two stores
under one fixed byte budget:

  paged     tokenmill's KVCacheManager: a preallocated pool of fixed-size blocks;
            a request takes a block when its last one is full.
  baseline  what naive servers do: one contiguous K/V tensor per request per layer,
            grown by allocating a bigger tensor (doubling) and copying, through a
            *simulated* PyTorch CUDA caching allocator (sizes rounded to 512 B;
            requests <= 1 MiB come from 2 MiB segments, < 10 MiB from 20 MiB segments,
            larger ones from their size rounded up to 2 MiB; best-fit over cached free
            blocks; a block is split when the rest is large enough and merged with
            free neighbours inside its segment, never across segments; on a failed
            segment allocation the wholly free cached segments are released and the
            allocation retried, then it is an OOM). The simulation, not the real
            allocator, is used because PyTorch's CPU allocator does not cache.

When a running request cannot grow (no block / OOM), the most recently admitted
request is preempted (memory freed, recomputed later), as tokenmill's scheduler does.

    python benchmarks/bench_fragmentation.py [--requests 200] [--context 2048]
        [--max-seqs 32] [--budget-gib 0.75] [--png docs/fragmentation.png]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

from tokenmill.core.kv_manager import KVCacheManager

MIB, GIB = 1024**2, 1024**3


# ---- simulated caching allocator ---------------------------------------------------------

@dataclass(eq=False)
class Chunk:
    """A piece of a segment: allocated to a tensor or free (cached)."""

    segment: Segment
    offset: int
    size: int
    allocated: bool = False
    prev: Chunk | None = None
    next: Chunk | None = None


@dataclass(eq=False)
class Segment:
    index: int  # creation order: makes best-fit ties deterministic
    size: int
    small: bool
    head: Chunk | None = None


class CachingAllocator:
    """The block-splitting, segment-caching policy of PyTorch's CUDA allocator."""

    ROUND, SMALL_SIZE, SMALL_SEGMENT = 512, 1 * MIB, 2 * MIB
    MID_SIZE, MID_SEGMENT, LARGE_ROUND = 10 * MIB, 20 * MIB, 2 * MIB

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.segments: list[Segment] = []
        self.free_chunks: dict[bool, set[Chunk]] = {True: set(), False: set()}
        self.reserved = 0
        self.allocated = 0
        self.num_created = 0

    def _segment_size(self, size: int) -> int:
        if size <= self.SMALL_SIZE:
            return self.SMALL_SEGMENT
        if size < self.MID_SIZE:
            return self.MID_SEGMENT
        return -(-size // self.LARGE_ROUND) * self.LARGE_ROUND

    def _release_cached(self) -> None:
        for segment in list(self.segments):
            chunk = segment.head
            if chunk is not None and not chunk.allocated and chunk.next is None:
                self.free_chunks[segment.small].discard(chunk)
                self.segments.remove(segment)
                self.reserved -= segment.size

    def _new_segment(self, size: int, small: bool) -> Chunk | None:
        seg_size = self._segment_size(size)
        if self.reserved + seg_size > self.budget:
            self._release_cached()
            if self.reserved + seg_size > self.budget:
                return None
        self.num_created += 1
        segment = Segment(self.num_created, seg_size, small)
        segment.head = Chunk(segment, 0, seg_size)
        self.segments.append(segment)
        self.reserved += seg_size
        return segment.head

    def malloc(self, nbytes: int) -> Chunk | None:
        size = max(-(-nbytes // self.ROUND) * self.ROUND, self.ROUND)
        small = size <= self.SMALL_SIZE
        pool = self.free_chunks[small]
        fits = [c for c in pool if c.size >= size]
        if fits:
            chunk = min(fits, key=lambda c: (c.size, c.segment.index, c.offset))
            pool.discard(chunk)
        else:
            chunk = self._new_segment(size, small)
            if chunk is None:
                return None
        rest = chunk.size - size
        if rest >= self.ROUND if small else rest > self.SMALL_SIZE:
            tail = Chunk(chunk.segment, chunk.offset + size, rest, prev=chunk, next=chunk.next)
            if chunk.next is not None:
                chunk.next.prev = tail
            chunk.next, chunk.size = tail, size
            pool.add(tail)
        chunk.allocated = True
        self.allocated += chunk.size
        return chunk

    def free(self, chunk: Chunk) -> None:
        chunk.allocated = False
        self.allocated -= chunk.size
        pool = self.free_chunks[chunk.segment.small]
        for neighbour in (chunk.next, chunk.prev):
            if neighbour is None or neighbour.allocated:
                continue
            pool.discard(neighbour)
            first, second = (chunk, neighbour) if neighbour is chunk.next else (neighbour, chunk)
            first.size += second.size
            first.next = second.next
            if second.next is not None:
                second.next.prev = first
            chunk = first
        pool.add(chunk)


# ---- workload ------------------------------------------------------------------------------

@dataclass
class SimRequest:
    request_id: str
    arrival: int
    prompt_len: int
    output_len: int
    generated: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V is held (KVCacheManager reads this)
    admitted_at: int | None = None
    preemptions: int = 0

    @property
    def target(self) -> int:
        return self.prompt_len + self.output_len


def make_workload(num_requests: int, context: int, max_seqs: int, seed: int
                  ) -> list[SimRequest]:
    rng = random.Random(seed)
    requests, t = [], 0.0
    mean_output = context / 4
    for i in range(num_requests):
        prompt = rng.randint(16, context * 3 // 4)
        output = rng.randint(16, context - prompt)
        requests.append(SimRequest(f"r{i}", int(t), prompt, output))
        # Arrivals slightly faster than max_seqs requests can drain: the budget binds.
        t += rng.expovariate(1.25 * max_seqs / mean_output)
    return requests


# ---- the two KV stores ------------------------------------------------------------------------

class PagedStore:
    name = "paged (tokenmill)"

    def __init__(self, budget: int, bytes_per_token: int, block_size: int) -> None:
        self.bytes_per_block = bytes_per_token * block_size
        self.block_size = block_size
        self.manager = KVCacheManager(budget // self.bytes_per_block, block_size,
                                      enable_prefix_caching=False)
        self.reserved_bytes = self.manager.num_blocks * self.bytes_per_block  # whole pool
        # Bytes not held by any request when an allocation failed.
        self.free_at_failure: list[int] = []

    def can_ever_hold(self, num_tokens: int) -> bool:
        return self.manager.blocks_needed(num_tokens) <= self.manager.num_blocks

    def grow(self, request: SimRequest, num_new: int) -> bool:
        if self.manager.allocate_slots(request, num_new):
            return True
        self.free_at_failure.append(self.manager.num_free_blocks * self.bytes_per_block)
        return False

    def free(self, request: SimRequest) -> None:
        self.manager.free(request)

    def held_bytes(self) -> int:
        return (self.manager.num_blocks - self.manager.num_free_blocks) * self.bytes_per_block

    def check(self) -> None:
        self.manager.check_integrity()


class ContiguousStore:
    name = "contiguous + caching allocator"

    def __init__(self, budget: int, bytes_per_token: int, num_layers: int) -> None:
        self.allocator = CachingAllocator(budget)
        self.bytes_per_layer_token = bytes_per_token // num_layers
        self.num_layers = num_layers
        self.budget = budget
        # request id -> per layer (capacity in tokens, its tensor's chunk)
        self.tensors: dict[str, list[tuple[int, Chunk]]] = {}
        self.free_at_failure: list[int] = []

    def can_ever_hold(self, num_tokens: int) -> bool:
        return num_tokens * self.bytes_per_layer_token * self.num_layers <= self.budget

    def grow(self, request: SimRequest, num_new: int) -> bool:
        need = request.num_computed_tokens + num_new
        layers = self.tensors.setdefault(request.request_id, [])
        for layer in range(self.num_layers):
            capacity, old = layers[layer] if layer < len(layers) else (0, None)
            if need <= capacity:
                continue
            # Layer by layer, as each layer's forward grows its own tensor; the old
            # tensor lives until its contents are copied into the new one.
            new_capacity = max(need, 2 * capacity, 16)
            chunk = self.allocator.malloc(new_capacity * self.bytes_per_layer_token)
            if chunk is None:
                self.free_at_failure.append(self.budget - self.allocator.allocated)
                return False
            if old is None:
                layers.append((new_capacity, chunk))
            else:
                self.allocator.free(old)
                layers[layer] = (new_capacity, chunk)
        return True

    def free(self, request: SimRequest) -> None:
        for _capacity, chunk in self.tensors.pop(request.request_id, []):
            self.allocator.free(chunk)

    def held_bytes(self) -> int:
        return self.allocator.allocated

    @property
    def reserved_bytes(self) -> int:
        return self.allocator.reserved

    def check(self) -> None:
        assert self.allocator.reserved <= self.budget


# ---- replay ------------------------------------------------------------------------------------

@dataclass
class Trace:
    reserved: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    waited: int = 0
    refused: int = 0
    preemptions: int = 0
    steps: int = 0


def replay(store, workload: list[SimRequest], max_seqs: int, bytes_per_token: int) -> Trace:
    requests = [SimRequest(r.request_id, r.arrival, r.prompt_len, r.output_len)
                for r in workload]
    pending = list(requests)
    waiting: list[SimRequest] = []
    running: list[SimRequest] = []
    trace = Trace()
    step = 0
    while pending or waiting or running:
        while pending and pending[0].arrival <= step:
            request = pending.pop(0)
            if store.can_ever_hold(request.target):
                waiting.append(request)
            else:
                trace.refused += 1
        # Decode: every running request produces one token, in admission order.
        for request in list(running):
            if request not in running:
                continue  # preempted below for an earlier request
            while not store.grow(request, 1):
                victim = running.pop()
                store.free(victim)
                victim.num_computed_tokens = 0
                victim.preemptions += 1
                trace.preemptions += 1
                waiting.insert(0, victim)
                if victim is request:
                    break
            else:
                request.num_computed_tokens += 1
                request.generated += 1
                if request.generated >= request.output_len:
                    running.remove(request)
                    store.free(request)
        # Admission, FIFO: the prompt (plus tokens generated before a preemption).
        while waiting and len(running) < max_seqs:
            request = waiting[0]
            tokens = request.prompt_len + request.generated
            if not store.grow(request, tokens):
                break
            waiting.pop(0)
            request.num_computed_tokens = tokens
            if request.admitted_at is None:
                request.admitted_at = step
                trace.waited += step > request.arrival
            running.append(request)
        store.check()
        trace.reserved.append(store.reserved_bytes)
        trace.held.append(store.held_bytes())
        trace.live.append(sum(r.num_computed_tokens for r in running) * bytes_per_token)
        trace.running.append(len(running))
        trace.waiting.append(len(waiting))
        step += 1
    trace.steps = step
    return trace


def summarize(store, trace: Trace) -> dict:
    def mean(values: list[int]) -> float:
        return sum(values) / max(len(values), 1)

    live, held, reserved = mean(trace.live), mean(trace.held), mean(trace.reserved)
    # While requests wait, memory not holding live tokens is what fragmentation costs.
    busy = [i for i, w in enumerate(trace.waiting) if w]
    busy_share = mean([trace.live[i] for i in busy]) / mean([trace.reserved[i] for i in busy])
    return {
        "busy_share": busy_share, "busy_steps": len(busy),
        "store": store.name, "reserved": reserved, "held": held, "live": live,
        "live_share": live / reserved, "internal": 1 - live / held,
        "not_held": 1 - held / reserved, "failures": len(store.free_at_failure),
        "free_at_failure": mean(store.free_at_failure), "peak": max(trace.reserved),
        "running": mean(trace.running), "waited": trace.waited, "refused": trace.refused,
        "preemptions": trace.preemptions, "steps": trace.steps,
    }


def plot(traces: dict[str, Trace], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(9, 6), sharex=True)
    for ax, (name, trace) in zip(axes, traces.items(), strict=True):
        steps = range(len(trace.live))
        ax.plot(steps, [b / GIB for b in trace.reserved], label="reserved")
        ax.plot(steps, [b / GIB for b in trace.held], label="held by requests")
        ax.plot(steps, [b / GIB for b in trace.live], label="live tokens")
        ax.set_title(name)
        ax.set_ylabel("GiB")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("step (one decode token per running request)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--max-seqs", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget-gib", type=float, default=0.75)
    # Per-token K/V bytes of one layer and the layer count (default: Qwen2.5-0.5B, fp32).
    parser.add_argument("--layer-token-bytes", type=int, default=2 * 2 * 64 * 4)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", default=None)
    args = parser.parse_args()

    budget = int(args.budget_gib * GIB)
    bytes_per_token = args.layer_token_bytes * args.layers
    workload = make_workload(args.requests, args.context, args.max_seqs, args.seed)
    stores = [PagedStore(budget, bytes_per_token, args.block_size),
              ContiguousStore(budget, bytes_per_token, args.layers)]
    traces, rows = {}, []
    for store in stores:
        trace = replay(store, workload, args.max_seqs, bytes_per_token)
        traces[store.name] = trace
        rows.append(summarize(store, trace))
    print(f"{args.requests} requests, context {args.context}, max {args.max_seqs} running, "
          f"budget {args.budget_gib} GiB, {bytes_per_token} B/token, block {args.block_size}")
    columns = ["store", "reserved GiB", "held GiB", "live GiB", "live/reserved %",
               "live/reserved % while requests wait",
               "internal waste % (held-live)/held", "reserved not held %",
               "failed allocations", "free MiB at a failure", "peak reserved GiB",
               "mean running", "waited", "refused", "preemptions", "steps"]
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for r in rows:
        print(f"| {r['store']} | {r['reserved'] / GIB:.3f} | {r['held'] / GIB:.3f} | "
              f"{r['live'] / GIB:.3f} | {100 * r['live_share']:.1f} | "
              f"{100 * r['busy_share']:.1f} ({r['busy_steps']} steps) | {100 * r['internal']:.1f} | "
              f"{100 * r['not_held']:.1f} | {r['failures']} | {r['free_at_failure'] / MIB:.1f} | "
              f"{r['peak'] / GIB:.3f} | {r['running']:.1f} | {r['waited']} | {r['refused']} | "
              f"{r['preemptions']} | {r['steps']} |")
    paged, base = rows
    print(f"contiguous / paged: steps {base['steps'] / paged['steps']:.2f}x, "
          f"mean running {base['running'] / paged['running']:.2f}x, "
          f"mean live tokens {base['live'] / paged['live']:.2f}x")
    if args.png:
        plot(traces, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
