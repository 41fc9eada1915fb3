"""Multiple-choice accuracy of each weight-quantization method, lm-eval style, scored
through the OpenAI-compatible server.

A question is a prefix of a held-out stdlib file (pycoder never trained on it:
bench_kv_quant.held_out_paths) ending at the end of a line, and four continuations:
the file's true next line and three other lines of the same file, re-indented like the
true one (so indentation gives nothing away), in a seeded order. Each choice is scored
as lm-eval-harness's `loglikelihood` requests score it through an OpenAI completions
endpoint: the context and context + continuation are tokenized, the continuation is the
tokens after the context's, and one request per question sends the four token-id
prompts with echo=true, max_tokens=1, logprobs=1; the continuation's summed
`token_logprobs` (the generated token dropped) is its score. acc picks the highest sum,
acc_norm the highest sum per character (lm-eval's acc_norm); "flips" counts questions
whose pick differs from float32's, the paired measure of what the method changed, and
"mean |d score|" how far it moves a continuation's summed log-likelihood (nats).

Every method runs `tokenmill serve` in a fresh process (the same questions, the same
order); AWQ calibrates on bench_quant's calibration text (training split, never these
files).

    python benchmarks/bench_mc.py [--model models/pycoder] [--questions 300]
        [--methods fp32,int8,int4-rtn,int4-hqq,int4-awq,int4-rtn-fp32-head] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kv_quant import held_out_paths  # noqa: E402
from bench_quant import method_options  # noqa: E402

from tokenmill.bench.peers import free_port  # noqa: E402
from tokenmill.chat import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONTEXT_LINES = 40
MAX_CONTEXT_TOKENS = 192
MIN_LINE_CHARS = 12
NUM_CHOICES = 4


@dataclass
class Question:
    context: list[int]
    continuations: list[list[int]]  # token ids after the context's, per choice
    lengths: list[int]  # characters per continuation (acc_norm)
    answer: int


def candidate_lines(lines: list[str]) -> list[int]:
    """Indices of lines worth asking about: code, not blank, comment or docstring text."""
    return [i for i, line in enumerate(lines)
            if len(line.strip()) >= MIN_LINE_CHARS and not line.strip().startswith(("#", '"""'))]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: the continuation is what tokenizing context + continuation adds
    after the context's own tokens."""
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    return context_ids, whole[len(context_ids):]


def build_questions(tokenizer, num_questions: int, seed: int) -> list[Question]:
    """Seeded questions spread over the held-out files (a few per file)."""
    rng = random.Random(seed)
    files = [p.read_text(errors="replace").splitlines() for p in held_out_paths()]
    files = [lines for lines in files if len(candidate_lines(lines)) > 20]
    per_file = max(1, math.ceil(num_questions / len(files)))
    questions: list[Question] = []
    for lines in files:
        candidates = candidate_lines(lines)
        asked = [i for i in rng.sample(candidates, min(per_file * 3, len(candidates))) if i >= 8]
        for index in asked[:per_file]:
            true = lines[index]
            indent = true[:len(true) - len(true.lstrip())]
            seen = {true.strip()}
            others = []
            for j in rng.sample(candidates, len(candidates)):
                if abs(j - index) > 3 and lines[j].strip() not in seen:
                    seen.add(lines[j].strip())
                    others.append(indent + lines[j].strip())
                if len(others) == NUM_CHOICES - 1:
                    break
            choices = [true, *others]
            rng.shuffle(choices)
            context = "\n".join(lines[max(0, index - CONTEXT_LINES):index])
            pairs = [encode_pair(tokenizer, context, "\n" + c) for c in choices]
            context_ids = pairs[0][0][-MAX_CONTEXT_TOKENS:]
            questions.append(Question(context_ids, [p[1] for p in pairs],
                                      [len(c) + 1 for c in choices], choices.index(true)))
    rng.shuffle(questions)
    return questions[:num_questions]


def score(client: httpx.Client, question: Question) -> list[float]:
    """Summed log-likelihood of each continuation given the context (one request)."""
    prompts = [question.context + continuation for continuation in question.continuations]
    body = {"prompt": prompts, "echo": True, "max_tokens": 1,
            "logprobs": 1, "temperature": 0}
    response = client.post("/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    start = len(question.context)
    # token_logprobs: every prompt token (the first None) and the generated one, dropped.
    return [sum(c["logprobs"]["token_logprobs"][start:-1]) for c in choices]


class Server:
    """`tokenmill serve` for one method, on a free port, until closed."""

    def __init__(self, model: str, options: dict, threads: int, log: Path) -> None:
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tokenmill", "serve", "--model", model, "--port", str(port),
             "--num-threads", str(threads), "--max-num-seqs", "16", *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "NO_PROXY": "*"})
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}; see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.close()
        raise RuntimeError(f"server not healthy after 600 s; see {log}")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)
        self.log.close()


def evaluate(model: str, name: str, options: dict, questions: list[Question],
             threads: int) -> dict:
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_mc-{name}.log"
    start = time.perf_counter()
    server = Server(model, options, threads, log)
    ready_s = time.perf_counter() - start
    try:
        with httpx.Client(base_url=server.url, trust_env=False) as client, \
                ThreadPoolExecutor(4) as pool:
            start = time.perf_counter()
            scores = list(pool.map(lambda q: score(client, q), questions))
            scoring_s = time.perf_counter() - start
    finally:
        server.close()
    picks = [max(range(NUM_CHOICES), key=s.__getitem__) for s in scores]
    norm_picks = [max(range(NUM_CHOICES), key=lambda i, s=s, q=q: s[i] / q.lengths[i])
                  for s, q in zip(scores, questions, strict=True)]
    return {"acc": sum(p == q.answer for p, q in zip(picks, questions, strict=True))
            / len(questions),
            "acc_norm": sum(p == q.answer for p, q in zip(norm_picks, questions, strict=True))
            / len(questions),
            "picks": picks, "norm_picks": norm_picks, "scores": scores, "ready_s": ready_s,
            "scoring_s": scoring_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "pycoder"))
    parser.add_argument("--methods", default="fp32,int8,int4-rtn,int4-hqq,int4-awq,"
                        "int4-rtn-fp32-head")
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    questions = build_questions(load_tokenizer(args.model), args.questions, args.seed)
    methods = args.methods.split(",")
    results = {name: evaluate(args.model, name, method_options(name, args.group_size),
                              questions, args.threads) for name in methods}
    n = len(questions)
    base = results[methods[0]]
    print(f"\n{Path(args.model).name}: {n} questions, {NUM_CHOICES} choices (chance 25%), "
          f"scored through /v1/completions (echo, logprobs); flips vs {methods[0]}")
    print(f"{'method':<22} {'acc':>14} {'acc_norm':>9} {'flips':>6} {'norm flips':>11} "
          f"{'mean |d score|':>15} {'ready s':>8} {'scoring s':>10}")
    for name, r in results.items():
        stderr = math.sqrt(r["acc"] * (1 - r["acc"]) / n)
        flips = sum(a != b for a, b in zip(r["picks"], base["picks"], strict=True))
        norm_flips = sum(a != b for a, b in zip(r["norm_picks"], base["norm_picks"],
                                                strict=True))
        # How far the method moves a continuation's summed log-likelihood (nats).
        drift = sum(abs(a - b) for ours, theirs in zip(r["scores"], base["scores"], strict=True)
                    for a, b in zip(ours, theirs, strict=True)) / (n * NUM_CHOICES)
        print(f"{name:<22} {100 * r['acc']:>7.1f} ± {100 * stderr:>3.1f} "
              f"{100 * r['acc_norm']:>9.1f} {flips:>6} {norm_flips:>11} {drift:>15.3f} "
              f"{r['ready_s']:>8.1f} {r['scoring_s']:>10.1f}")
    if args.json:
        args.json.write_text(json.dumps({"questions": n, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
