"""The sparse backends' self-check: below which context length sparse decode attention
costs more than dense on this machine (`--sparse-min-context`, default measured).

At start-up, before any request, a sparse backend fills the first blocks of its own
(still empty) cache with random keys and values, and times one layer's decode
attention for a single request at contexts of 256, 512, ... tokens up to what the
cache holds (at most MAX_PROBE tokens): the dense path (paged-native's kernel, or the
paged path where it does not apply) against the backend's sparse path, on one layer of
each group of sparse layers that cost alike (the backend's `probe_classes`: quest and
static-topk one group; retrieval-topp a group per number of retrieval heads, since a
layer of local heads selects almost for free and one of retrieval heads scores every
token). Each group gets its own crossover: the shortest measured length from which
sparse is faster at every longer one; rows with a shorter context run dense in that
group's layers. If sparse never wins, every row runs dense there (logged: the backend
then only costs its key bookkeeping) — `--sparse-min-context 0` forces sparse
everywhere.

Random keys spread a top-p budget over many blocks, so the sparse time measured is
if anything pessimistic. The table is cached per host (CPU, torch version, threads),
backend, geometry and the knobs that change the sparse path's work.
"""

from __future__ import annotations

import json
import logging

import torch

from tokenmill.attention.base import BatchLayout
from tokenmill.kv import KVCache
from tokenmill.layers.product_table import host_key
from tokenmill.layers.timing import CACHE, median_seconds

logger = logging.getLogger(__name__)

MAX_PROBE = 16384
NEVER = 1 << 62  # no measured length: sparse never runs
REPEATS = 5


def choose_crossover(table: dict[int, tuple[float, float]], margin: float = 0.95) -> int:
    """table {length: (dense seconds, sparse seconds)} -> the shortest length from
    which sparse takes at most `margin` x dense at every longer length (NEVER: none)."""
    crossover = NEVER
    for length in sorted(table, reverse=True):
        dense, sparse = table[length]
        if sparse > margin * dense:
            break
        crossover = length
    return crossover


def _decode_metadata(backend, length: int, block_size: int, device: torch.device):
    blocks = (length + block_size - 1) // block_size
    layout = BatchLayout(query_start=[0, 1], context_lens=[length - 1],
                         block_tables=[list(range(blocks))], num_decode_requests=1,
                         slot_mapping=torch.tensor([length - 1], device=device),
                         block_size=block_size)
    return backend.build_metadata(layout)


def measure_table(backend, kv_cache: KVCache, layer_index: int, dense, sparse
                  ) -> dict[int, tuple[float, float]]:
    """{length: (dense, sparse) seconds of one decode row's attention}; `dense` and
    `sparse` are callables (q, kv_cache, metadata, scale, layer_index) -> output."""
    spec = backend.spec
    capacity = kv_cache.data.shape[1] * spec.block_size
    longest = min(MAX_PROBE, capacity)
    generator = torch.Generator().manual_seed(0)
    device = kv_cache.data.device
    shape = (longest, spec.num_kv_heads, spec.head_dim)
    keys = torch.randn(shape, generator=generator).to(device, kv_cache.compute_dtype)
    values = torch.randn(shape, generator=generator).to(device, kv_cache.compute_dtype)
    slots = torch.arange(longest, device=device)
    backend.observe_keys(layer_index, keys, slots)
    kv_cache.write(keys, values, slots)
    q = torch.randn(1, spec.num_heads, spec.head_dim, generator=generator).to(
        device, kv_cache.compute_dtype)
    scale = spec.head_dim ** -0.5
    table = {}
    length = 256
    while length <= longest:
        metadata = _decode_metadata(backend, length, spec.block_size, device)
        table[length] = (
            median_seconds(lambda m=metadata: dense(q, kv_cache, m, scale, layer_index),
                           REPEATS),
            median_seconds(lambda m=metadata: sparse(q, kv_cache, m, scale, layer_index),
                           REPEATS))
        length *= 2
    return table


def cache_path(backend, kv_cache: KVCache, tag: str = ""):
    spec, sparse = backend.spec, backend.spec.sparse
    threads = torch.get_num_threads()
    name = "-".join(str(x) for x in (
        backend.name, getattr(backend, "crossover_tag", ""), spec.num_heads,
        spec.num_kv_heads, spec.head_dim, spec.block_size,
        kv_cache.data.dtype, kv_cache.data.device.type, sparse.budget, sparse.top_p,
        sparse.min_tokens, sparse.sink_tokens, sparse.window, sparse.retrieval_fraction, tag))
    return CACHE / "sparse" / f"{host_key(threads)}-{threads}t" / f"{name}.json"


def crossover_for(backend, kv_cache: KVCache, layer_index: int, dense, sparse,
                  tag: str = "", layers: list[int] | None = None) -> int:
    """The cached or freshly measured crossover of `backend` on this machine, timed on
    `layer_index` for the group of `layers` it stands for (`tag` names the group)."""
    path = cache_path(backend, kv_cache, tag)
    if path.is_file():
        table = {int(k): tuple(v) for k, v in json.loads(path.read_text()).items()}
    else:
        table = measure_table(backend, kv_cache, layer_index, dense, sparse)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({str(k): v for k, v in table.items()}))
    crossover = choose_crossover(table)
    described = ", ".join(f"{n}: {d * 1e6:.0f}/{s * 1e6:.0f} us" for n, (d, s) in table.items())
    where = f"layers {layers}" if layers is not None else f"layer {layer_index}"
    if crossover == NEVER:
        logger.warning("%s, %s: sparse decode attention was not faster than dense at any "
                       "measured context on this machine (dense/sparse per layer: %s); "
                       "decode runs dense there (--sparse-min-context 0 forces sparse)",
                       backend.name, where, described)
    else:
        logger.info("%s, %s: sparse decode from %d tokens of context (dense/sparse per "
                    "layer: %s)", backend.name, where, crossover, described)
    return crossover
