#!/usr/bin/env bash
# Issue 5's comparison report: tokenmill vs transformers (and llama.cpp when
# `tokenmill bench peers install --peer llamacpp` has built it) on a random
# Qwen2.5-0.5B-shaped model, fp32, 2 threads, on a quiet machine:
#   1. single-stream (and batch 8/32) latency with roofline fractions;
#   2. offline throughput with roofline fractions;
#   3. the same requests through tokenmill and each peer at concurrency 1/8/32
#      (report.md with ratios + latency CDF, throughput-vs-concurrency and TTFT-vs-TPOT plots);
# Everything lands in $OUT (default docs/report-05b).
set -eu
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/report-05b}
MODEL=${MODEL:-$HOME/.cache/tokenmill/models/qwen2.5-0.5b-random}
TM=.venv/bin/tokenmill
mkdir -p "$OUT"
.venv/bin/python -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path; from bench_core import build_model; build_model(Path('$MODEL'))"
ENGINE="--model $MODEL --num-threads 2 --max-model-len 1024"
WORK="--workload synthetic --num-requests 32 --input-len 128 --output-len 32 --workload-seed 0"

echo "=== 1. latency"
$TM bench latency $ENGINE --input-len 128 --output-len 32 --batch-sizes 1,8,32 --repeats 1 \
    --out "$OUT/latency.json" 2>&1 | grep -v "it/s\]\|s/it\]" | tee "$OUT/latency.txt"
echo "=== 2. offline throughput"
$TM bench throughput $ENGINE --workload synthetic --num-requests 32 --input-len 256 \
    --output-len 64 --length-dist uniform --spread 0.5 --workload-seed 0 \
    --out "$OUT/throughput.json" 2>&1 | grep -v "it/s\]\|s/it\]" | tee "$OUT/throughput.txt"
echo "=== 3. compare"
$TM bench compare $ENGINE $WORK --configs "tokenmill:" --peers transformers,llamacpp \
    --concurrency 1,8,32 --repeats 1 --out-dir "$OUT" 2>&1 | grep -v "it/s\]\|s/it\]" \
    | tee "$OUT/compare.txt"
# Serving is measured on pycoder (benchmarks/serve_load_test.sh, docs/BENCHMARKS.md):
# this random model's tokenizer is the 500-token test tokenizer, so most of its
# 151,936 ids decode to no text, and a streaming client timing text deltas sees
# every token arrive at the end.
