#!/usr/bin/env bash
# Run a GPU job that may outlast one device call (10 minutes at most): the first call starts the
# job in a session of its own, which the device machine lets run on after the call returns, and
# waits for it up to SECONDS; a second call with the same WORK_DIR, made while the machine is
# still warm (30 s after a call), only waits again. While it waits, and once more at the end, it
# packs what the job has written so far (its logs and JSON, not its checkpoints) into
# OUT_DIR/work.tgz, replaced whole each time, so a call cut short by the session's device time
# still brings back the last archive; at the end it prints the log's tail. Give a second call
# SECONDS of what the session's device time has left (status's budget_left_s) less a minute.
#
# Usage (from the repository root, on the GPU machine):
#   bash bench/gpu_detached.sh WORK_DIR OUT_DIR SECONDS COMMAND [ARG...]
# e.g. the multilingual seeds over two calls:
#   bash bench/gpu_detached.sh /tmp/ml $OUT 540 bash bench/gpu_multilingual.sh /tmp/ml/out 1,2,3
#   bash bench/gpu_detached.sh /tmp/ml $OUT LEFT bash bench/gpu_multilingual.sh /tmp/ml/out 1,2,3
# (LEFT: the device time left, less a minute)
# Here: tar xzf /work/.device/N/work.tgz -C SOMEWHERE. The job's exit status is WORK_DIR/rc.
set -uo pipefail
WORK=${1:?usage: bench/gpu_detached.sh WORK_DIR OUT_DIR SECONDS COMMAND [ARG...]}
OUT=${2:?usage: bench/gpu_detached.sh WORK_DIR OUT_DIR SECONDS COMMAND [ARG...]}
SECONDS_MAX=${3:?usage: bench/gpu_detached.sh WORK_DIR OUT_DIR SECONDS COMMAND [ARG...]}
shift 3
[ $# -gt 0 ] || { echo "gpu_detached.sh: no command given" >&2; exit 2; }
mkdir -p "$WORK" "$OUT"
if [ ! -e "$WORK/started" ]; then
    date -u +%FT%TZ > "$WORK/started"
    # setsid: the device machine ends a call's processes when it returns, except a new session's
    setsid bash -c '"$@" > "$0/job.log" 2>&1; echo $? > "$0/rc"' "$WORK" "$@" < /dev/null &
    echo "started: $*"
else
    echo "already started at $(cat "$WORK/started"): waiting again"
fi
# the job's logs and JSON so far into OUT_DIR/work.tgz, through a temporary name: what a cut
# call brings back is the last whole archive
pack() {
    (cd "$WORK" && find . -maxdepth 3 -type f \( -name '*.json' -o -name '*.log' -o -name '*.md' -o -name '*.txt' \
        -o -name rc -o -name started \) -size -8M -print0 | tar czf "$OUT/work.tgz.part" --null -T -) \
        && mv -f "$OUT/work.tgz.part" "$OUT/work.tgz"
}
waited=0
while [ ! -e "$WORK/rc" ] && [ "$waited" -lt "$SECONDS_MAX" ]; do
    sleep 5
    waited=$((waited + 5))
    if [ $((waited % 30)) -eq 0 ]; then pack; fi
done
tail -n 20 "$WORK/job.log" 2>/dev/null
pack
if [ -e "$WORK/rc" ]; then
    echo "job finished: exit status $(cat "$WORK/rc") after waiting ${waited}s"
    exit "$(cat "$WORK/rc")"
fi
echo "job still running after ${waited}s: call again with the same WORK_DIR to wait on"
exit 3
