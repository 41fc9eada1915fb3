"""Whole-engine greedy decoding under each float32 product path (`--cpu-blas`), interleaved.

One engine per setting, all loaded at once; each round runs one request alone, then
--batch requests together (--max-tokens greedy tokens each, EOS ignored), settings
alternated --rounds times; output tokens/s medians printed with the ratio to the first
setting, and whether every setting produced the same tokens (the paths differ only in
the order of their sums).

    python benchmarks/bench_products_engine.py [--model models/pycoder]
        [--settings onednn,native] [--batch 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def parse(", "class Tree:\n    def __init__(self", "import os\n\ndef walk(",
           "for i in range("]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "pycoder"))
    parser.add_argument("--settings", default="onednn,native")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    settings = args.settings.split(",")
    llms = {s: LLM(args.model, progress=False, cpu_blas=s) for s in settings}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    rates: dict[tuple[str, int], list[float]] = {}
    tokens = {}
    for _ in range(args.rounds):
        for setting, llm in llms.items():
            for prompts in (PROMPTS[:1], batch):
                started = time.perf_counter()
                outputs = llm.generate(prompts, params)
                elapsed = time.perf_counter() - started
                rates.setdefault((setting, len(prompts)), []).append(
                    len(prompts) * args.max_tokens / elapsed)
                tokens[setting, len(prompts)] = [o.outputs[0].token_ids for o in outputs]
    print(f"{'setting':<10} {'requests':>8} {'out tok/s':>10} {'vs ' + settings[0]:>12}  rounds")
    for (setting, n), values in rates.items():
        base = statistics.median(rates[settings[0], n])
        median = statistics.median(values)
        print(f"{setting:<10} {n:>8} {median:>10.0f} {median / base:>11.2f}x  "
              + " ".join(f"{v:.0f}" for v in values))
    same = all(tokens[s, n] == tokens[settings[0], n] for s in settings for n in (1, args.batch))
    print(f"same greedy tokens under every setting: {same}")


if __name__ == "__main__":
    main()
