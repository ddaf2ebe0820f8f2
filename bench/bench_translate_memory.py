"""Memory of `mtcli translate` on long inputs: peak RSS must not grow with the number of lines.

`mtcli translate` reads its input a window of lines at a time (``mtcli.infer.translate.DEFAULT_WINDOW``
= 2,000 lines), sorts and batches inside the window, writes each result as soon as the lines
before it are done, and keeps nothing per line afterwards (the output file is written to a
temporary name as it goes and renamed at the end). So its peak RSS should be the model + one
window, whatever the input length.

For each size (default 10,000, 50,000 and 100,000 lines) this script writes a generated input
(toy-vocabulary sentences of 1-30 words, 2% blank lines, seeded), runs
``python -m mtcli.cli translate RUN INPUT -o OUTPUT`` (or stdin to stdout with ``--stdin``) as a
child process, checks that the output has one line per input line, and reads the child's peak
RSS from ``os.wait4`` (``ru_maxrss``, exact, for that child only). A thread also samples the
child's ``VmRSS`` from ``/proc`` to report the RSS half-way through.

What is measured is memory, not decoding speed: by default every sentence decodes at most
``--max-len-b`` (4) tokens (``--set decode.max_len_a=0 decode.max_len_b=4``), so a random model
(which rarely emits ``</s>``) gets through 100,000 lines in minutes on one CPU thread; use
``--max-len-b 0`` to keep the run's own length limits. Model: ``--run-dir`` (a trained run), else
a random model of ``configs/toy.yaml``'s shape (built like the tests' ``tiny_run_dir``).

The bound: peak RSS of the largest input minus peak RSS of the smallest must stay within
``--bound-mb`` (default 32 MiB, against a peak of about 255 MiB for the toy model); the exit
status is 1 when it does not.

Usage (from the repository root)::

    python bench/bench_translate_memory.py                         # 10k, 50k, 100k lines
    python bench/bench_translate_memory.py --lines 1000,2000 --bound-mb 64   # smoke test
    python bench/bench_translate_memory.py --stdin                 # stdin -> stdout

Results: a table on stdout and ``bench/results/translate_memory_<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runs from a checkout without mtcli installed (e.g. a GPU box)
TOY_DIR = REPO / "tests" / "fixtures" / "toy"


def make_input(path: Path, n_lines: int, seed: int) -> int:
    """Write ``n_lines`` generated lines (toy vocabulary, 1-30 words, 2% blank); return bytes."""
    rng = random.Random(seed)
    words = sorted(set((TOY_DIR / "train.src").read_text(encoding="utf-8").split()))
    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(n_lines):
            if rng.random() < 0.02:
                handle.write("\n")
            else:
                handle.write(" ".join(rng.choices(words, k=rng.randint(1, 30))) + "\n")
    return path.stat().st_size


def tiny_run_dir(work: Path) -> Path:
    """A random toy-shaped model in a run directory (the tests' ``build_tiny_run_dir``)."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import build_tiny_run_dir

    return build_tiny_run_dir(work / "tiny_run")


def _vm_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def run_once(args: argparse.Namespace, run_dir: Path, work: Path, n_lines: int) -> dict:
    """Translate ``n_lines`` generated lines in a child process; time it and read its peak RSS."""
    src, out = work / f"in_{n_lines}.txt", work / f"out_{n_lines}.txt"
    size = make_input(src, n_lines, args.seed)
    cmd = [sys.executable, "-m", "mtcli.cli", "translate", str(run_dir), "--beam", str(args.beam),
           "--checkpoint", args.checkpoint]
    if args.max_len_b > 0:
        cmd += ["--set", "decode.max_len_a=0", "--set", f"decode.max_len_b={args.max_len_b}"]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    samples: list[tuple[float, float]] = []
    start = time.perf_counter()
    if args.stdin:
        with open(src, "rb") as inp, open(out, "wb") as outp:
            proc = subprocess.Popen(cmd, stdin=inp, stdout=outp, stderr=subprocess.PIPE, env=env, cwd=REPO)
    else:
        proc = subprocess.Popen([*cmd, str(src), "-o", str(out)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            rss = _vm_rss_mb(proc.pid)
            if rss is not None:
                samples.append((time.perf_counter() - start, rss))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stderr = proc.stderr.read().decode("utf-8", "replace") if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = (stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"translate of {n_lines} lines failed ({proc.returncode}): {tail}")
    with open(out, "rb") as handle:
        out_lines = sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))
    if out_lines != n_lines:
        raise SystemExit(f"{n_lines} input lines gave {out_lines} output lines")
    peak = usage.ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)
    half = [rss for t, rss in samples if t >= seconds / 2]
    for path in (src, out):
        path.unlink()
    return {
        "lines": n_lines,
        "input_mb": round(size / 2**20, 2),
        "seconds": round(seconds, 2),
        "sentences_per_s": round(n_lines / seconds, 1),
        "peak_rss_mb": round(peak, 1),
        "rss_halfway_mb": round(half[0], 1) if half else None,
        "rss_samples": len(samples),
    }


def main(argv: list[str] | None = None) -> int:
    """Run every size, print the table and the bound check, save JSON; 1 if over the bound."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", default="10000,50000,100000", help="comma-separated input sizes")
    parser.add_argument("--run-dir", type=Path, help="a trained run (default: a random toy model)")
    parser.add_argument("--checkpoint", default="best")
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--max-len-b", type=int, default=4,
                        help="decode at most this many tokens a sentence (0: the run's own limits)")
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads of the child")
    parser.add_argument("--stdin", action="store_true", help="stdin -> stdout instead of FILE -o FILE")
    parser.add_argument("--bound-mb", type=float, default=32.0,
                        help="allowed peak-RSS growth from the smallest to the largest input")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    sizes = sorted(int(x) for x in args.lines.split(",") if x.strip())

    with tempfile.TemporaryDirectory(prefix="bench_translate_memory_") as tmp:
        work = Path(tmp)
        run_dir = args.run_dir or tiny_run_dir(work)
        rows = []
        for n in sizes:
            print(f"translating {n:,} lines ...", file=sys.stderr, flush=True)
            rows.append(run_once(args, run_dir, work, n))

    from mtcli.infer.translate import DEFAULT_WINDOW

    mode = "stdin -> stdout" if args.stdin else "FILE -o FILE"
    print(f"\nmtcli translate ({mode}, beam {args.beam}, {args.threads} thread(s), "
          f"model {'random toy' if args.run_dir is None else args.run_dir})\n")
    print("| lines | input MiB | seconds | sent/s | peak RSS MiB | RSS half-way MiB |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        half = "-" if r["rss_halfway_mb"] is None else f"{r['rss_halfway_mb']:.1f}"
        print(f"| {r['lines']:,} | {r['input_mb']:.2f} | {r['seconds']:.1f} | {r['sentences_per_s']:,.0f} "
              f"| {r['peak_rss_mb']:.1f} | {half} |")
    growth = rows[-1]["peak_rss_mb"] - rows[0]["peak_rss_mb"]
    ok = growth <= args.bound_mb
    print(f"\npeak RSS growth from {rows[0]['lines']:,} to {rows[-1]['lines']:,} lines: {growth:+.1f} MiB "
          f"(bound {args.bound_mb:g} MiB): {'OK' if ok else 'OVER THE BOUND'}")
    print(f"stated bound: peak RSS <= {rows[0]['peak_rss_mb'] + args.bound_mb:.0f} MiB for any input "
          f"length (model + one {DEFAULT_WINDOW:,}-line window)")

    results = REPO / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"translate_memory_{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "mode": mode, "beam": args.beam, "threads": args.threads, "max_len_b": args.max_len_b,
        "model": str(args.run_dir) if args.run_dir else "random toy", "rows": rows,
        "growth_mb": round(growth, 1), "bound_mb": args.bound_mb, "ok": ok,
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "cpus": os.cpu_count()},
    }, indent=2) + "\n", encoding="utf-8")
    print(f"saved {out.relative_to(REPO)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
