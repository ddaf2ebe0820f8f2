"""Memory of a long-running CPU decoder (a server, a ``Translator`` in a user's process) over calls
of varied size: resident memory should level off, not grow with every new batch shape.

The torch engine decodes on a CPU with weights prepacked for oneDNN (:mod:`mtcli.infer.packed`),
whose kernels are built, and cached, per product shape. A product's row count is the beams of the
sentences still live, or a batch's source tokens, so every call makes new ones; the packed
products round their rows up to a few sizes (:func:`mtcli.infer.packed.padded_rows`) to bound
them. This script measures that bound: each variant runs in its own subprocess, loads one
``Translator`` and translates ``--calls`` seeded random samples of 1 to ``--max-lines`` Multi30k
test sentences, and reports its RSS above the first call's every ``--every`` calls, and the time.

Variants:

- ``padded``: as mtcli decodes;
- ``exact``: each product at its own row count (``padded_rows`` replaced by the identity), as
  before the padding;
- ``--commands``: both as the decoding commands run them (glibc keeping freed memory and
  oneDNN's kernel cache capped at 256 entries, :mod:`mtcli.allocator`) rather than as the Python
  API does (neither);
- ``--speed ROUNDS``: no memory, but the padding's cost in sentences/s (:func:`speed`), a process
  per way and round.

Model: a random model of the Multi30k recipe's shape (``bench/bench_decode.py``'s), which decodes
exactly ``--length`` tokens a sentence (a random model rarely ends one).

Usage (from the repository root)::

    python bench/bench_decode_memory.py                       # padded and exact, 200 calls each
    python bench/bench_decode_memory.py --commands            # as translate/evaluate/serve run
    python bench/bench_decode_memory.py --commands --int8 --variants padded   # int8 weights
    python bench/bench_decode_memory.py --calls 20 --every 10 # smoke
    python bench/bench_decode_memory.py --speed 4             # the padding's cost in sentences/s

Results: a table on stdout and ``bench/results/decode_memory_<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
TEST = REPO.parent / "shared" / "data" / "multi30k" / "test_2016_flickr.de"


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) / 1024


def _set_up(job: dict, commands: bool, exact: bool) -> list[str]:
    """This process as the job asks (``commands``: keep freed memory and cap oneDNN's cache, as
    the decoding commands do; ``exact``: no padded rows); the input's lines."""
    import torch

    import mtcli.infer.packed as packed

    if commands:
        from mtcli.allocator import bound_onednn_cache, keep_freed_memory

        keep_freed_memory()
        bound_onednn_cache()
    if exact:
        packed.padded_rows = lambda n: n
    torch.set_num_threads(job["threads"])
    return Path(job["input"]).read_text(encoding="utf-8").splitlines()


def worker(job: dict) -> dict:
    """Translate the job's calls in this process; RSS above the first call every ``every`` calls."""
    from mtcli import Translator

    lines = _set_up(job, job["commands"], job["variant"] == "exact")
    translator = Translator.from_run(job["run_dir"], device="cpu", max_len_a=0, max_len_b=job["length"],
                                     bf16=job["bf16"], int8=job.get("int8", False))
    translator.translate(lines[:5])
    first, start, rng, points = _rss_mb(), time.perf_counter(), random.Random(job["seed"]), []
    for call in range(1, job["calls"] + 1):
        translator.translate(rng.sample(lines, rng.randrange(1, job["max_lines"] + 1)))
        if call % job["every"] == 0:
            points.append({"calls": call, "rss_growth_mb": round(_rss_mb() - first, 1),
                           "seconds": round(time.perf_counter() - start, 1)})
    return {"first_call_rss_mb": round(first, 1), "points": points}


def speed(job: dict) -> dict:
    """Sentences/s of the Multi30k test set, beam 5 and greedy, in this process, after one untimed
    pass of each: each product at its own row count (``job["way"]`` ``exact``) or padded. Each
    sentence decodes as many tokens as its source has (``max_len_a`` 1), so rows drop out of a
    batch as its shorter sentences end, as they do with a trained model."""
    from mtcli import Translator

    lines = _set_up(job, True, job["way"] == "exact")
    translator = Translator.from_run(job["run_dir"], device="cpu", max_len_a=1.0, max_len_b=0)
    out = {}
    for beam in (5, 1):
        translator.translate(lines, beam=beam)
        start = time.perf_counter()
        translator.translate(lines, beam=beam)
        out[f"beam{beam}"] = len(lines) / (time.perf_counter() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run each variant in a subprocess, print the table, save the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--max-lines", type=int, default=100, help="most sentences a call")
    parser.add_argument("--length", type=int, default=24, help="tokens decoded a sentence")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--commands", action="store_true",
                        help="keep freed memory and cap oneDNN's cache, as the decoding commands do")
    parser.add_argument("--bf16", action="store_true", help="decode in bf16 (decode.bf16; a CPU with bf16 units)")
    parser.add_argument("--int8", action="store_true",
                        help="decode with int8 weights (decode.int8: mtcli.infer.quantize's products)")
    parser.add_argument("--variants", nargs="*", default=["padded", "exact"], choices=["padded", "exact"])
    parser.add_argument("--speed", type=int, default=0, metavar="ROUNDS",
                        help="instead: sentences/s padded and exact, alternated for ROUNDS rounds (the median)")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(speed(job) if "way" in job else worker(job)))
        return 0
    if not TEST.is_file():
        print(f"{TEST} not found: this bench decodes the Multi30k test sentences", file=sys.stderr)
        return 2

    import bench_decode

    from mtcli.device import cpu_info

    run_dir = bench_decode._random_run_dir(Path(tempfile.mkdtemp(prefix="bench_decode_memory_")), None, seed=1)
    name, flags = cpu_info()
    machine = {"threads": args.threads, "cpu": name,
               "cpu_flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_tile"})}
    rows = []
    if args.speed:  # a process per way and round, the ways alternated (a shared VM's speed drifts)
        import statistics

        runs: dict[str, list[float]] = {}
        for _ in range(args.speed):
            for way in ("exact", "padded"):
                job = {"run_dir": str(run_dir), "input": str(TEST), "threads": args.threads, "way": way}
                out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True,
                                     text=True, check=True)
                for search, value in json.loads(out.stdout.strip().splitlines()[-1]).items():
                    runs.setdefault(f"{search}-{way}", []).append(round(value, 1))
        rows.append({"variant": "speed", "sentences_per_s": {k: round(statistics.median(v), 1) for k, v in runs.items()},
                     "rounds": runs})
        print("sentences/s (median of the rounds):", rows[-1]["sentences_per_s"])
    for variant in args.variants if not args.speed else []:
        job = {"variant": variant, "commands": args.commands, "run_dir": str(run_dir), "input": str(TEST),
               "calls": args.calls, "every": args.every, "max_lines": args.max_lines, "length": args.length,
               "threads": args.threads, "seed": 0, "bf16": args.bf16, "int8": args.int8}
        out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True,
                             text=True, check=True)
        rows.append({"variant": variant, **json.loads(out.stdout.strip().splitlines()[-1])})
        print(f"{variant}: RSS over the first call, MB, by calls: "
              + ", ".join(f"{p['calls']}: {p['rss_growth_mb']:+.0f} ({p['seconds']:.0f} s)" for p in rows[-1]["points"]),
              flush=True)
    if args.speed:  # (the speed worker runs as the commands do, on the whole test set)
        result = {"commands": True, "bf16": False, **machine, "rounds": args.speed, "sentences": "all",
                  "length": "the source's", "rows": rows}
    else:
        result = {"commands": args.commands, "bf16": args.bf16, "int8": args.int8, **machine, "calls": args.calls,
                  "max_lines": args.max_lines, "length": args.length, "rows": rows}
    path = args.output or REPO / "bench" / "results" / f"decode_memory_{time.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
