"""`tokenmill bench compare`: one workload across engine configs and peers, in one run.

    tokenmill bench compare --model DIR \\
        --configs 'baseline:' 'chunked-off:enable_chunked_prefill=false' 'chunk256:chunk_size=256' \\
        --peers transformers --concurrency 1,8 --repeats 3 --out-dir bench-out

Every config gets its own engine, loaded up front (engine flags on the command line
are the common base; a config's options override them). Repetitions interleave the
systems (A B C A B C ...) at each concurrency, so drift on a shared machine hits all
of them alike. The first config is the baseline of every ratio in the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenmill.bench.ceilings import describe, host_description, machine_ceilings
from tokenmill.bench.driver import run_engine_workload, warm_up
from tokenmill.bench.metrics import summarize
from tokenmill.bench.peer_registry import available_peers, peer_name, place_peers
from tokenmill.bench.report import SystemResult, write_report
from tokenmill.bench.workload import WorkloadRequest
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.model.loader import resolve_device


@dataclass(frozen=True)
class NamedConfig:
    name: str
    options: dict[str, Any]


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "on", "yes"):
        return True
    if lowered in ("false", "off", "no"):
        return False
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_config(spec: str) -> NamedConfig:
    """'name:opt=val,opt=val' (options optional) -> NamedConfig; values typed loosely."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"config {spec!r} needs a name before ':'")
    options = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"config {name!r}: {item!r} is not opt=value")
        options[key.strip().replace("-", "_")] = _parse_value(value.strip())
    return NamedConfig(name, options)


def build_configs(base: dict[str, Any], specs: list[str]) -> list[tuple[str, EngineConfig]]:
    named = [parse_config(s) for s in specs]
    names = [n.name for n in named]
    if len(set(names)) != len(names):
        raise ValueError(f"config names must be unique, got {names}")
    return [(n.name, EngineConfig.from_kwargs(**config_options(base, n))) for n in named]


def config_options(base: dict[str, Any], named: NamedConfig) -> dict[str, Any]:
    """A config's engine options: the command line's base, the config's own on top."""
    return {**base, **named.options}


def run_compare(engines: list[tuple[str, LLMEngine]], peers: list, model_dir: str,
                workload_for: Callable[[int], list[WorkloadRequest]],
                levels: list[int | None], repeats: int, progress: bool = True,
                skipped: list[str] | None = None) -> list[SystemResult]:
    """workload_for(round) gives the requests of one round (one repetition at one level);
    every system runs the same requests in a round. A peer that fails to start is
    skipped (noted in `skipped`), not fatal."""
    threads = torch.get_num_threads()
    rounds = [workload_for(i) for i in range(len(levels) * repeats)]
    top = max((lv or max(len(w) for w in rounds)) for lv in levels)
    max_len = max(r.prompt_len + r.max_tokens for w in rounds for r in w) + 8
    started = []
    for peer in peers:
        try:
            peer.prepare(model_dir, top, threads, max_len)
            started.append(peer)
        except Exception as exc:  # noqa: BLE001 - a broken peer must not sink the run
            note = f"{peer.name} (failed to start: {exc})"
            print(f"skipping {note}", file=sys.stderr)
            if skipped is not None:
                skipped.append(note)
    peers = started
    results = {(name, level): SystemResult(name, level)
               for name in [n for n, _ in engines] + [p.name for p in peers] for level in levels}
    try:
        for level_index, level in enumerate(levels):
            for rep in range(repeats):
                workload = rounds[level_index * repeats + rep]
                for name, engine in engines:
                    run = run_engine_workload(engine, workload, level, progress,
                                              desc=f"{name} c={level or 'all'} rep {rep + 1}",
                                              id_prefix=f"{name}-{level}-{rep}")
                    _add(results[(name, level)], run)
                for peer in peers:
                    _add(results[(peer.name, level)],
                         peer.run(model_dir, workload, level, threads, progress))
    finally:
        for peer in peers:
            peer.close()
    return list(results.values())


def _add(result: SystemResult, run) -> None:
    result.summaries.append(summarize(run.records, run.duration_s))
    result.records.extend(run.records)
    # Peers' runs carry no speculation counters.
    result.spec_draft_tokens += getattr(run, "spec_draft_tokens", 0)
    result.spec_accepted_tokens += getattr(run, "spec_accepted_tokens", 0)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from tokenmill.arguments import engine_config_from_args
    from tokenmill.bench.workload import build_workload, workload_spec_from_args

    try:
        base = engine_config_from_args(args)
        base_options = {k: getattr(args, k) for k in vars(args)
                        if k in _engine_option_names() and getattr(args, k) is not None}
        configs = build_configs(base_options, args.configs)
        spec = workload_spec_from_args(args)
        levels = ([None if c in ("all", "0") else int(c) for c in args.concurrency.split(",")]
                  if args.concurrency else [None])
        peer_names = [p for p in (args.peers or "").split(",") if p]
        peers = available_peers(peer_names)
        first_options = config_options(base_options, parse_config(args.configs[0]))
        place_peers(peers, base.model.device, base.model.dtype, first_options)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    host = {"cpu": host_description()}
    if args.ceilings and resolve_device(base.model.device).type == "cpu":
        print("measuring this host's ceilings (fp32 GEMM, read bandwidth)", flush=True)
        threads = base.model.num_threads or torch.get_num_threads()  # the engines' count
        host["ceilings"] = describe(machine_ceilings(threads, refresh=True)) \
            + ", measured before the run"
    engines = []
    for name, config in configs:
        print(f"loading {name}: {config.scheduler}", flush=True)
        engine = LLMEngine(config)
        warm_up(engine)
        engines.append((name, engine))
    first = engines[0][1]

    def workload_for(round_index: int) -> list[WorkloadRequest]:
        # Synthetic prompts are redrawn each round, so no system (and no peer's own
        # prompt cache) reuses an earlier round's KV; file and code prompts repeat.
        seed = spec.seed + round_index if spec.source == "synthetic" else spec.seed
        return build_workload(dataclasses.replace(spec, seed=seed), first.arch.vocab_size,
                              first.tokenizer, first.eos_token_ids)

    skipped = [f"{n} (not installed)" for n in peer_names
               if peer_name(n) not in {p.name for p in peers}]
    results = run_compare(engines, peers, base.model.model, workload_for, levels, args.repeats,
                          skipped=skipped)
    header = {"command": " ".join(sys.argv), "date": datetime.datetime.now(
        datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": _commit(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", **host,
        "model": base.model.model,
        "workload": f"{spec.source}, {spec.num_requests} requests, input {spec.input_len}, "
                    f"output {spec.output_len}, {spec.length_dist} lengths, seed {spec.seed} "
                    "(+ round number for synthetic prompts)",
        "configs": "; ".join(args.configs), "repeats": str(args.repeats)}
    header.update({f"peer {peer.name}": peer.describe() for peer in peers})
    report = write_report(results, args.out_dir, configs[0][0], header, skipped)
    print(report.read_text())
    print(f"wrote {report} and plots in {args.out_dir}")
    return 0


def _engine_option_names() -> set[str]:
    from tokenmill.config import config_fields

    return {f.name for _, f in config_fields()}


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenmill.arguments import add_engine_arguments
    from tokenmill.bench.workload import add_workload_arguments

    parser.add_argument("--configs", nargs="+", required=True,
                        help="'name:opt=val,opt=val' ...; the first is the baseline")
    parser.add_argument("--peers", default="", help="comma-separated: transformers,llamacpp,"
                        "vllm; llama.cpp in another GGUF type: llamacpp:q8_0 (f16, bf16)")
    parser.add_argument("--concurrency", default=None,
                        help="comma-separated in-flight limits, 'all' = no limit (default)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=Path("bench-compare"))
    parser.add_argument("--ceilings", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the host's fp32 GEMM and read-bandwidth ceilings "
                             "before the run and put them in the report (CPU; ~15 s)")
    parser.add_argument("--log-level", default="warning")
    add_workload_arguments(parser, num_requests=16)
    add_engine_arguments(parser)
    parser.set_defaults(func=cmd_bench_compare)
