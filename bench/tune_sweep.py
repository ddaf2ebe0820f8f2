"""A tuning sweep: several ``mtcli reproduce DIRECTION --valid-only`` runs side by side.

Each variant is one tuning run (train, then choose the averaging window and the length penalty
on val; the test split is never decoded) with its own run directory ``OUT/NAME`` and overrides.
Several run at once (``--jobs``), which pays on a GPU, where one small model leaves the device
mostly idle; on the 2-core CPU use ``--jobs 1``. Variants whose ``data.*`` overrides change the
prepared cache are prepared first, one at a time, so no two jobs build the same cache.

The point on a GPU: the recipes budget steps, so a GPU runs the same tuning run as the CPU, and
many settings can be compared on val in minutes (``--common`` shortens them all alike).

Usage (from the repository root)::

    python bench/tune_sweep.py en_de --data ../shared/data/multi30k --out data/sweeps/s1 --jobs 6 \\
        --common train.max_steps=4200 --common train.cooldown_steps=1050 \\
        --variant base= --variant ls02=train.label_smoothing=0.2 \\
        --variant v6k=data.vocab_size=6000,data.name=multi30k_en_de_v6k

Writes ``OUT/NAME.out`` (each job's output), ``OUT/summary.json`` and ``OUT/summary.md`` (val
BLEU chosen, greedy val BLEU by step, steps, tokens/s and wall-clock per variant).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VALID_LINE = re.compile(r"valid step (\d+) \| loss (\S+) .*\| bleu (\S+)")


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME=key=value,key=value`` (or ``NAME=`` for none) -> (name, overrides)."""
    name, _, rest = text.partition("=")
    if not name or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SystemExit(f"tune_sweep: bad variant name in {text!r} (letters, digits, _ . - only)")
    return name, [item for item in rest.split(",") if item]


def prepare_all(recipe: str, jobs: list[dict[str, Any]]) -> None:
    """Build each distinct prepared cache once, before any job starts."""
    from mtcli.config import load_config
    from mtcli.data.prepare import prepare

    seen: set[str] = set()
    for job in jobs:
        config = load_config(recipe, job["overrides"])
        key = str(config.data.prepared_path())
        if key not in seen:
            seen.add(key)
            prepare(config)


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, valid loss, greedy valid BLEU) from the run's ``train.log``."""
    log = run_dir / "train.log"
    if not log.exists():
        return []
    return [(int(m.group(1)), float(m.group(2)), float(m.group(3)))
            for m in VALID_LINE.finditer(log.read_text(encoding="utf-8"))]


def summarise(out: Path, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per variant from its ``tuning.json`` and ``train.log``; written as JSON and markdown."""
    rows: dict[str, Any] = {}
    for job in jobs:
        run_dir = out / job["name"]
        tuning = run_dir / "tuning.json"
        row = json.loads(tuning.read_text(encoding="utf-8")) if tuning.exists() else {}
        row.update(name=job["name"], variant=job["variant"], returncode=job.get("returncode"),
                   wall_s=round(job.get("wall_s", 0.0), 1), curve=curve(run_dir))
        rows[job["name"]] = row
    lines = ["| variant | overrides | steps | final valid loss | best greedy BLEU | chosen avg / alpha "
             "| val BLEU (beam) | wall s |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        c = r["curve"]
        lines.append(
            f"| {name} | {' '.join(r['variant']) or '-'} | {c[-1][0] if c else '-'} "
            f"| {c[-1][1] if c else '-'} | {max((b for _, _, b in c), default='-')} "
            f"| {r.get('average_last', '-')} / {r.get('length_penalty', '-')} "
            f"| {r.get('valid_bleu', 'failed (rc ' + str(r['returncode']) + ')')} | {r['wall_s']} |")
    from mtcli.fileio import atomic_write

    with atomic_write(out / "summary.json") as handle:
        handle.write(json.dumps(rows, indent=1) + "\n")
    with atomic_write(out / "summary.md") as handle:
        handle.write("\n".join(lines) + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the variants, at most ``--jobs`` at a time, and write the summary."""
    from mtcli.reproduce import RECIPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("direction", choices=sorted(RECIPES))
    parser.add_argument("--data", required=True, help="directory of <split>.<lang> files")
    parser.add_argument("--out", type=Path, required=True, help="root of the variants' run dirs")
    parser.add_argument("--jobs", type=int, default=1, help="variants at a time")
    parser.add_argument("--common", action="append", default=[], help="override for every variant")
    parser.add_argument("--variant", action="append", default=[], required=True,
                        help="NAME=key=value,key=value (NAME= for the recipe as it is)")
    parser.add_argument("--deadline-s", type=float, default=0.0,
                        help="stop (SIGTERM) the jobs still running after this many seconds (0: none)")
    args = parser.parse_args(argv)

    recipe = RECIPES[args.direction][0]
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = []
    for text in args.variant:
        name, variant = parse_variant(text)
        overrides = [f"data.source={args.data}", *args.common, *variant,
                     f"train.run_dir={args.out / name}", "train.progress=false"]
        jobs.append({"name": name, "variant": variant, "overrides": overrides})
    prepare_all(recipe, jobs)

    start = time.monotonic()
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < args.jobs:
            job = pending.pop(0)
            cmd = [sys.executable, "-m", "mtcli", "reproduce", args.direction, "--valid-only"]
            for item in job["overrides"]:
                cmd += ["--set", item]
            job["log"] = open(args.out / f"{job['name']}.out", "w", encoding="utf-8")  # noqa: SIM115
            job["proc"] = subprocess.Popen(cmd, cwd=REPO, stdout=job["log"], stderr=subprocess.STDOUT,
                                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
            job["start"] = time.monotonic()
            running.append(job)
            print(f"started {job['name']}: {' '.join(job['variant']) or '(recipe)'}", flush=True)
        time.sleep(2)
        if args.deadline_s and time.monotonic() - start > args.deadline_s:
            pending.clear()
            for job in running:
                job["proc"].terminate()
        for job in list(running):
            if job["proc"].poll() is not None:
                job["returncode"] = job["proc"].returncode
                job["wall_s"] = time.monotonic() - job["start"]
                job["log"].close()
                running.remove(job)
                print(f"finished {job['name']} (rc {job['returncode']}, {job['wall_s']:.0f} s)", flush=True)
    summarise(args.out, jobs)
    print((args.out / "summary.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
