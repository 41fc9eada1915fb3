"""Long-context task accuracy, active tokens and decode speed of the sparse attention
backends against dense, on a long-context model (models/pycoder-long).

Tasks: tokenmill.train.longctx_tasks (needle, multi-key, multi-value, code), built
from held-out stdlib files with seeds 0 .. per-kind - 1 (never trained on), scored on
the greedy completion's first line. Each item runs alone, so the backend's counters
give that item's keys per decode query and KV head, per head kind (retrieval / local
for retrieval-topp; every head is "selected" for quest and static-topk) — the spread
across items is the budget adapting (or not) to the task.

Methods: `dense` (the default backend, paged-native), `paged` (the PyTorch paged
path the sparse backends extend: their prefill and dense layers), `<backend>@<budget>` for quest / static-topk
(tokens per query), `retrieval-topp@<p>` (--sparse-top-p; budget ceiling --ceiling),
`prune@<keep>` (dense attention with --prefill-pruning KEEP, experimental); a sparse
method with `+prefill` runs --sparse-prefill too (e.g. quest@1024+prefill). Every
method prefills a prompt in one step (--max-num-batched-tokens above the longest), or
in --chunk chunks (sparse prefill works on chunks with a cached context).

--speed adds decode tokens/s at batch 1 and 8 per context length (requests of
--lengths tokens of held-out code are prefilled, then --decode-steps decode steps are
timed) and the prefill time of one request of each length (every method in the same
run, interleaved per length).

    python benchmarks/bench_sparse_tasks.py [--model models/pycoder-long]
        [--lengths 2048,4096,8192] [--per-kind 10] [--methods dense,static-topk@512,...]
        [--speed] [--by-depth] [--check-transformers N] [--plot docs/bench_sparse_tasks.png]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.train.corpus import held_out_texts
from tokenmill.train.longctx import EVAL_MAX_TOKENS
from tokenmill.train.longctx_tasks import KINDS, make_items, score

DEFAULT_METHODS = ("dense,static-topk@256,static-topk@1024,quest@256,quest@1024,"
                   "retrieval-topp@0.5,retrieval-topp@0.9")


def engine_options(method: str, args: argparse.Namespace) -> dict:
    # Every method prefills a prompt in one step (prefill pruning needs it; the others
    # get the same step size, so their prefill times compare), or in --chunk chunks
    # (sparse prefill needs a cached context).
    step = {"max_num_batched_tokens": args.chunk
            or max(int(n) for n in args.lengths.split(",")) + 64}
    if method in ("dense", "paged"):  # the default backend, and the path sparse ones extend
        return {"attention_backend": "paged-native" if method == "dense" else "paged", **step}
    method, plus, extra = method.partition("+")
    if plus and extra != "prefill":
        raise SystemExit(f"unknown method suffix +{extra} (only +prefill)")
    backend, _, value = method.partition("@")
    if backend == "prune":  # --prefill-pruning KEEP on the dense backend
        return {"prefill_pruning": float(value), "prefill_pruning_layer": args.pruning_layer,
                "prefill_pruning_min_tokens": 512, "enable_prefix_caching": False, **step}
    options = {"attention_backend": backend, "sparse_dense_layers": args.dense_layers,
               "sparse_min_context": args.min_context, "sparse_prefill": bool(plus), **step}
    if backend == "retrieval-topp":
        options.update(sparse_top_p=float(value), sparse_budget=args.ceiling,
                       sparse_retrieval_fraction=args.retrieval_fraction,
                       sparse_calibration=args.calibration)
    else:
        options["sparse_budget"] = int(value)
    return options


def counts(llm: LLM) -> dict[str, list[int]]:
    """{head kind (or "prefill"): [keys attended, queries]} so far."""
    backend = llm.engine.executor.worker.runner.backend
    found = {kind: list(c) for kind, c in getattr(backend, "kind_counts", {}).items()}
    prefill = getattr(backend, "prefill_counts", [0, 0])
    if prefill[1]:
        found["prefill"] = list(prefill)
    return found


def run_tasks(llm: LLM, texts: list[str], kinds: list[str], lengths: list[int],
              per_kind: int) -> dict:
    """{(kind, length): {"accuracy", "active": {head kind: [keys per query per item]}}}"""
    params = SamplingParams(temperature=0, max_tokens=EVAL_MAX_TOKENS)
    results = {}
    for kind in kinds:
        for length in lengths:
            items = make_items(kind, per_kind, 0, texts, length,
                               lambda text: len(llm.engine.encode(text)))
            right, active, scored = 0, {}, []
            for item in items:
                before = counts(llm)
                output = llm.generate([item.prompt], params)[0]
                correct = score(item, output.outputs[0].text)
                right += correct
                scored.append((item, output.outputs[0].text, correct))
                for head_kind, (keys, queries) in counts(llm).items():
                    old = before.get(head_kind, [0, 0])
                    if queries > old[1]:
                        active.setdefault(head_kind, []).append(
                            (keys - old[0]) / (queries - old[1]))
            results[(kind, length)] = {"accuracy": right / len(items), "active": active,
                                       "items": scored}
            print(f"  {kind} @ {length}: {right}/{len(items)}", file=sys.stderr, flush=True)
    return results


def decode_speed(llm: LLM, prompt: list[int], batch: int, steps: int) -> float:
    """Decode tokens/s of `batch` requests of `prompt`, timed after their prefill."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        # A distinct first token per request: no prefix-cache sharing between them.
        engine.add_request(f"speed-{i}", [prompt[0] + i + 1] + prompt[1:], params)
    while any(not c.output_token_ids for g in engine.groups.values() for c in g.children):
        engine.step()
    for _ in range(2):  # warm-up: first decode steps of a new shape
        engine.step()
    started, done = time.perf_counter(), 0
    while done < steps and engine.has_unfinished_requests():
        engine.step()
        done += 1
    elapsed = time.perf_counter() - started
    while engine.has_unfinished_requests():
        engine.step()
    return batch * done / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/pycoder-long")
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--per-kind", type=int, default=10)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument("--dense-layers", type=int, default=2)
    parser.add_argument("--ceiling", type=int, default=2048,
                        help="retrieval-topp's --sparse-budget (most tokens a head keeps)")
    parser.add_argument("--retrieval-fraction", type=float, default=0.15)
    parser.add_argument("--calibration", default=None,
                        help="retrieval-topp's --sparse-calibration (default: the model's)")
    parser.add_argument("--min-context", type=int, default=0,
                        help="--sparse-min-context (0: sparse at every length, as measured "
                             "here; the engine's default measures a crossover)")
    parser.add_argument("--chunk", type=int, default=None,
                        help="--max-num-batched-tokens for every method (default: above the "
                             "longest prompt, so prompts prefill whole)")
    parser.add_argument("--pruning-layer", type=int, default=None,
                        help="prune@KEEP's --prefill-pruning-layer (default: the engine's)")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--no-tasks", action="store_true")
    parser.add_argument("--by-depth", action="store_true",
                        help="also print accuracy by where the asked fact sits (thirds of "
                             "the context)")
    parser.add_argument("--check-transformers", type=int, default=0, metavar="N",
                        help="greedy-complete up to N of the first method's wrong items "
                             "with transformers too: are the misses the model's or the "
                             "engine's?")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    kinds = args.kinds.split(",")
    methods = args.methods.split(",")
    texts = held_out_texts()
    table = {}
    if not args.no_tasks:
        for method in methods:
            print(f"{method} ...", file=sys.stderr, flush=True)
            llm = LLM(args.model, progress=False, **engine_options(method, args))
            table[method] = run_tasks(llm, texts, kinds, lengths, args.per_kind)
            llm.engine.shutdown()
        print_tasks(table, methods, kinds, lengths, args)
        if args.by_depth:
            print_by_depth(table, methods, kinds)
        if args.check_transformers:
            check_transformers(args.model, table[methods[0]], args.check_transformers)
    if args.speed:
        print_speed(args, methods, lengths, texts)
    if args.plot and table:
        plot(table, methods, kinds, lengths, args.plot)
    return 0


def print_tasks(table, methods, kinds, lengths, args) -> None:
    print(f"{args.model}: {args.per_kind} held-out items per task and length, greedy; "
          f"first {args.dense_layers} layers dense")
    print("| method | " + " | ".join(f"{k} {n}" for k in kinds for n in lengths)
          + " | mean keys / query (retrieval, local or selected heads; prefill) |")
    print("|" + " --- |" * (2 + len(kinds) * len(lengths)))
    for method in methods:
        cells = [f"{100 * table[method][(k, n)]['accuracy']:.0f}%"
                 for k in kinds for n in lengths]
        pooled: dict[str, list[float]] = {}
        for result in table[method].values():
            for head_kind, values in result["active"].items():
                pooled.setdefault(head_kind, []).extend(values)
        active = ", ".join(f"{kind} {statistics.mean(v):.0f}" for kind, v in pooled.items())
        print(f"| {method} | " + " | ".join(cells) + f" | {active or 'all'} |")
    for method in methods:
        rows = [(k, n, table[method][(k, n)]["active"].get("retrieval"))
                for k in kinds for n in lengths]
        if any(r[2] for r in rows):
            print(f"\n{method}: retrieval-head keys per query, per item (min / median / max)")
            for kind, length, values in rows:
                print(f"  {kind} @ {length}: {min(values):.0f} / "
                      f"{statistics.median(values):.0f} / {max(values):.0f}")


def print_by_depth(table, methods, kinds) -> None:
    """Accuracy per method and kind (all lengths pooled) by the asked fact's depth."""
    edges = (0.0, 1 / 3, 2 / 3, 1.01)
    print("\nBy the asked fact's depth in the context (items right / items; all lengths)")
    print("| method | kind | depth < 1/3 | 1/3-2/3 | > 2/3 |\n| --- | --- | --- | --- | --- |")
    for method in methods:
        for kind in kinds:
            scored = [entry for (k, _), result in table[method].items() if k == kind
                      for entry in result["items"]]
            cells = []
            for low, high in itertools.pairwise(edges):
                inside = [ok for item, _, ok in scored if low <= item.depths[0] < high]
                cells.append(f"{sum(inside)} / {len(inside)}")
            print(f"| {method} | {kind} | " + " | ".join(cells) + " |")


def check_transformers(model: str, results: dict, limit: int) -> None:
    """transformers' greedy completion of up to `limit` wrong items against the
    engine's: the same first line means the miss is the model's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    wrong = [(item, text) for result in results.values()
             for item, text, ok in result["items"] if not ok][:limit]
    same = 0
    print("\nWrong items, transformers' completion beside the engine's (first line)")
    for item, text in wrong:
        ids = tokenizer(item.prompt)["input_ids"]
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), do_sample=False, pad_token_id=0,
                              max_new_tokens=EVAL_MAX_TOKENS)[0, len(ids):]
        theirs = tokenizer.decode(out).split("\n", 1)[0]
        ours = text.split("\n", 1)[0]
        same += theirs == ours
        print(f"  {item.kind}, depth {item.depths[0]:.2f}, answer {item.answer!r}: "
              f"engine {ours!r}, transformers {theirs!r}")
    print(f"{same} / {len(wrong)} the same")


def print_speed(args, methods, lengths, texts) -> None:
    # No prefix caching: every timed prompt is computed, not found in the cache.
    llms = {m: LLM(args.model, progress=False,
                   **{**engine_options(m, args), "enable_prefix_caching": False})
            for m in methods}
    for llm in llms.values():  # fault the KV pools in now, not inside a timed step
        for cache in llm.engine.executor.worker.runner.kv_caches:
            cache.data.zero_()
    ids = [t for text in texts for t in llms[methods[0]].engine.encode(text)]
    print("\n| context | batch | " + " | ".join(methods) + " |")
    print("|" + " --- |" * (2 + len(methods)))
    for length in lengths:
        for batch in (1, 8):
            speeds = {m: decode_speed(llms[m], ids[:length - args.decode_steps - 4], batch,
                                      args.decode_steps) for m in methods}
            dense = speeds.get("dense")
            cells = [f"{s:.1f}" + (f" ({s / dense:.2f}x)" if dense and m != "dense" else "")
                     for m, s in speeds.items()]
            print(f"| {length} | {batch} | " + " | ".join(cells) + " |", flush=True)
    print("\nprefill of one request (time to first token, s; median of 3)")
    print("| context | " + " | ".join(methods) + " |")
    print("|" + " --- |" * (1 + len(methods)))
    for length in lengths:
        times = {m: prefill_seconds(llms[m], ids[:length - 16]) for m in methods}
        dense = times.get("dense")
        cells = [f"{t:.2f}" + (f" ({dense / t:.2f}x)" if dense and m != "dense" else "")
                 for m, t in times.items()]
        print(f"| {length} | " + " | ".join(cells) + " |", flush=True)
    for llm in llms.values():
        llm.engine.shutdown()


def prefill_seconds(llm: LLM, prompt: list[int]) -> float:
    """Median wall time of a one-token generation of `prompt` (after a warm-up)."""
    params = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for _ in range(4):
        started = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def plot(table, methods, kinds, lengths, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(kinds) + 1, figsize=(4 * (len(kinds) + 1), 3.6))
    for axis, kind in zip(axes, kinds, strict=False):
        for method in methods:
            axis.plot(lengths, [100 * table[method][(kind, n)]["accuracy"] for n in lengths],
                      marker="o", label=method)
        axis.set_title(kind)
        axis.set_xlabel("context tokens")
        axis.set_ylim(-5, 105)
    axes[0].set_ylabel("accuracy (%)")
    axes[0].legend(fontsize=7)
    topp = [m for m in methods if m.startswith("retrieval-topp")]
    boxes, labels = [], []
    for kind in kinds:
        values = [v for n in lengths
                  for v in table[topp[-1]][(kind, n)]["active"].get("retrieval", [])] if topp else []
        boxes.append(values)
        labels.append(kind)
    axes[-1].boxplot(boxes, tick_labels=labels)
    axes[-1].set_title(f"{topp[-1] if topp else ''}: retrieval keys / query")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
