"""One measurement run of tokenmill as installed on PYTHONPATH, for bench_ab.py.

Uses only interfaces both sides of an A/B share (LLMEngine, the bench driver, the
held-out corpus), so the same probe measures an older commit and a newer one.

    core: the random Qwen2.5-0.5B shape (bench_core.py builds it), 2 threads:
          decode TPOT at batch 1 (prompt 128, 64 tokens), prefill tok/s (one 512-token
          prompt), output tok/s at batch 8 (8 x 64 tokens) and 32 (32 x 32 tokens)
    spec: pycoder, held-out prompts of 256 tokens, 64 new tokens each: output tok/s
          with no speculation and with each method (adaptive k) at batch 1 (8
          requests one at a time) and 8 (32 requests)

    PYTHONPATH=<tree> python benchmarks/ab_probe.py --suite core --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

from tokenmill.bench.driver import run_engine_workload, warm_up
from tokenmill.bench.workload import WorkloadRequest
from tokenmill.engine.engine import LLMEngine

ROOT = Path(__file__).resolve().parent.parent


def random_workload(count: int, prompt: int, new: int, seed: int) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    return [WorkloadRequest([rng.randrange(1000, 150000) for _ in range(prompt)], prompt, new)
            for _ in range(count)]


def tpot_ms(run) -> float:
    return statistics.median(1000 * (r.end_time - r.chunk_times[0]) / (r.output_tokens - 1)
                             for r in run.records)


def out_tok_s(run) -> float:
    return sum(r.output_tokens for r in run.records) / run.duration_s


def core(model: str) -> dict[str, float]:
    engine = LLMEngine.from_kwargs(model, progress=False, num_threads=2, max_num_seqs=32,
                                   max_model_len=2048)
    warm_up(engine)
    decode = run_engine_workload(engine, random_workload(1, 128, 64, 1), 1, progress=False)
    prefill = run_engine_workload(engine, random_workload(1, 512, 1, 2), 1, progress=False)
    batch8 = run_engine_workload(engine, random_workload(8, 128, 64, 3), 8, progress=False)
    batch32 = run_engine_workload(engine, random_workload(32, 128, 32, 4), 32, progress=False)
    return {"decode_tpot_ms_b1": tpot_ms(decode), "prefill_tok_s": 512 / prefill.duration_s,
            "out_tok_s_b8": out_tok_s(batch8), "out_tok_s_b32": out_tok_s(batch32)}


def spec_prompts(engine: LLMEngine, count: int, seed: int) -> list[WorkloadRequest]:
    from tokenmill.train.corpus import held_out_texts

    rng = random.Random(seed)
    files = [ids for ids in (engine.encode(t) for t in held_out_texts()) if len(ids) > 300]
    prompts = []
    for index in range(count):
        ids = files[index % len(files)]
        start = rng.randrange(len(ids) - 256)
        prompts.append(WorkloadRequest(ids[start:start + 256], 256, 64))
    return prompts


def spec(model: str) -> dict[str, float]:
    results = {}
    methods = {"none": {}, "ngram": {"speculative_method": "ngram"},
               "draft": {"speculative_method": "draft"},
               "eagle": {"speculative_method": "eagle"}}
    workload = None
    for name, options in methods.items():
        engine = LLMEngine.from_kwargs(model, progress=False, num_threads=2, max_num_seqs=8,
                                       **options)
        warm_up(engine)
        workload = workload or spec_prompts(engine, 32, 0)
        for batch, requests in ((1, 8), (8, 32)):
            run = run_engine_workload(engine, workload[:requests], batch, progress=False)
            results[f"{name}_out_tok_s_b{batch}"] = out_tok_s(run)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=["core", "spec"], required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.suite == "core":
        figures = core(args.model or str(Path.home() / ".cache/tokenmill/models/"
                                          "qwen2.5-0.5b-random"))
    else:
        figures = spec(args.model or str(ROOT / "models" / "pycoder"))
    args.json.write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
