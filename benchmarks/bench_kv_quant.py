"""Quantized KV cache (int8, fp8 e4m3) vs full precision: quality and throughput.

Quality, teacher-forced through the engine on held-out text (--texts stdlib .py
files outside pycoder's training split, tokenized, truncated to --tokens): each text is one request with prompt logprobs,
prefilled in chunks of --chunk-size tokens, so every chunk after the first reads
its context (and itself) back from the quantized cache. The logits of every prompt
position are recorded; per KV dtype the script reports
  - top-1 agreement: argmax equal to the full-precision argmax, per position;
  - free-running greedy agreement: tokens equal to full precision's greedy
    continuation before the first divergence (--gen-tokens from each text's start);
  - mean KL(full || quantized) of next-token distributions;
  - perplexity and its delta vs full precision.

Throughput, one run, interleaved: the same workload (--requests prompts of
--prompt-len random tokens, --output-len new tokens each) under
  (a) a fixed KV budget (--budget-seqs full-length fp32 sequences' worth of bytes):
      a smaller KV dtype buys more blocks, so more sequences run at once;
  (b) a budget that fits every request in every dtype (same concurrency): isolates
      the cost of quantizing on write and dequantising on read.

    python benchmarks/bench_kv_quant.py [--model DIR] [--threads 2]

--model defaults to models/pycoder when present, else a random-initialised Llama
(hidden 256, 4 layers, 8 heads, 2 KV heads of 32 dims) built once in the cache.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
import statistics
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from tokenmill import SamplingParams
from tokenmill.attention.paged import PagedAttention
from tokenmill.attention.registry import register_attention_backend
from tokenmill.bench.ceilings import CACHE
from tokenmill.engine.engine import LLMEngine
from tokenmill.kv import dequantize, quantize

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("auto", "int8", "fp8")


def default_model() -> Path:
    pycoder = ROOT / "models" / "pycoder"
    if (pycoder / "config.json").is_file():
        return pycoder
    path = CACHE / "models" / "kvq-llama-random"
    if not (path / "config.json").is_file():
        from transformers import AutoModelForCausalLM, LlamaConfig

        sys.path.insert(0, str(ROOT))
        from tests.models import VOCAB_SIZE, build_tokenizer

        print(f"building {path} (random Llama, hidden 256, 4 layers) ...", flush=True)
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                             max_position_embeddings=2048, initializer_range=0.1,
                             bos_token_id=0, eos_token_id=0, pad_token_id=0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
        build_tokenizer(path)
    return path


# ---- quality ----------------------------------------------------------------------------------

class LogitsRecorder:
    """Wraps the model's compute_logits and keeps every row it computes, in order."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner = model.compute_logits
        self.rows: list[torch.Tensor] = []
        model.compute_logits = self

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.inner(hidden)
        self.rows.append(logits.detach().double())
        return logits

    def take(self) -> torch.Tensor:
        out = torch.cat(self.rows)
        self.rows.clear()
        return out


def held_out_paths() -> Iterator[Path]:
    """Stdlib files pycoder never trained on: its corpus holds out a file when the
    SHA-256 of its path relative to the stdlib falls in bucket 0 of 20."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        relpath = path.relative_to(stdlib).as_posix()
        if {"site-packages", "test", "tests", "idle_test"} & set(relpath.split("/")[:-1]):
            continue
        digest = hashlib.sha256(relpath.encode()).digest()
        if int.from_bytes(digest[:8], "big") % 20 == 0:
            yield path


def held_out_texts(engine: LLMEngine, num_tokens: int, num_texts: int) -> list[list[int]]:
    """The first num_tokens tokens of held-out files (held_out_paths) that have as many."""
    texts = []
    for path in held_out_paths():
        ids = engine.encode(path.read_text(errors="replace"))[:num_tokens]
        if len(ids) == num_tokens:
            texts.append(ids)
        if len(texts) == num_texts:
            break
    return texts


def teacher_forced_logits(engine: LLMEngine, recorder: LogitsRecorder, ids: list[int]
                          ) -> torch.Tensor:
    """Logits at every position of ids [n, vocab], prefilled in chunks."""
    recorder.rows.clear()  # drop what other requests computed
    engine.add_request("text", ids, SamplingParams(temperature=0, max_tokens=1,
                                                   prompt_logprobs=0, ignore_eos=True))
    engine.run_to_completion()
    engine.check_integrity()
    logits = recorder.take()
    assert logits.shape[0] == len(ids), (logits.shape, len(ids))
    return logits


def greedy(engine: LLMEngine, prompt: list[int], num_tokens: int) -> list[int]:
    engine.add_request("gen", prompt, SamplingParams(temperature=0, max_tokens=num_tokens,
                                                     ignore_eos=True))
    return engine.run_to_completion()["gen"].outputs[0].token_ids


def quality(model: str, args: argparse.Namespace) -> tuple[list[dict], list[list[int]]]:
    engines = {d: LLMEngine.from_kwargs(model, progress=False, kv_cache_dtype=d,
                                        chunk_size=args.chunk_size,
                                        max_num_batched_tokens=args.chunk_size,
                                        enable_prefix_caching=False, max_num_seqs=4,
                                        num_threads=args.threads)
               for d in DTYPES}
    recorders = {d: LogitsRecorder(e.executor.worker.runner.model) for d, e in engines.items()}
    texts = held_out_texts(engines["auto"], args.tokens, args.texts)
    stats = {d: {"nll": [], "kl": [], "top1": [], "greedy": []} for d in DTYPES}
    for ids in texts:
        logits = {d: teacher_forced_logits(engines[d], recorders[d], ids) for d in DTYPES}
        targets = torch.tensor(ids[1:])
        ref_logp = logits["auto"][:-1].log_softmax(-1)
        for d in DTYPES:
            logp = logits[d][:-1].log_softmax(-1)
            stats[d]["nll"].append(-logp.gather(-1, targets[:, None]).squeeze(-1))
            stats[d]["kl"].append((ref_logp.exp() * (ref_logp - logp)).sum(-1))
            stats[d]["top1"].append((logp.argmax(-1) == ref_logp.argmax(-1)).double())
        prompt = ids[:args.gen_prompt]
        reference = greedy(engines["auto"], prompt, args.gen_tokens)
        for d in DTYPES:
            tokens = greedy(engines[d], prompt, args.gen_tokens)
            same = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=True))
                         if a != b), len(reference))
            stats[d]["greedy"].append(same / len(reference))
    rows = []
    ref_ppl = torch.cat(stats["auto"]["nll"]).mean().exp().item()
    for d in DTYPES:
        ppl = torch.cat(stats[d]["nll"]).mean().exp().item()
        rows.append({"kv": d, "ppl": ppl, "ppl_delta_pct": 100 * (ppl / ref_ppl - 1),
                     "kl": torch.cat(stats[d]["kl"]).mean().item(),
                     "top1": torch.cat(stats[d]["top1"]).mean().item(),
                     "greedy": statistics.mean(stats[d]["greedy"]),
                     "texts": len(texts), "positions": sum(len(t) - 1 for t in texts)})
    return rows, texts


# ---- key scale granularity (KIVI's question) ---------------------------------------------

class RecordingAttention(PagedAttention):
    """The reference backend, keeping every layer's post-RoPE K and V it is given."""

    name = "recording-paged"

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.keys: dict[int, list[torch.Tensor]] = {}
        self.values: dict[int, list[torch.Tensor]] = {}

    def forward(self, layer_index, q, k, v, kv_cache, metadata, scale):
        self.keys.setdefault(layer_index, []).append(k.double())
        self.values.setdefault(layer_index, []).append(v.double())
        return super().forward(layer_index, q, k, v, kv_cache, metadata, scale)


def relative_error(x: torch.Tensor, dtype: torch.dtype, per: str, group: int = 16) -> float:
    """||x - dequant(quant(x))|| / ||x|| for x [T, KVH, D], scales per token or per channel
    (one scale per channel per head over each group of `group` tokens, as KIVI)."""
    if per == "token":
        codes, scale = quantize(x, dtype)
        x_hat = dequantize(codes, scale, torch.float64)
    else:
        x = x[:x.shape[0] // group * group]
        grouped = x.reshape(-1, group, *x.shape[1:]).permute(0, 2, 3, 1)  # [G, KVH, D, group]
        codes, scale = quantize(grouped, dtype)
        x_hat = dequantize(codes, scale, torch.float64).permute(0, 3, 1, 2).reshape(x.shape)
    return ((x - x_hat).norm() / x.norm()).item()


def scale_granularity(model: str, texts: list[list[int]], threads: int) -> list[dict]:
    register_attention_backend(RecordingAttention)
    engine = LLMEngine.from_kwargs(model, progress=False, enable_prefix_caching=False,
                                   num_threads=threads, attention_backend=RecordingAttention.name)
    recorder = engine.executor.worker.runner.backend
    num_layers = engine.arch.num_layers
    rows = []
    for ids in texts:
        recorder.keys.clear()
        recorder.values.clear()
        engine.add_request("text", ids, SamplingParams(temperature=0, max_tokens=1))
        engine.run_to_completion()
        for layer in range(num_layers):
            keys = torch.cat(recorder.keys[layer])
            values = torch.cat(recorder.values[layer])
            for kind, x in (("K", keys), ("V", values)):
                for dtype in (torch.int8, torch.float8_e4m3fn):
                    rows.append({"kind": kind, "dtype": dtype, "layer": layer,
                                 "token": relative_error(x, dtype, "token"),
                                 "channel": relative_error(x, dtype, "channel")})
    summary = []
    for kind in ("K", "V"):
        for dtype in (torch.int8, torch.float8_e4m3fn):
            sel = [r for r in rows if r["kind"] == kind and r["dtype"] == dtype]
            summary.append({"kind": kind, "dtype": str(dtype).removeprefix("torch."),
                            "token": statistics.mean(r["token"] for r in sel),
                            "channel": statistics.mean(r["channel"] for r in sel),
                            "channel_wins": sum(r["channel"] < r["token"] for r in sel),
                            "cases": len(sel)})
    return summary


# ---- throughput -------------------------------------------------------------------------------

def run_workload(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"w{i}", prompt, params)
    running, steps = [], 0
    preempted_before = engine.scheduler.num_preemptions
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        running.append(engine.num_running)
        steps += 1
    elapsed = time.perf_counter() - start
    engine.check_integrity()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    return {"seconds": elapsed, "steps": steps, "mean_running": statistics.mean(running),
            "preemptions": engine.scheduler.num_preemptions - preempted_before,
            "tok_s": len(prompts) * output_len / elapsed}


def throughput(model: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    from tokenmill.model.loader import read_config
    from tokenmill.worker.memory import blocks_for, kv_bytes_per_block

    arch = read_config(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, arch.vocab_size) for _ in range(args.prompt_len)]
               for _ in range(args.requests)]
    seq_len = args.prompt_len + args.output_len
    fp32_seq_bytes = blocks_for(seq_len, 16) * kv_bytes_per_block(arch, 16, torch.float32)
    budgets = {f"fixed budget ({args.budget_seqs} fp32 seqs)": fp32_seq_bytes * args.budget_seqs,
               "ample budget (all fit)": fp32_seq_bytes * args.requests}
    results: dict[str, list[dict]] = {}
    for scenario, budget in budgets.items():
        engines = {d: LLMEngine.from_kwargs(
                       model, progress=False, kv_cache_dtype=d, kv_cache_memory=budget,
                       max_model_len=seq_len, max_num_seqs=args.requests, block_size=16,
                       max_num_batched_tokens=512, enable_prefix_caching=False,
                       num_threads=args.threads)
                   for d in DTYPES}
        for engine in engines.values():
            run_workload(engine, prompts[:2], 4)  # warm-up
        runs: dict[str, list[dict]] = {d: [] for d in DTYPES}
        for _ in range(args.repeats):
            for d in DTYPES:  # interleaved: A B C A B C ...
                runs[d].append(run_workload(engines[d], prompts, args.output_len))
        results[scenario] = []
        for d in DTYPES:
            median = sorted(runs[d], key=lambda r: r["seconds"])[len(runs[d]) // 2]
            results[scenario].append({"kv": d, "num_blocks": engines[d].kv_manager.num_blocks,
                                      "budget_mib": engines[d].kv_plan.total_bytes / 2**20,
                                      **median})
    return results


def gather_cost(args: argparse.Namespace) -> list[dict]:
    """Time of KVCache.gather for a decode batch: the dequantisation's own cost."""
    from tokenmill.kv import KVCache
    from tokenmill.kv.quant import storage_dtype

    batch, blocks_per_seq, block_size, heads, dim = 16, 64, 16, 2, 64
    table = torch.arange(batch * blocks_per_seq).reshape(batch, blocks_per_seq)
    rows = []
    caches = {}
    for d in DTYPES:
        cache = KVCache.allocate(batch * blocks_per_seq, block_size, heads, dim,
                                 storage_dtype(d, torch.float32), torch.float32,
                                 torch.device("cpu"))
        x = torch.randn(batch * blocks_per_seq * block_size, heads, dim)
        cache.write(x, x, torch.arange(x.shape[0]))
        caches[d] = cache
    times: dict[str, list[float]] = {d: [] for d in DTYPES}
    for _ in range(51):  # many short repetitions: the median skips scheduler hiccups
        for d in DTYPES:
            start = time.perf_counter()
            caches[d].gather(table)
            times[d].append(time.perf_counter() - start)
    for d in DTYPES:
        rows.append({"kv": d, "ms": 1000 * statistics.median(times[d]),
                     "bytes": caches[d].data[0][table].nbytes * 2
                     + (caches[d].scales[0][table].nbytes * 2 if caches[d].quantized else 0)})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--texts", type=int, default=8, help="held-out stdlib files")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per held-out text")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--gen-prompt", type=int, default=64)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--budget-seqs", type=int, default=4,
                        help="fixed budget: this many full-length fp32 sequences' bytes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("tokenmill").setLevel(logging.ERROR)  # one line per preemption otherwise
    model = str(args.model or default_model())
    print(f"model {model}, {args.threads} threads")

    if not args.skip_quality:
        rows, texts = quality(model, args)
        print(f"\nquality: {rows[0]['texts']} stdlib texts x {args.tokens} tokens "
              f"({rows[0]['positions']} positions), chunk {args.chunk_size}")
        print("| kv cache | perplexity | delta % | mean KL (nats) | top-1 agreement | "
              f"greedy agreement ({args.gen_tokens} tokens) |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['kv']} | {r['ppl']:.4f} | {r['ppl_delta_pct']:+.3f} | {r['kl']:.2e} | "
                  f"{100 * r['top1']:.2f}% | {100 * r['greedy']:.1f}% |")

        granularity = scale_granularity(model, texts, args.threads)
        print("\nscale granularity: relative error ||x - x_hat|| / ||x|| of post-RoPE K and V, "
              "mean over layers and texts")
        print("| tensor | codes | per token per head | per channel per 16-token group (KIVI) | "
              "per-channel better in |")
        print("| --- | --- | --- | --- | --- |")
        for r in granularity:
            print(f"| {r['kind']} | {r['dtype']} | {r['token']:.2e} | {r['channel']:.2e} | "
                  f"{r['channel_wins']}/{r['cases']} |")

    cost = gather_cost(args)
    print("\ngather of a decode batch (16 seqs x 1024 tokens, 2 KV heads x 64), one layer:")
    print("| kv cache | ms | bytes gathered | ratio vs auto |")
    print("| --- | --- | --- | --- |")
    for r in cost:
        print(f"| {r['kv']} | {r['ms']:.2f} | {r['bytes'] / 2**20:.1f} MiB | "
              f"{r['ms'] / cost[0]['ms']:.2f}x |")

    if args.skip_throughput:
        return 0
    results = throughput(model, args)
    print(f"\nthroughput: {args.requests} requests, prompt {args.prompt_len}, "
          f"{args.output_len} new tokens, median of {args.repeats} interleaved runs")
    print("| scenario | kv cache | KV MiB | blocks | mean running | preemptions | steps | "
          "ms/step | out tok/s | ratio vs auto |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for scenario, rs in results.items():
        for r in rs:
            print(f"| {scenario} | {r['kv']} | {r['budget_mib']:.1f} | {r['num_blocks']} | "
                  f"{r['mean_running']:.1f} | {r['preemptions']} | {r['steps']} | "
                  f"{1000 * r['seconds'] / r['steps']:.1f} | "
                  f"{r['tok_s']:.1f} | {r['tok_s'] / rs[0]['tok_s']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
