#!/usr/bin/env bash
# Train the shared tokenizer and the three default models, one after another, then
# write their model cards. Run from the repository root; ~100 min on 2 CPU cores.
# Each run has a wall-clock budget (minutes) so a busy machine costs tokens, not time.
set -euo pipefail
PY=${PY:-python}
declare -A MINUTES=([pycoder]=45 [pycoder-draft]=10 [pycoder-moe]=22)
$PY -m tokenmill.train tokenizer --out models/pycoder
for preset in pycoder pycoder-draft pycoder-moe; do
    echo "=== $preset start $(date -u +%H:%M:%S)"
    $PY -m tokenmill.train model --preset "$preset" --tokenizer models/pycoder \
        --out "models/$preset" --max-minutes "${MINUTES[$preset]}"
    $PY -m tokenmill.train card --model "models/$preset"
    echo "=== $preset done $(date -u +%H:%M:%S)"
done
# Second stage for pycoder: continue from its weights with a new data seed and a
# lower peak LR (the shared machine gave the first stage fewer tokens than planned).
echo "=== pycoder stage 2 start $(date -u +%H:%M:%S)"
$PY -m tokenmill.train model --preset pycoder --tokenizer models/pycoder \
    --out models/pycoder --init-from models/pycoder --peak-lr 1e-3 --warmup-steps 20 \
    --seed 1 --final-steps 30 --max-minutes 18
$PY -m tokenmill.train card --model models/pycoder
echo "=== pycoder stage 2 done $(date -u +%H:%M:%S)"
