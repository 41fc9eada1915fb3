"""Loading a pre-quantized checkpoint (`tokenmill quantize`) against quantizing the float
checkpoint at load, in one run: seconds to a ready engine, peak resident memory, and
greedy tokens of both (which must be equal).

Each method's checkpoint is written once (the quantize time is printed), then every
load runs in a fresh process (the peak is the process's own), interleaved: float32,
then per method at-load and saved, repeated --repeats times; medians are printed with
the ratio saved / at-load.

    python benchmarks/bench_prequantized.py [--model DIR|0.5b] [--threads 2]
        [--methods int8,int4-rtn,int4-hqq,int4-awq] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import MODEL_DIR, build_model  # noqa: E402
from bench_quant import method_options, resident_bytes  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.ceilings import CACHE  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.quantize import quantize_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 17, 42, 99, 3, 8, 1, 2, 3, 4, 5, 6, 7, 300, 12]


def _load_in_child(model_dir: str, options: dict, threads: int, queue) -> None:
    before = resident_bytes()
    start = time.perf_counter()
    llm = LLM(model_dir, progress=False, num_threads=threads, kv_cache_memory=2**26, **options)
    load_s = time.perf_counter() - start
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    queue.put({"load_s": load_s, "baseline_mib": before / 2**20,
               "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "weights_mib": llm.engine.info.memory.weights / 2**20,
               "tokens": out[0].outputs[0].token_ids})


def load_once(model_dir: Path, options: dict, threads: int) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_load_in_child,
                            args=(str(model_dir), options, threads, queue))
    child.start()
    result = queue.get()
    child.join()
    return result


def saved_checkpoint(model_dir: Path, method: str, group_size: int) -> tuple[Path, float]:
    """The method's pre-quantized checkpoint (written when missing) and the seconds
    writing it took (0 when it was there)."""
    options = method_options(method, group_size)
    group = f"-g{group_size}" if "quantization_group_size" in options else ""
    out = CACHE / "prequantized" / f"{model_dir.name}-{method}{group}"
    if (out / "config.json").is_file():
        return out, 0.0
    start = time.perf_counter()
    quantize_checkpoint(EngineConfig.from_kwargs(model=str(model_dir), **options), out,
                        progress=False)
    return out, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "pycoder"),
                        help="a model directory, or 0.5b (the random Qwen2.5-0.5B shape)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", default="int8,int4-rtn,int4-hqq,int4-awq")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model_dir = build_model(MODEL_DIR) if args.model == "0.5b" else Path(args.model)
    methods = args.methods.split(",")
    saved, quantize_s = {}, {}
    for method in methods:
        saved[method], quantize_s[method] = saved_checkpoint(model_dir, method, args.group_size)
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        runs.setdefault("fp32", []).append(load_once(model_dir, {}, args.threads))
        for method in methods:
            options = method_options(method, args.group_size)
            runs.setdefault(f"{method} at load", []).append(
                load_once(model_dir, options, args.threads))
            runs.setdefault(f"{method} saved", []).append(
                load_once(saved[method], {}, args.threads))
    rows = {name: {key: statistics.median(r[key] for r in results)
                   for key in ("load_s", "baseline_mib", "peak_rss_mib", "weights_mib")}
            | {"tokens": results[0]["tokens"]} for name, results in runs.items()}
    print(f"\nload of {model_dir.name}, {args.threads} threads, median of {args.repeats} "
          "fresh processes (peak: the process's max RSS, interpreter and torch included)")
    print(f"{'checkpoint':<20} {'load s':>8} {'peak MiB':>9} {'over base':>10} "
          f"{'weights MiB':>12} {'vs at load':>18} {'tokens':>10}")
    for name, row in rows.items():
        method = name.split()[0]
        ratio = equal = ""
        if name.endswith("saved"):
            base = rows[f"{method} at load"]
            ratio = (f"{row['load_s'] / base['load_s']:.2f}x s, "
                     f"{row['peak_rss_mib'] / base['peak_rss_mib']:.2f}x peak")
            equal = "equal" if row["tokens"] == base["tokens"] else "DIFFER"
        print(f"{name:<20} {row['load_s']:>8.2f} {row['peak_rss_mib']:>9.0f} "
              f"{row['peak_rss_mib'] - row['baseline_mib']:>10.0f} {row['weights_mib']:>12.1f} "
              f"{ratio:>18} {equal:>10}")
    print("quantize (write once) s: " + ", ".join(
        f"{m} {s:.1f}" if s else f"{m} cached" for m, s in quantize_s.items()))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "quantize_s": quantize_s}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
