#!/usr/bin/env bash
# The WMT14 base recipe's packed, compiled step against the eager step on token batches, as loss
# curves: the WMT14 base shape and schedule (bf16, Noam with 4,000 warm-up steps, one batch of
# 25,000 tokens an update) on the prepared Multi30k en-de cache, for STEPS steps: eager seed 1;
# packed seed 1 (train.pack_length 128 with train.compile: one batch shape, CUDA graphs); eager
# seed 2 (the seed noise to judge the others against). SPECS="mode:seed:processes ..." picks
# other runs. Modes: eager; packed; compile (compiled token batches); pack (packed, uncompiled);
# random (eager token batches that are random samples of the corpus, as packed batches are, not
# slices of similar lengths: bench/random_batches.py). On a machine with several GPUs it then runs
# eager seed 1 under torchrun on all of them, each with the same 25,000 tokens a step (so the
# update grows with the GPUs), for the target tokens/s per GPU against one GPU's.
# Writes OUT_DIR/gpu_loss_curve_<date>.json with each run's logged training loss, its validation
# loss at the last step, its tokens/s (all processes together) and its tokens/s per process.
#
# Usage (from the repository root, on the GPU machine, with data/prepared/multi30k_en_de;
# DEVICE=cpu and EXTRA="--set model.d_model=64 ..." try it small on a CPU, PROCS=2 with gloo):
#   bash bench/gpu_loss_curve.sh [OUT_DIR] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${1:-bench/results}
STEPS=${2:-250}
DATE=$(date +%Y%m%d)
mkdir -p "$OUT"
RUNS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_loss_curve.XXXXXX")  # the runs' directories, this script's own
trap 'rm -rf "$RUNS"' EXIT  # the curves are in OUT_DIR's JSON by then; the runs' checkpoints go
SET=(--set model.d_model=512 --set model.n_heads=8 --set model.encoder_layers=6 --set model.decoder_layers=6
     --set model.d_ff=2048 --set model.dropout=0.1 --set model.attention_dropout=0.0 --set model.output_vocab=joint
     --set train.rdrop_alpha=0 --set train.weight_decay=0 --set train.precision=bf16 --set train.device="${DEVICE:-cuda}"
     --set train.max_tokens=25000 --set train.update_freq=1 --set train.warmup_steps=4000 --set train.lr_factor=1
     --set train.cooldown_steps=0 --set train.max_steps="$STEPS" --set train.log_every=25
     --set train.valid_every=100000 --set train.valid_bleu=false --set train.num_threads=0 --set train.progress=false ${EXTRA:-})
summarise() {  # rewritten after each run: a run cut short by a time limit leaves the others' curves
    "$PY" - "$OUT/gpu_loss_curve_${DATE}.json" "$@" <<'PY'
import json, re, sys
out = {"runs": []}
for spec in sys.argv[2:]:
    mode, seed, procs, log = spec.split(":", 3)
    text = open(log).read()
    steps = [(int(m[1]), float(m[2]), float(m[3])) for m in
             re.finditer(r"step (\d+) \| epoch \d+ \| loss ([\d.]+) .*? tok/s (\d+)", text)]
    valid = {int(m[1]): float(m[2]) for m in re.finditer(r"valid step (\d+) \| loss ([\d.]+)", text)}
    out["runs"].append({"mode": mode, "seed": int(seed), "processes": int(procs), "step": [s for s, _, _ in steps],
                        "valid_loss": valid,
                        "loss": [l for _, l, _ in steps], "tokens_per_s": [t for _, _, t in steps],
                        "tokens_per_s_per_process": [t / int(procs) for _, _, t in steps]})
    print(mode, seed, f"x{procs}", [(s, l) for s, l, _ in steps][-4:], "tok/s", [t for _, _, t in steps][-3:],
          "valid", valid)
open(sys.argv[1], "w").write(json.dumps(out, indent=1) + "\n")
PY
}
if [ -z "${PROCS:-}" ]; then
    PROCS=$( [ "${DEVICE:-cuda}" = cuda ] && nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 1)
fi
read -r -a specs <<< "${SPECS:-eager:1:1 packed:1:1 eager:2:1}"
[ "$PROCS" -gt 1 ] && specs+=("eager:1:$PROCS")
runs=()
for spec in "${specs[@]}"; do
    IFS=: read -r mode seed procs <<< "$spec"
    dir=$RUNS/curve_${mode}_${seed}_${procs}
    program=(-m mtcli)
    [ "$mode" = random ] && program=(bench/random_batches.py)
    launch=("$PY" "${program[@]}")
    [ "$procs" -gt 1 ] && launch=("$PY" -m torch.distributed.run --standalone --nproc_per_node="$procs" "${program[@]}")
    mode_set=(--set train.compile=false)
    [ "$mode" = compile ] && mode_set=(--set train.compile=true)
    [ "$mode" = packed ] && mode_set=(--set train.compile=true --set train.pack_length=128)
    [ "$mode" = pack ] && mode_set=(--set train.compile=false --set train.pack_length=128)
    "${launch[@]}" train configs/multi30k_en_de.yaml "${SET[@]}" --set train.seed="$seed" "${mode_set[@]}" \
        --set train.run_dir="$dir"
    runs+=("$mode:$seed:$procs:$dir/train.log")
    summarise "${runs[@]}"
done
