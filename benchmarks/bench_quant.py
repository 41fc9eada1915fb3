"""Weight quantization: speed, accuracy, load time and memory of each method, in one run.

Speed on the random Qwen2.5-0.5B shape (benchmarks/bench_core.py builds it), every
method's engine loaded side by side and measured interleaved (A B C D, A B C D, ...):
  - single-stream decode (prompt 128, --decode-tokens new): tokens/s and the fraction of
    the weight-bandwidth roofline for that method's bytes (what one token streams: every
    Linear weight in its stored form; tokenmill.bench.ceilings measures the bandwidth);
  - batch 8 and 32 decode (prompts 128, --decode-tokens new each), output tokens/s end
    to end (prefill included, as in MEASURING.md's reference table);
  - prefill of a 512-token prompt, tokens/s.
Load time and memory, each method in a fresh process: seconds to a ready engine
(quantization included; AWQ's calibration on stdlib files of pycoder's training split), peak and final resident memory, weight bytes as start-up
measures them.
Accuracy on pycoder (and pycoder-moe) against float32, teacher-forced on held-out stdlib
code (bench_kv_quant.py's texts and logits recorder): perplexity and its delta, mean
KL(fp32 || method) of next-token distributions, top-1 agreement.

Prints one table with float32 measured in the same run and every ratio to it; writes
--json and --plot (a PNG: decode speed against roofline, and KL against speed).

    python benchmarks/bench_quant.py [--threads 2] [--methods fp32,int8,int4-rtn,int4-hqq,int4-awq]
        [--group-size 128] [--repeats 3] [--json quant.json] [--plot quant.png]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import MODEL_DIR, build_model, random_prompt  # noqa: E402
from bench_kv_quant import LogitsRecorder, held_out_texts, teacher_forced_logits  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.ceilings import CACHE, machine_ceilings  # noqa: E402
from tokenmill.engine.engine import LLMEngine  # noqa: E402
from tokenmill.layers.linear import Linear  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
METHODS = {
    "fp32": {},
    "int8": {"quantization": "int8"},
    "int4-rtn": {"quantization": "int4", "quantization_method": "rtn"},
    "int4-hqq": {"quantization": "int4", "quantization_method": "hqq"},
    "int4-awq": {"quantization": "int4", "quantization_method": "awq"},
    "int4-rtn-fp32-head": {"quantization": "int4", "quantization_method": "rtn",
                           "quantization_exclude": "lm_head"},
    # int8 activations (W8A8 / W4A8 on AVX-512 VNNI), as llama.cpp's products do.
    "int8-a8": {"quantization": "int8", "quantization_activations": "int8"},
    "int4-rtn-a8": {"quantization": "int4", "quantization_method": "rtn",
                    "quantization_activations": "int8"},
}


def calibration_file() -> Path:
    """AWQ's calibration text: stdlib files of pycoder's training split (hash bucket 1,
    never bucket 0, the held-out texts accuracy is measured on)."""
    import hashlib
    import sysconfig

    path = CACHE / "quant-calibration.txt"
    if not path.is_file():
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        texts = []
        for file in sorted(stdlib.glob("*.py")):
            digest = hashlib.sha256(file.relative_to(stdlib).as_posix().encode()).digest()
            if int.from_bytes(digest[:8], "big") % 20 == 1:
                texts.append(file.read_text(errors="replace"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(texts[:40]))
    return path


def method_options(name: str, group_size: int) -> dict:
    options = dict(METHODS[name])
    if options.get("quantization") == "int4":
        options["quantization_group_size"] = group_size
    if options.get("quantization_method") == "awq":
        options["quantization_calibration"] = str(calibration_file())
    return options


def streamed_bytes(engine: LLMEngine) -> int:
    """Bytes one decode token reads: every Linear weight in the form its products read."""
    total, worker = 0, engine.executor.worker
    for layer in worker.runner.model.modules():
        if isinstance(layer, Linear):
            packed = getattr(layer, "quantized", None)
            total += (packed.nbytes if packed is not None
                      else layer.out_features * layer.in_features * worker.dtype.itemsize)
    return total


# ---- speed ------------------------------------------------------------------------------

def timed_generate(llm: LLM, prompts: list[list[int]], new_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, outputs


def speed_round(llm: LLM, rng: random.Random, args: argparse.Namespace) -> dict:
    _, (out,) = timed_generate(llm, [random_prompt(rng, 128)], args.decode_tokens)
    row = {"decode_tok_s": 1.0 / out.outputs[0].metrics.time_per_output_token}
    for batch in (8, 32):
        prompts = [random_prompt(rng, 128) for _ in range(batch)]
        elapsed, _ = timed_generate(llm, prompts, args.decode_tokens)
        row[f"batch{batch}_tok_s"] = batch * args.decode_tokens / elapsed
    _, (out,) = timed_generate(llm, [random_prompt(rng, args.prefill)], 1)
    row["prefill_tok_s"] = args.prefill / out.outputs[0].metrics.time_to_first_token
    return row


def speed(model_dir: Path, args: argparse.Namespace) -> dict[str, dict]:
    llms = {name: LLM(str(model_dir), progress=False, num_threads=args.threads,
                      max_num_seqs=32, kv_cache_memory=2**30, enable_prefix_caching=False,
                      **method_options(name, args.group_size))
            for name in args.methods}
    rng = random.Random(0)
    for llm in llms.values():  # warm-up: kernel tables, oneDNN shapes
        timed_generate(llm, [random_prompt(rng, 64)] * 2, 4)
    rounds: dict[str, list[dict]] = {name: [] for name in llms}
    for repeat in range(args.repeats):
        for name, llm in llms.items():  # interleaved, same prompts per repetition
            rounds[name].append(speed_round(llm, random.Random(repeat), args))
    ceilings = machine_ceilings(args.threads, refresh=True)
    results = {}
    for name, llm in llms.items():
        row = {key: statistics.median(r[key] for r in rounds[name]) for key in rounds[name][0]}
        row["bytes_per_token"] = streamed_bytes(llm.engine)
        row["roofline_tok_s"] = 1.0 / ceilings.decode_roofline_s(row["bytes_per_token"])
        results[name] = row
    results["_ceilings"] = vars(ceilings)
    return results


# ---- load time and memory (a fresh process per method) -------------------------------

def resident_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _load_in_child(model_dir: str, options: dict, threads: int, queue) -> None:
    before = resident_bytes()
    start = time.perf_counter()
    llm = LLM(model_dir, progress=False, num_threads=threads, kv_cache_memory=2**26, **options)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))  # first product
    queue.put({"load_s": time.perf_counter() - start,
               "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "rss_growth_mib": (resident_bytes() - before) / 2**20,
               "weights_mib": llm.engine.info.memory.weights / 2**20})


def load_costs(model_dir: Path, args: argparse.Namespace) -> dict[str, dict]:
    context = multiprocessing.get_context("spawn")
    results = {}
    for name in args.methods:
        queue = context.Queue()
        child = context.Process(target=_load_in_child, args=(
            str(model_dir), method_options(name, args.group_size), args.threads, queue))
        child.start()
        results[name] = queue.get()
        child.join()
    return results


# ---- accuracy ------------------------------------------------------------------------

def accuracy(model_dir: Path, args: argparse.Namespace) -> dict[str, dict]:
    engines = {name: LLMEngine.from_kwargs(
                   str(model_dir), progress=False, num_threads=args.threads,
                   enable_prefix_caching=False, max_num_batched_tokens=args.chunk_size,
                   chunk_size=args.chunk_size, max_num_seqs=4,
                   **method_options(name, args.group_size))
               for name in args.methods}
    recorders = {name: LogitsRecorder(e.executor.worker.runner.model)
                 for name, e in engines.items()}
    texts = held_out_texts(engines["fp32"], args.tokens, args.texts)
    stats = {name: {"nll": [], "kl": [], "top1": []} for name in engines}
    for ids in texts:
        logits = {n: teacher_forced_logits(engines[n], recorders[n], ids) for n in engines}
        targets = torch.tensor(ids[1:])
        reference = logits["fp32"][:-1].log_softmax(-1)
        for name in engines:
            logp = logits[name][:-1].log_softmax(-1)
            stats[name]["nll"].append(-logp.gather(-1, targets[:, None]).squeeze(-1))
            stats[name]["kl"].append((reference.exp() * (reference - logp)).sum(-1))
            stats[name]["top1"].append((logp.argmax(-1) == reference.argmax(-1)).double())
    base_ppl = torch.cat(stats["fp32"]["nll"]).mean().exp().item()
    results = {}
    for name, s in stats.items():
        ppl = torch.cat(s["nll"]).mean().exp().item()
        results[name] = {"ppl": ppl, "ppl_delta_pct": 100 * (ppl / base_ppl - 1),
                         "kl": torch.cat(s["kl"]).mean().item(),
                         "top1": torch.cat(s["top1"]).mean().item(),
                         "positions": sum(len(t) - 1 for t in texts)}
    return results


# ---- report ----------------------------------------------------------------------------

def print_speed(speeds: dict, loads: dict, prefill: int) -> None:
    ceilings = speeds["_ceilings"]
    print(f"\nspeed: {ceilings['machine']}, {ceilings['threads']} threads, "
          f"{ceilings['bandwidth_gbs']:.1f} GB/s read bandwidth (measured in this run)")
    print("| method | weights MiB | decode tok/s | of roofline | batch 8 tok/s | "
          f"batch 32 tok/s | prefill {prefill} tok/s | load s | peak RSS MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = speeds["fp32"]
    for name, r in speeds.items():
        if name.startswith("_"):
            continue
        load = loads.get(name, {})

        def cell(key: str, r: dict = r) -> str:
            return f"{r[key]:.1f} ({r[key] / base[key]:.2f}x)"

        print(f"| {name} | {r['bytes_per_token'] / 2**20:.0f} | {cell('decode_tok_s')} | "
              f"{r['decode_tok_s'] / r['roofline_tok_s']:.2f} of "
              f"{r['roofline_tok_s']:.1f} | {cell('batch8_tok_s')} | {cell('batch32_tok_s')} | "
              f"{cell('prefill_tok_s')} | {load.get('load_s', float('nan')):.1f} | "
              f"{load.get('peak_rss_mib', float('nan')):.0f} |")


def print_accuracy(model: str, rows: dict) -> None:
    any_row = next(iter(rows.values()))
    print(f"\naccuracy: {model}, {any_row['positions']} held-out positions, vs fp32")
    print("| method | perplexity | delta % | mean KL (nats) | top-1 agreement |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {r['ppl']:.4f} | {r['ppl_delta_pct']:+.3f} | {r['kl']:.2e} | "
              f"{100 * r['top1']:.2f}% |")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speeds = {k: v for k, v in results.get("speed", {}).items() if not k.startswith("_")}
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(speeds)
    left.bar(names, [speeds[n]["decode_tok_s"] for n in names], label="measured")
    left.scatter(names, [speeds[n]["roofline_tok_s"] for n in names], color="black",
                 marker="_", s=400, label="weight-bandwidth roofline")
    left.set_ylabel("single-stream decode tokens/s")
    left.tick_params(axis="x", labelrotation=20)
    left.legend()
    for model, rows in results.get("accuracy", {}).items():
        shared = [n for n in rows if n in speeds and n != "fp32"]
        right.scatter([speeds[n]["decode_tok_s"] for n in shared],
                      [rows[n]["kl"] for n in shared], label=Path(model).name)
        for n in shared:
            right.annotate(n, (speeds[n]["decode_tok_s"], rows[n]["kl"]))
    right.set_xlabel("decode tokens/s (0.5B shape)")
    right.set_ylabel("mean KL vs fp32 (nats)")
    right.set_yscale("log")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=MODEL_DIR,
                        help="speed model (default: the random Qwen2.5-0.5B shape)")
    parser.add_argument("--accuracy-models", default="models/pycoder,models/pycoder-moe")
    parser.add_argument("--methods", default="fp32,int8,int4-rtn,int4-hqq,int4-awq")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--texts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--json", type=Path, default=Path("bench_quant.json"))
    parser.add_argument("--plot", type=Path, default=Path("bench_quant.png"))
    args = parser.parse_args()
    args.methods = args.methods.split(",")
    if args.methods[0] != "fp32" or any(m not in METHODS for m in args.methods):
        parser.error(f"--methods: fp32 first, then any of {list(METHODS)}")
    torch.set_num_threads(args.threads)
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    if not args.skip_speed:
        model_dir = build_model(args.model)
        results["load"] = load_costs(model_dir, args)
        results["speed"] = speed(model_dir, args)
        print_speed(results["speed"], results["load"], args.prefill)
    if not args.skip_accuracy:
        results["accuracy"] = {}
        for model in args.accuracy_models.split(","):
            path = Path(model) if Path(model).is_absolute() else ROOT / model
            results["accuracy"][model] = accuracy(path, args)
            print_accuracy(model, results["accuracy"][model])
    args.json.write_text(json.dumps(results, indent=2))
    plot(results, args.plot)
    print(f"\nwrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
