"""Engine core vs transformers on a random Qwen2.5-0.5B-shaped model (issue 2's figures).

Measured in one run, same weights, same thread count:
  1. single-stream decode (prompt 128, 128 new tokens), interleaved A/B repetitions;
  2. prefill of a 512-token prompt;
  3. offline throughput: 64 requests, prompts U[32, 512], outputs U[8, 256] (seeded),
     tokenmill continuous batching vs transformers static batches of 8 and 16.
Each figure is printed with its roofline fraction (bandwidth for decode, matmul rate
for prefill) from tokenmill.bench.ceilings. Prefill is set against two peaks: torch's
own fp32 GEMM rate (MKL, what transformers multiplies at: the issue's reference) and
the best any library reaches on the machine (oneDNN on a packed weight here).

    python benchmarks/bench_core.py [--threads 2] [--requests 64] [--skip-throughput]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tokenmill import LLM, SamplingParams
from tokenmill.bench.ceilings import CACHE, machine_ceilings

MODEL_DIR = CACHE / "models" / "qwen2.5-0.5b-random"


def build_model(path: Path) -> Path:
    """Random weights in the Qwen2.5-0.5B shape, with a small byte-level tokenizer."""
    if (path / "config.json").is_file():
        return path
    from transformers import AutoModelForCausalLM, Qwen2Config

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.models import build_tokenizer

    print(f"building {path} (random Qwen2.5-0.5B shape, fp32) ...", flush=True)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    return path


def add_decode_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    """The options of a decode-step benchmark on this model (bench_decode_split.py,
    bench_whole_decode.py): what `decode_setup` reads."""
    parser.add_argument("--model", default=None)
    parser.add_argument("--cpu-blas", default="native")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=rounds)


def decode_setup(args: argparse.Namespace, **options) -> tuple[LLM, list[list[int]],
                                                               SamplingParams]:
    """The engine (--model, or the random 0.5B shape, built once), --batch seeded random
    prompts of --prompt tokens and greedy params for --new-tokens, EOS ignored."""
    model = args.model or str(build_model(MODEL_DIR))
    llm = LLM(model, progress=False, num_threads=args.threads, kv_cache_memory=2**28,
              cpu_blas=args.cpu_blas, **options)
    rng = random.Random(0)
    # Ids from the vocabulary's middle (a small model's: its upper half).
    vocab = llm.engine.executor.worker.runner.arch.vocab_size
    low, high = min(1000, vocab // 2), min(100000, vocab)
    prompts = [[rng.randrange(low, high) for _ in range(args.prompt)]
               for _ in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    return llm, prompts, params


def random_prompt(rng: random.Random, length: int) -> list[int]:
    # Ids from the middle of the vocabulary: never the EOS id, never special.
    return [rng.randrange(1000, 150000) for _ in range(length)]


def hf_generate_time(hf, prompts: list[list[int]], new_tokens: int) -> float:
    """Static batch: left-padded prompts, every row runs to new_tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, pad_token_id=0)
    return time.perf_counter() - start


def tm_generate(llm: LLM, prompts: list[list[int]], outputs: list[int]):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    return time.perf_counter() - start, results


def bench_decode(llm, hf, rng, repeats: int) -> dict:
    """ms per output token after the first, prompt 128, 128 new tokens."""
    tm_times, hf_times = [], []
    for _ in tqdm(range(repeats), desc="decode A/B"):
        prompt = random_prompt(rng, 128)
        _, out = tm_generate(llm, [prompt], [128])
        tm_times.append(out[0].outputs[0].metrics.time_per_output_token)
        full = hf_generate_time(hf, [prompt], 128)
        first = hf_generate_time(hf, [prompt], 1)
        hf_times.append((full - first) / 127)
    return {"tokenmill_ms": 1000 * statistics.median(tm_times),
            "transformers_ms": 1000 * statistics.median(hf_times)}


def bench_prefill(llm, hf, rng, repeats: int) -> dict:
    tm_times, hf_times = [], []
    for _ in tqdm(range(repeats), desc="prefill A/B"):
        prompt = random_prompt(rng, 512)
        _, out = tm_generate(llm, [prompt], [1])
        tm_times.append(out[0].outputs[0].metrics.time_to_first_token)
        hf_times.append(hf_generate_time(hf, [random_prompt(rng, 512)], 1))
    return {"tokenmill_s": statistics.median(tm_times),
            "transformers_s": statistics.median(hf_times)}


def bench_throughput(llm, hf, rng, num_requests: int) -> dict:
    prompts = [random_prompt(rng, rng.randint(32, 512)) for _ in range(num_requests)]
    outputs = [rng.randint(8, 256) for _ in range(num_requests)]
    total_out = sum(outputs)
    result = {"requests": num_requests, "output_tokens": total_out,
              "prompt_tokens": sum(map(len, prompts))}
    elapsed, _ = tm_generate(llm, prompts, outputs)
    result["tokenmill_s"] = elapsed
    for batch in (8, 16):
        elapsed = 0.0
        for start in tqdm(range(0, num_requests, batch), desc=f"transformers batch {batch}"):
            group = slice(start, start + batch)
            elapsed += hf_generate_time(hf, prompts[group], max(outputs[group]))
        result[f"transformers_b{batch}_s"] = elapsed
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model_dir = build_model(args.model)
    # Measured in this run: this VM's memory bandwidth drifts by tens of percent over
    # an hour, so a cached figure would mis-state the fractions.
    ceilings = machine_ceilings(args.threads, refresh=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = sum(p.numel() for p in hf.parameters())
    weight_bytes = params * 4
    llm = LLM(str(model_dir), max_num_seqs=64, max_num_batched_tokens=2048,
              kv_cache_memory=3 * 2**30, enable_prefix_caching=False, num_threads=args.threads)
    rng = random.Random(0)
    tm_generate(llm, [random_prompt(rng, 64)], [4])  # warm-up
    hf_generate_time(hf, [random_prompt(rng, 64)], 4)

    results: dict = {"ceilings": vars(ceilings), "params": params}
    decode = bench_decode(llm, hf, rng, args.repeats)
    roofline_ms = 1000 * ceilings.decode_roofline_s(weight_bytes)
    decode["roofline_ms"] = roofline_ms
    results["decode"] = decode
    prefill = bench_prefill(llm, hf, rng, args.repeats)
    # Per prompt token every weight but the embedding table is multiplied once (the LM
    # head only at the last position, tied or not).
    flops = 2 * (params - hf.get_input_embeddings().weight.numel()) * 512
    prefill["tokenmill_gflops"] = flops / prefill["tokenmill_s"] / 1e9
    prefill["transformers_gflops"] = flops / prefill["transformers_s"] / 1e9
    results["prefill"] = prefill
    if not args.skip_throughput:
        results["throughput"] = bench_throughput(llm, hf, rng, args.requests)

    print(f"\nmachine: {ceilings.machine}, {args.threads} threads, "
          f"{ceilings.bandwidth_gbs:.1f} GB/s, fp32 GEMM {ceilings.matmul_gflops:.0f} GFLOP/s "
          f"(best library), {ceilings.torch_matmul_gflops:.0f} GFLOP/s (torch); "
          f"model {params / 1e6:.0f}M params fp32")
    print("| figure | transformers | tokenmill | ratio | tokenmill vs ceiling |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| decode ms/token (batch 1) | {decode['transformers_ms']:.1f} | "
          f"{decode['tokenmill_ms']:.1f} | {decode['transformers_ms'] / decode['tokenmill_ms']:.2f}x"
          f" | {roofline_ms / decode['tokenmill_ms']:.2f} of {roofline_ms:.0f} ms roofline |")
    print(f"| prefill 512 tok/s | {512 / prefill['transformers_s']:.0f} | "
          f"{512 / prefill['tokenmill_s']:.0f} | "
          f"{prefill['transformers_s'] / prefill['tokenmill_s']:.2f}x | "
          f"{prefill['tokenmill_gflops']:.0f} GFLOP/s: "
          f"{prefill['tokenmill_gflops'] / ceilings.torch_matmul_gflops:.2f} of torch's GEMM peak, "
          f"{prefill['tokenmill_gflops'] / ceilings.matmul_gflops:.2f} of the best library's "
          f"(transformers {prefill['transformers_gflops']:.0f} GFLOP/s) |")
    if "throughput" in results:
        tp = results["throughput"]
        best = min(tp["transformers_b8_s"], tp["transformers_b16_s"])
        print(f"| throughput out tok/s ({tp['requests']} req) | {tp['output_tokens'] / best:.1f} "
              f"(best of b8 {tp['output_tokens'] / tp['transformers_b8_s']:.1f}, "
              f"b16 {tp['output_tokens'] / tp['transformers_b16_s']:.1f}) | "
              f"{tp['output_tokens'] / tp['tokenmill_s']:.1f} | "
              f"{best / tp['tokenmill_s']:.2f}x | |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
