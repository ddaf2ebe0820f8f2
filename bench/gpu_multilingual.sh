#!/usr/bin/env bash
# The multilingual table's seeds on one lent GPU, side by side: configs/multi30k_multi.yaml
# prepared once, then one `mtcli reproduce-multilingual` process per seed, all at once (the
# recipe's small model leaves a GPU waiting on each process's kernel launches, so the seeds
# share it well). Each writes OUT_DIR/seed<N>/multilingual.json and OUT_DIR/seed<N>.log; add
# them to results/multilingual.json here afterwards:
#
#   mtcli reproduce-multilingual --merge OUT_DIR/seed*/
#
# Usage (from the repository root, on the GPU machine, which reaches no network: carry
# data/raw/multi30k, a copy of ../shared/data/multi30k, where mtcli looks for a downloaded corpus):
#   bash bench/gpu_multilingual.sh OUT_DIR [SEEDS]      (SEEDS: 1,2,3 by default)
# EXTRA="--set KEY=VALUE ..." changes the recipe for every seed (a small CPU trial, say). Decoding
# (choosing the average and each direction's length penalty on val, then test) takes batches of
# 16,384 tokens, which a GPU decodes at twice the speed of the recipe's 4,096. A seed that fails is
# tried once more without compiling, resuming from its last checkpoint.
# Three seeds may take longer than one 10-minute device call: bench/gpu_detached.sh runs this
# script across two calls (its header has the commands).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:?usage: bench/gpu_multilingual.sh OUT_DIR [SEEDS]}
SEEDS=${2:-1,2,3}
RECIPE=configs/multi30k_multi.yaml
GPU_DECODE=(--set decode.max_tokens=16384)
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
# While the corpus is prepared: does the recipe's replayed step drop out anew at each replay (the
# test needs a GPU)? If it does not, the seeds train uncompiled rather than with a frozen mask.
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/data/test_packing.py -k cuda_graphs > "$OUT/dropout_check.log" 2>&1 &
check=$!
# Preparing takes seconds; the limit keeps a stalled one from spending the lent GPU's time.
# shellcheck disable=SC2086  # EXTRA is a list of arguments
timeout 180 "$PY" -m mtcli prepare "$RECIPE" ${EXTRA:-} > "$OUT/prepare.log" 2>&1 || { tail -n 5 "$OUT/prepare.log"; exit 1; }
wait "$check"
if grep -q " passed" "$OUT/dropout_check.log"; then
    echo "dropout under CUDA graphs: checked"
elif grep -q " failed" "$OUT/dropout_check.log"; then
    echo "dropout under CUDA graphs: FAILED its check ($OUT/dropout_check.log): the seeds train uncompiled"
    EXTRA="${EXTRA:-} --set train.compile=false"
else
    echo "dropout under CUDA graphs: not checked (no GPU, or cut short: $OUT/dropout_check.log)"
fi
declare -A pids
for seed in ${SEEDS//,/ }; do
    mkdir -p "$OUT/seed$seed"
    # shellcheck disable=SC2086
    args=(-m mtcli reproduce-multilingual --config "$RECIPE" --seeds "$seed" --results "$OUT/seed$seed"
          --readme "$OUT/seed$seed/README.md" "${GPU_DECODE[@]}" ${EXTRA:-})
    { "$PY" "${args[@]}" || { echo "seed $seed failed: again without compiling"
                              "$PY" "${args[@]}" --set train.compile=false; }; } > "$OUT/seed$seed.log" 2>&1 &
    pids[$seed]=$!
done
status=0
for seed in "${!pids[@]}"; do
    if wait "${pids[$seed]}"; then echo "seed $seed: done"; else status=1; echo "seed $seed: failed"; tail -n 5 "$OUT/seed$seed.log"; fi
done
rm -f "$OUT"/seed*/multilingual.md  # the table is made by --merge; fewer files to bring back
exit $status
