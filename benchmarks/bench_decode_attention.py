"""Decode attention with grouped-query heads: SDPA with enable_gqa vs grouped query rows.

The batched decode path (`tokenmill.attention.paged`) runs one masked SDPA over the
gathered KV of all decoding requests, with Q queries per request (1, or 1 plus the
speculative tokens being verified). Two ways to give SDPA grouped-query attention
(H query heads sharing KVH key/value heads):
- enable_gqa: queries [D, H, Q, Dh] against keys [D, KVH, L, Dh] (SDPA broadcasts);
- grouped rows (what the engine runs, `grouped_decode_attention`): the G = H / KVH
  query heads of a KV head become its rows, queries [D, KVH, G * Q, Dh], one
  product per KV head.
Both take the keys as the cache's gather returns them ([D, L, KVH, Dh], viewed
transposed). Checks they agree, then times them A/B interleaved, best of 10 per
round, median over rounds, on a model's head shapes.

    python benchmarks/bench_decode_attention.py [--model models/pycoder] [--threads 2]
        [--context 400] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.attention.paged import group_mask, grouped_decode_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear_layout import best_time  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def with_enable_gqa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor, query_len: int) -> torch.Tensor:
    rows, _, heads, head_dim = q.shape[0] // query_len, *q.shape
    queries = q.view(rows, query_len, heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=mask, enable_gqa=True)
    return o.transpose(1, 2).reshape(rows * query_len, heads, head_dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "pycoder"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = json.loads((Path(args.model) / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    generator = torch.Generator().manual_seed(0)
    print(f"{Path(args.model).name}: {heads} query heads, {kv_heads} KV heads, head dim "
          f"{head_dim}; context {args.context}, {args.threads} threads, per layer\n")
    print("| requests | queries each | enable_gqa us | grouped rows us | speedup |")
    print("| --- | --- | --- | --- | --- |")
    for rows in args.batches:
        for query_len in args.queries:
            length = args.context + query_len
            q = torch.randn(rows * query_len, heads, head_dim, generator=generator)
            keys = torch.randn(rows, length, kv_heads, head_dim, generator=generator)
            values = torch.randn(rows, length, kv_heads, head_dim, generator=generator)
            # Each request's context differs; query r sees its context plus r + 1 tokens.
            contexts = torch.randint(args.context // 2, args.context, (rows,),
                                     generator=generator)
            limit = contexts[:, None] + torch.arange(query_len)[None]
            mask = (torch.arange(length)[None, None] <= limit[:, :, None])[:, None]
            gqa = partial(with_enable_gqa, q, keys, values, mask, query_len)
            # The engine groups the mask once per step (all layers share it).
            grouped = partial(grouped_decode_attention, q, keys, values,
                              group_mask(mask, heads // kv_heads), query_len)
            torch.testing.assert_close(grouped(), gqa(), rtol=1e-5, atol=1e-5)
            times = {"gqa": [], "grouped": []}
            for _ in range(args.rounds):
                times["gqa"].append(best_time(gqa))
                times["grouped"].append(best_time(grouped))
            slow, fast = (statistics.median(times[k]) for k in ("gqa", "grouped"))
            print(f"| {rows} | {query_len} | {slow * 1e6:.0f} | {fast * 1e6:.0f} | "
                  f"{slow / fast:.2f}x |")


if __name__ == "__main__":
    main()
