"""Memory of a long `mtcli train` run: the child's resident set (VmRSS) over time, and its speed.

Runs ``python -m mtcli.cli train CONFIG --set train.run_dir=RUN --set train.progress=false
[--set ...]`` as a child process in a fresh run directory, with extra environment variables from
``--env NAME=VALUE`` (e.g. ``MTCLI_KEEP_FREED_MEMORY=0`` or ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=64``),
samples the child's ``VmRSS`` from ``/proc`` every ``--every`` seconds, and reads the run's mean
training tokens/s from its summary. The memory figures of a long bf16 run in
docs/performance.md are such runs.

Usage (from the repository root; the recipe's cache must be prepared)::

    python bench/bench_train_memory.py configs/multi30k_en_de.yaml --set train.max_minutes=25
    python bench/bench_train_memory.py configs/multi30k_en_de.yaml --env ONEDNN_PRIMITIVE_CACHE_CAPACITY=64 \\
        --set train.max_steps=1200 --set train.valid_every=100000
    python bench/bench_train_memory.py configs/toy.yaml --set train.max_steps=20 --every 1   # smoke

Results: the samples on stdout (every ``--print-every``-th) and ``bench/results/train_memory_<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from bench_translate_memory import _vm_rss_mb  # noqa: E402  (one /proc reader for both benches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--set", action="append", default=[], help="config override (repeatable)")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the child (repeatable)")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples (default: %(default)s)")
    parser.add_argument("--print-every", type=int, default=6, help="print every Nth sample (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    env = dict(os.environ)
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--env {item!r}: expected NAME=VALUE")
        env[name] = value
    with tempfile.TemporaryDirectory(prefix="train_memory_") as work:
        cmd = [sys.executable, "-m", "mtcli.cli", "train", str(args.config),
               "--set", f"train.run_dir={work}/run", "--set", "train.progress=false"]
        for item in args.set:
            cmd += ["--set", item]
        start = time.monotonic()
        log = Path(work) / "train.out"  # a file, not a pipe: nothing blocks however much it logs
        with open(log, "w", encoding="utf-8") as handle:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
        samples: list[tuple[float, float]] = []
        while proc.poll() is None:
            rss = _vm_rss_mb(proc.pid)
            if rss is not None:
                samples.append((round(time.monotonic() - start, 1), round(rss, 1)))
                if (len(samples) - 1) % args.print_every == 0:
                    print(f"  {samples[-1][0]:8.1f} s  {samples[-1][1]:9.1f} MiB", flush=True)
            time.sleep(args.every)
        output = log.read_text(encoding="utf-8", errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"train failed ({proc.returncode}): {(output.strip().splitlines() or ['?'])[-1]}")
    found = re.search(r"train tokens/s: ([\d,]+)", output)
    tokens_per_s = int(found.group(1).replace(",", "")) if found else None
    result = {"config": str(args.config), "overrides": args.set, "env": args.env,
              "seconds": round(time.monotonic() - start, 1), "train_tokens_per_s": tokens_per_s,
              "peak_sampled_rss_mib": max((rss for _, rss in samples), default=None), "samples": samples}
    print(f"tokens/s {tokens_per_s}, peak sampled RSS {result['peak_sampled_rss_mib']} MiB")
    out = args.output or REPO / "bench" / "results" / f"train_memory_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
