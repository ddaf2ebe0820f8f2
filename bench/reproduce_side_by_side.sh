#!/usr/bin/env bash
# Train and score both Multi30k recipes for several seeds side by side, one process per direction
# and seed (on a GPU they share it; on a CPU they would share its cores, so there prefer
# `make reproduce`, which runs them one after another). Each process writes its own results
# directory; merge them into the table afterwards:
#
#   bench/reproduce_side_by_side.sh ../shared/data/multi30k /tmp/m30k 1,2,3 [--set KEY=VALUE ...]
#   mtcli reproduce de_en --merge /tmp/m30k/de_en-seed*/
#   mtcli reproduce en_de --merge /tmp/m30k/en_de-seed*/
#
# Logs go to OUT/<direction>-seed<N>.log; OUT/done lists each process's exit status.
set -uo pipefail
data=$1 out=$2 seeds=${3:-1,2,3}
[[ -d $data ]] || { echo "reproduce_side_by_side.sh: $data: no such directory (the Multi30k text files)" >&2; exit 2; }
shift $(( $# < 3 ? $# : 3 ))
py=${PYTHON:-python}
mkdir -p "$out"
# one prepare per direction first, so the seeds' processes find the cache made
for d in en_de de_en; do
  "$py" -m mtcli prepare "configs/multi30k_$d.yaml" --set "data.source=$data" "$@" >"$out/prepare-$d.log" 2>&1 &
done
wait
declare -A pids
for d in en_de de_en; do
  for s in ${seeds//,/ }; do
    "$py" -m mtcli reproduce "$d" --data "$data" --seeds "$s" --results "$out/$d-seed$s" \
      --readme "$out/$d-seed$s/README.md" "$@" >"$out/$d-seed$s.log" 2>&1 &
    pids[$d-seed$s]=$!
  done
done
failed=0
for run in "${!pids[@]}"; do
  wait "${pids[$run]}"; status=$?
  echo "$run $status" >>"$out/done.tmp"
  if (( status != 0 )); then
    failed=1
    echo "reproduce_side_by_side.sh: $run failed (exit $status): $(tail -n 1 "$out/$run.log")" >&2
  fi
done
mv "$out/done.tmp" "$out/done"
exit "$failed"
