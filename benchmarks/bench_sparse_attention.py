"""Sparse decode attention against dense, teacher-forced on held-out code.

Each held-out file (pycoder's held-out stdlib split, bench_kv_quant.held_out_texts) of
--tokens tokens is fed as a --prompt-token prompt (prefilled densely: the sparse
backends sparsify decode rows only), then decoded one token per step with the
sampler overridden to append the file's own next token (teacher forcing), so every
backend sees the same context at every step. Per backend and budget: perplexity of the
file's tokens over the decoded positions and its delta against dense (`paged`), mean
KL(dense || sparse) of the next-token distributions, top-1 agreement with dense, keys
attended per query and KV head (the backend's counters; dense layers not counted) and
milliseconds per decode step.

    python benchmarks/bench_sparse_attention.py [--model models/pycoder] [--texts 4]
        [--tokens 2048] [--prompt 256] [--budgets 64,128,256,512]
        [--backends quest,static-topk,retrieval-topp] [--top-ps 0.5,0.9,0.99]
        [--dense-layers 2] [--plot out.png]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kv_quant import LogitsRecorder, held_out_texts  # noqa: E402

from tokenmill import SamplingParams  # noqa: E402
from tokenmill.engine.engine import LLMEngine  # noqa: E402


def teacher_forced(engine: LLMEngine, text: list[int], prompt: int
                   ) -> tuple[torch.Tensor, float]:
    """Logits predicting text[prompt:] ([n, vocab]) and ms per decode step, with every
    sampled token replaced by the text's own."""
    worker = engine.executor.worker
    recorder = LogitsRecorder(worker.runner.model)
    sampler = worker.sampler
    inner = sampler._sample

    def forced(requests, logits, result):
        inner(requests, logits, result)
        for request in requests:
            position = request.num_computed_tokens + request.num_new_tokens
            result.output(request.request_id).token_ids = [text[position]]

    sampler._sample = forced
    try:
        engine.add_request("text", text[:prompt], SamplingParams(
            temperature=0, max_tokens=len(text) - prompt, ignore_eos=True))
        engine.step()  # the prefill (one step at these lengths)
        started, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        elapsed = (time.perf_counter() - started) / max(steps, 1) * 1e3
    finally:
        sampler._sample = inner
        worker.runner.model.compute_logits = recorder.inner
    logits = torch.cat(recorder.rows)
    assert logits.shape[0] == len(text) - prompt, (logits.shape, len(text), prompt)
    return logits, elapsed


def measure(model: str, texts: list[list[int]], prompt: int, **options) -> dict:
    engine = LLMEngine.from_kwargs(model, progress=False,
                                   max_num_batched_tokens=max(len(t) for t in texts),
                                   **options)
    try:
        runs = [teacher_forced(engine, text, prompt) for text in texts]
        backend = engine.executor.worker.runner.backend
        active = (backend.active_tokens / backend.queries
                  if getattr(backend, "queries", 0) else None)
    finally:
        engine.shutdown()
    return {"logits": [r[0] for r in runs], "ms": statistics.median(r[1] for r in runs),
            "active": active}


def compare(result: dict, dense: dict, texts: list[list[int]], prompt: int) -> dict:
    nll, kl, agree, count = 0.0, 0.0, 0, 0
    for logits, reference, text in zip(result["logits"], dense["logits"], texts, strict=True):
        targets = torch.tensor(text[prompt:])
        logp, ref_logp = logits.log_softmax(-1), reference.log_softmax(-1)
        nll -= logp.gather(1, targets[:, None]).sum().item()
        kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
        agree += (logits.argmax(-1) == reference.argmax(-1)).sum().item()
        count += len(targets)
    return {"ppl": math.exp(nll / count), "kl": kl / count, "top1": agree / count}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/pycoder")
    parser.add_argument("--texts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--budgets", default="64,128,256,512")
    parser.add_argument("--backends", default="quest,static-topk")
    parser.add_argument("--top-ps", default="0.5,0.9,0.99",
                        help="retrieval-topp: its --sparse-top-p values (instead of budgets)")
    parser.add_argument("--ceiling", type=int, default=2048,
                        help="retrieval-topp: its --sparse-budget (most keys per head)")
    parser.add_argument("--dense-layers", type=int, default=2)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    probe = LLMEngine.from_kwargs(args.model, progress=False)
    texts = held_out_texts(probe, args.tokens, args.texts)
    probe.shutdown()
    if len(texts) < args.texts:
        print(f"only {len(texts)} held-out files have {args.tokens} tokens")
    dense = measure(args.model, texts, args.prompt, attention_backend="paged")
    base = compare(dense, dense, texts, args.prompt)
    positions = sum(len(t) - args.prompt for t in texts)
    print(f"{args.model}: {len(texts)} held-out files of {args.tokens} tokens, prompt "
          f"{args.prompt}, {positions} teacher-forced decode positions; first "
          f"{args.dense_layers} layers dense")
    print("| backend | budget | perplexity | delta | mean KL | top-1 vs dense "
          "| keys per query | ms per step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| paged (dense) | all | {base['ppl']:.3f} | | | | {(args.prompt + args.tokens) // 2} (mean) "
          f"| {dense['ms']:.2f} |")
    points = []
    for backend in args.backends.split(","):
        topp = backend == "retrieval-topp"
        for value in (args.top_ps if topp else args.budgets).split(","):
            knobs = ({"sparse_top_p": float(value), "sparse_budget": args.ceiling} if topp
                     else {"sparse_budget": int(value)})
            result = measure(args.model, texts, args.prompt, attention_backend=backend,
                             sparse_dense_layers=args.dense_layers, sparse_min_context=0,
                             **knobs)
            stats = compare(result, dense, texts, args.prompt)
            delta = stats["ppl"] / base["ppl"] - 1
            points.append((backend, result["active"], stats["kl"]))
            label = f"p {value}" if topp else value
            print(f"| {backend} | {label} | {stats['ppl']:.3f} | {100 * delta:+.2f}% "
                  f"| {stats['kl']:.2e} | {100 * stats['top1']:.2f}% "
                  f"| {result['active']:.0f} | {result['ms']:.2f} |", flush=True)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for backend in args.backends.split(","):
            xs = [b for n, b, _ in points if n == backend]
            ax.plot(xs, [k for n, _, k in points if n == backend], marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("keys attended per decode query and KV head (mean, sparse layers)")
        ax.set_ylabel("mean KL vs dense (nats)")
        ax.set_title(f"{Path(args.model).name}: sparse decode attention, teacher-forced")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
