"""Single-stream decode: tokenmill's quantized weights next to llama.cpp's GGUF types, on
the random Qwen2.5-0.5B shape, in one run.

llama.cpp (built by `tokenmill bench peers install --peer llamacpp`) runs `llama-bench`
on --gguf-types: F32, F16, Q8_0 (written by its converter) and Q4_K_M (llama-quantize
from the F16 file): decode of --new-tokens tokens at a context depth of --prompt tokens (`-d`), its
own tokens/s. tokenmill runs its engine in this process: one request of --prompt random
tokens + --new-tokens, 1 / time per output token. Systems are measured interleaved
(A B C ..., repeated --repeats times), medians printed with the ratio to the first GGUF
type and the load average at the start and end (timings from a busy machine are noise).

    python benchmarks/bench_quant_llamacpp.py [--threads 2] [--repeats 3]
        [--methods fp32,int8,int4-rtn,int4-hqq] [--gguf-types F16,Q8_0,Q4_K_M]
        [--json out.json]

A method may name the attention backend it runs with, `int8-a8@paged-native`, and the
float32 product path, `fp32:native` (`--cpu-blas`; the engine's default otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import MODEL_DIR, build_model, random_prompt  # noqa: E402
from bench_quant import method_options  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.peers import PEERS_DIR, LlamaCppPeer  # noqa: E402
from tokenmill.layers.isa import llamacpp_build_name  # noqa: E402

GGUF_TYPES = ("F32", "F16", "Q8_0", "Q4_K_M")


def gguf_files(model_dir: Path, kinds: list[str]) -> dict[str, Path]:
    """F32, F16 and Q8_0 from the converter, Q4_K_M quantized from F16 (each written once)."""
    files = {}
    for kind in kinds:
        if kind != "Q4_K_M":
            files[kind] = LlamaCppPeer(kind.lower()).gguf_path(str(model_dir))
            continue
        f16 = LlamaCppPeer("f16").gguf_path(str(model_dir))
        q4 = f16.with_name(f16.name.replace("-f16.gguf", "-q4_k_m.gguf"))
        if not q4.is_file():
            quantize = PEERS_DIR / "llamacpp" / llamacpp_build_name() / "bin" / "llama-quantize"
            subprocess.run([str(quantize), str(f16), str(q4), "Q4_K_M"], check=True)
        files[kind] = q4
    return files


def llama_bench(path: Path, threads: int, prompt: int, new_tokens: int) -> float:
    """llama-bench's decode tokens/s at a context depth of `prompt` tokens."""
    binary = PEERS_DIR / "llamacpp" / llamacpp_build_name() / "bin" / "llama-bench"
    out = subprocess.run([str(binary), "-m", str(path), "-t", str(threads), "-p", "0",
                          "-n", str(new_tokens), "-d", str(prompt), "-r", "1", "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def tokenmill_decode(llm: LLM, rng: random.Random, prompt: int, new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    out = llm.generate([random_prompt(rng, prompt)], params)[0]
    return 1.0 / out.outputs[0].metrics.time_per_output_token


def tokenmill_llm(model_dir: Path, spec: str, args: argparse.Namespace) -> LLM:
    """An engine for `method[@attention_backend][:cpu_blas]` (the engine's defaults
    unless named)."""
    spec, _, blas = spec.partition(":")
    method, _, backend = spec.partition("@")
    chosen = {"attention_backend": backend} if backend else {}
    if blas:
        chosen["cpu_blas"] = blas
    return LLM(str(model_dir), progress=False, num_threads=args.threads,
               kv_cache_memory=2**28, **chosen, **method_options(method, args.group_size))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--methods", default="fp32,int8,int4-rtn,int4-hqq")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--gguf-types", default="F16,Q8_0,Q4_K_M",
                        help=f"llama.cpp's formats to run, from {','.join(GGUF_TYPES)}")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model_dir = build_model(MODEL_DIR)
    kinds = args.gguf_types.split(",")
    if not kinds or not set(kinds) <= set(GGUF_TYPES):
        parser.error(f"--gguf-types: choose from {','.join(GGUF_TYPES)}, got {args.gguf_types!r}")
    ggufs = gguf_files(model_dir, kinds)
    llms = {f"tokenmill {m}": tokenmill_llm(model_dir, m, args)
            for m in args.methods.split(",")}
    rng = random.Random(0)
    for llm in llms.values():  # warm-up: kernel tables, oneDNN shapes
        tokenmill_decode(llm, rng, 32, 4)
    load_before = os.getloadavg()
    runs: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        for kind, path in ggufs.items():
            runs.setdefault(f"llama.cpp {kind}", []).append(
                llama_bench(path, args.threads, args.prompt, args.new_tokens))
        for name, llm in llms.items():
            runs.setdefault(name, []).append(tokenmill_decode(
                llm, random.Random(repeat), args.prompt, args.new_tokens))
    load_after = os.getloadavg()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    base_name = f"llama.cpp {kinds[0]}"
    base = medians[base_name]
    print(f"\nsingle-stream decode, random Qwen2.5-0.5B shape, {args.threads} threads, "
          f"prompt {args.prompt} + {args.new_tokens} new, median of {args.repeats} "
          f"interleaved; load average {load_before[0]:.2f} -> {load_after[0]:.2f}")
    print(f"{'system':<24} {'tok/s':>8} {'vs ' + base_name:>17} {'runs':>24}")
    for name, value in medians.items():
        spread = " ".join(f"{v:.1f}" for v in runs[name])
        print(f"{name:<24} {value:>8.1f} {value / base:>16.2f}x {spread:>24}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "medians": medians,
                                         "loadavg": [load_before, load_after]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
