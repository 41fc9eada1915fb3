"""Per-step overhead probe for A/B runs: pycoder, one request (64-token prompt, 256
greedy tokens), median ms/token of 7 generations after a warm-up. pycoder's steps are
~4 ms, so what the engine does per step in Python shows here first.

    for tree in A B A B ...; do PYTHONPATH=$tree python benchmarks/ab_tiny.py; done
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from tokenmill import LLM, SamplingParams


def main() -> None:
    torch.set_num_threads(2)
    llm = LLM(progress=False, num_threads=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 8000) for _ in range(64)]]
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(prompts, params)
    times = []
    for _ in range(7):
        started = time.perf_counter()
        llm.generate(prompts, params)
        times.append(time.perf_counter() - started)
    print(f"{1000 * statistics.median(times) / 256:.3f}")


if __name__ == "__main__":
    main()
