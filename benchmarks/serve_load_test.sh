#!/usr/bin/env bash
# Serving load test on 127.0.0.1: starts tokenmill serve (pycoder), runs
# tokenmill bench serve at fixed concurrency 1/8/32 and Poisson rates 4/8/16 req/s,
# writes one JSON per run under $OUT (default /tmp/serve_bench), stops the server.
set -u
cd "$(dirname "$0")/.."
PORT=8765
mkdir -p "${OUT:-/tmp/serve_bench}"
.venv/bin/tokenmill serve --port $PORT --num-threads 2 --log-level warning > "${OUT:-/tmp/serve_bench}/server.log" 2>&1 &
SERVER=$!
for i in $(seq 1 60); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
COMMON="--base-url http://127.0.0.1:$PORT --tokenizer models/pycoder --workload code --num-requests 48 --input-len 256 --output-len 64 --length-dist uniform --spread 0.5 --warmup 2 --slo-ttft 0.5 --slo-tpot 0.05"
for c in 1 8 32; do
  echo "=== concurrency $c"
  .venv/bin/tokenmill bench serve $COMMON --concurrency $c --out "${OUT:-/tmp/serve_bench}"/c$c.json 2>&1 | grep -v "it/s\]" | tail -25
done
for r in 4 8 16; do
  echo "=== poisson rate $r"
  .venv/bin/tokenmill bench serve $COMMON --request-rate $r --out "${OUT:-/tmp/serve_bench}"/r$r.json 2>&1 | grep -v "it/s\]" | tail -25
done
kill -TERM $SERVER; wait $SERVER; echo "server exit $?"
