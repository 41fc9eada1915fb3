"""Single-stream n-gram speculative decoding under each attention backend, interleaved.

Speculative steps verify a row of k + 1 tokens per request; `paged` gathers the
context and runs a masked SDPA for it, `paged-native` takes each of the row's tokens
as a row of the in-place kernel. Prompts: --prompts windows of --prompt-chars
characters of a source file of this repository (code the n-gram lookup finds
repeats in); output tokens/s of --max-tokens greedy tokens per prompt, one request at
a time, backends alternated --repeats times, medians printed.

    python benchmarks/bench_spec_backends.py [--model models/pycoder] [--k 7]
        [--backends paged,paged-native] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "pycoder"))
    parser.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    parser.add_argument("--backends", default="paged,paged-native")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-chars", type=int, default=1800)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    text = (ROOT / "tokenmill" / "attention" / "paged.py").read_text()
    step = args.prompt_chars // 2
    prompts = [text[i * step:i * step + args.prompt_chars] for i in range(args.prompts)]
    llms = {name: LLM(args.model, progress=False, num_threads=args.threads,
                      attention_backend=name, speculative_method="ngram",
                      num_speculative_tokens=args.k)
            for name in args.backends.split(",")}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))
    runs: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, llm in llms.items():
            start, tokens = time.perf_counter(), 0
            for prompt in prompts:
                tokens += len(llm.generate([prompt], params)[0].outputs[0].token_ids)
            runs.setdefault(name, []).append(tokens / (time.perf_counter() - start))
    base = statistics.median(next(iter(runs.values())))
    print(f"n-gram speculation k={args.k}, single stream, {args.prompts} prompts x "
          f"{args.max_tokens} tokens, {args.threads} threads, median of {args.repeats}")
    for name, values in runs.items():
        median = statistics.median(values)
        print(f"{name:<14} {median:8.1f} tok/s  {median / base:5.2f}x   "
              + " ".join(f"{v:.1f}" for v in values))


if __name__ == "__main__":
    main()
