"""In-engine decode step time for each attention backend, interleaved rounds.

A fresh engine per measurement prefills `--requests` random prompts of `--context`
tokens, then times `--steps` decode-only steps (median); rounds alternate the
backends. What `bench_paged_attention.py` measures per layer, seen end to end.

    python benchmarks/bench_decode_steps.py [--model models/pycoder] [--requests 8]
        [--context 1500] [--steps 24] [--rounds 3] [--backends paged,paged-native]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tokenmill import SamplingParams
from tokenmill.engine.engine import LLMEngine


def decode_step_ms(model: str, backend: str, requests: int, context: int, steps: int,
                   num_blocks: int) -> float:
    rng = random.Random(0)
    engine = LLMEngine.from_kwargs(model, progress=False, attention_backend=backend,
                                   max_num_batched_tokens=4096, num_blocks=num_blocks)
    try:
        vocab = engine.arch.vocab_size
        for i in range(requests):
            engine.add_request(str(i), [rng.randrange(10, vocab - 1) for _ in range(context)],
                               SamplingParams(max_tokens=steps + 64, temperature=0,
                                              ignore_eos=True))
        scheduler = engine.scheduler
        while scheduler.waiting or any(r.num_computed_tokens < context
                                       for r in scheduler.running):
            engine.step()
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
    finally:
        engine.shutdown()
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/pycoder")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=1200)
    parser.add_argument("--backends", default="paged,paged-native")
    args = parser.parse_args()
    backends = args.backends.split(",")
    results: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(args.rounds):
        for backend in backends:
            results[backend].append(decode_step_ms(args.model, backend, args.requests,
                                                   args.context, args.steps, args.num_blocks))
    base = statistics.median(results[backends[0]])
    print(f"{args.model}: {args.requests} requests at {args.context} tokens of context")
    print("| backend | ms per decode step (median of rounds) | vs " + backends[0] + " | rounds |")
    print("| --- | --- | --- | --- |")
    for backend, times in results.items():
        median = statistics.median(times)
        print(f"| {backend} | {median:.2f} | {base / median:.2f}x | "
              + " ".join(f"{t:.2f}" for t in times) + " |")


if __name__ == "__main__":
    main()
