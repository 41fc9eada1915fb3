"""Seeded benchmark workloads: what each request asks for.

Sources:
- synthetic: random token-id prompts whose lengths are fixed, uniform or lognormal;
- jsonl: one object per line, {"prompt": str | [int], "max_tokens": int (optional)};
- code: prefixes of the local Python stdlib's source files (a code-completion set).

The same spec and seed always give the same requests. Output lengths follow the same
distribution as prompt lengths (around --output-len); benchmarks set ignore_eos so
every request produces exactly its max_tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SOURCES = ("synthetic", "jsonl", "code")
LENGTH_DISTS = ("fixed", "uniform", "lognormal")


@dataclass(frozen=True)
class WorkloadRequest:
    prompt: list[int] | str
    prompt_len: int  # tokens (measured with the tokenizer for text prompts)
    max_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    source: Literal["synthetic", "jsonl", "code"] = "synthetic"
    num_requests: int = 32
    input_len: int = 128
    output_len: int = 64
    length_dist: Literal["fixed", "uniform", "lognormal"] = "fixed"
    # uniform: lengths in [len * (1 - spread), len * (1 + spread)]; lognormal: sigma.
    spread: float = 0.5
    seed: int = 0
    path: str | None = None  # the JSONL file

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if self.length_dist not in LENGTH_DISTS:
            raise ValueError(f"length_dist must be one of {LENGTH_DISTS}, got "
                             f"{self.length_dist!r}")
        for name in ("num_requests", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0.0 <= self.spread <= 1.0 and self.length_dist == "uniform":
            raise ValueError(f"spread must be in [0, 1] for uniform lengths, got {self.spread!r}")
        if self.spread < 0:
            raise ValueError(f"spread must be >= 0, got {self.spread!r}")
        if self.source == "jsonl" and not self.path:
            raise ValueError("path is required for the jsonl source")


def sample_length(rng: random.Random, center: int, dist: str, spread: float) -> int:
    """A length >= 1 around center: fixed, uniform +-spread, or lognormal with median center."""
    if dist == "fixed":
        return center
    if dist == "uniform":
        low = max(1, math.floor(center * (1 - spread)))
        return rng.randint(low, max(low, math.ceil(center * (1 + spread))))
    # Lognormal tails are long; cap at 4x the median so one request cannot dominate.
    return max(1, min(4 * center, round(center * math.exp(rng.gauss(0.0, spread)))))


def build_workload(spec: WorkloadSpec, vocab_size: int, tokenizer=None,
                   avoid_token_ids: frozenset[int] = frozenset()) -> list[WorkloadRequest]:
    """The requests of a spec. Text sources need the tokenizer to measure and cut prompts."""
    rng = random.Random(spec.seed)
    if spec.source == "jsonl":
        return _from_jsonl(spec, rng, tokenizer)
    if spec.source == "code":
        if tokenizer is None:
            raise ValueError("the code workload needs a tokenizer")
        return _code_prefixes(spec, rng, tokenizer)
    # Skip id 0 and the given ids (EOS, special tokens); draw from the rest.
    allowed = [i for i in range(1, vocab_size) if i not in avoid_token_ids]
    requests = []
    for _ in range(spec.num_requests):
        length = sample_length(rng, spec.input_len, spec.length_dist, spec.spread)
        prompt = [allowed[rng.randrange(len(allowed))] for _ in range(length)]
        requests.append(WorkloadRequest(prompt, length, _output_len(rng, spec)))
    return requests


def _output_len(rng: random.Random, spec: WorkloadSpec) -> int:
    return sample_length(rng, spec.output_len, spec.length_dist, spec.spread)


def _prompt_len(prompt: list[int] | str, tokenizer) -> int:
    if isinstance(prompt, list):
        return len(prompt)
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer to count their tokens")
    return len(tokenizer(prompt)["input_ids"])


def _from_jsonl(spec: WorkloadSpec, rng: random.Random, tokenizer) -> list[WorkloadRequest]:
    rows = []
    for number, line in enumerate(Path(spec.path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "prompt" not in row:
            raise ValueError(f"{spec.path}:{number}: each line needs a 'prompt'")
        rows.append(row)
    if not rows:
        raise ValueError(f"{spec.path} holds no prompts")
    requests = []
    for index in range(spec.num_requests):  # cycle through the file
        row = rows[index % len(rows)]
        max_tokens = int(row.get("max_tokens") or _output_len(rng, spec))
        requests.append(WorkloadRequest(row["prompt"], _prompt_len(row["prompt"], tokenizer),
                                        max_tokens))
    return requests


def stdlib_sources() -> list[Path]:
    """The stdlib's top-level .py files, sorted (the same list on every run of a Python)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)


def _code_prefixes(spec: WorkloadSpec, rng: random.Random, tokenizer) -> list[WorkloadRequest]:
    files = stdlib_sources()
    if not files:
        raise ValueError("no Python source files found in the stdlib directory")
    requests = []
    for _ in range(spec.num_requests):
        length = sample_length(rng, spec.input_len, spec.length_dist, spec.spread)
        text = rng.choice(files).read_text(errors="replace")
        ids = tokenizer(text[: 16 * length], add_special_tokens=False)["input_ids"][:length]
        prompt = tokenizer.decode(ids)
        requests.append(WorkloadRequest(prompt, _prompt_len(prompt, tokenizer),
                                        _output_len(rng, spec)))
    return requests


# ---- command line ------------------------------------------------------------------------
def add_workload_arguments(parser: argparse.ArgumentParser, num_requests: int = 32) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", choices=SOURCES, default="synthetic",
                       help="synthetic token ids, a JSONL file, or stdlib code prefixes")
    group.add_argument("--num-requests", type=int, default=num_requests)
    group.add_argument("--input-len", type=int, default=128, help="prompt tokens (center)")
    group.add_argument("--output-len", type=int, default=64, help="output tokens (center)")
    group.add_argument("--length-dist", choices=LENGTH_DISTS, default="fixed")
    group.add_argument("--spread", type=float, default=0.5,
                       help="uniform: +-fraction; lognormal: sigma")
    group.add_argument("--workload-seed", type=int, default=0)
    group.add_argument("--workload-file", default=None, help="JSONL prompts (--workload jsonl)")


def workload_spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(source=args.workload, num_requests=args.num_requests,
                        input_len=args.input_len, output_len=args.output_len,
                        length_dist=args.length_dist, spread=args.spread,
                        seed=args.workload_seed, path=args.workload_file)
