"""How prepare and train scale with the corpus: 29k (Multi30k) to 4.5M pairs (WMT14 size), one run.

For each size (``--sizes``, default 500000,1500000,4500000; Multi30k's own 29k pairs come
first) it builds the corpus with bench/make_wmt_corpus.py (every form, or ``--forms``), then
measures, each in a fresh process:

* ``prepare`` with the WMT14 base recipe's data settings (bench/bench_prepare.py --floor): wall
  time per stage beside its floor, peak RSS, the no-op re-run, for every source form;
* ``train`` (bench/bench_train_scale.py) in the WMT14 base shape and in the Multi30k recipe's
  shape on that cache: command to first step, memory by component, tokens/s over ``--steps``
  steps (update_freq 1 on a CPU), the epoch boundary; exact resume at the largest size (in the
  Multi30k shape, whose steps take seconds).

Prints one table per part and writes ``bench/results/scale_<time>.json``. On a 2-core CPU a
prepare with its floors takes about 1.5 minutes per 0.5M pairs and form, and a WMT14-base step
about a minute, so the full table takes hours: ``--sizes``, ``--forms`` and ``--steps`` cut it.

Usage::

    python bench/bench_scale.py --work /tmp/scale                         # the full table
    python bench/bench_scale.py --work /tmp/scale --sizes 20000 --forms text --steps 3   # a smoke run
    python bench/bench_scale.py --work /tmp/scale --forms text,parquet,dataset --parts prepare
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
BASE = REPO / "configs" / "wmt14_en_de_base.yaml"
SMALL = REPO / "configs" / "multi30k_en_de.yaml"
FORMS = ("text", "gz", "parquet", "dataset")


def run_json(args: list[str], out: Path) -> dict:
    """Run a bench script that writes JSON to ``out``; its figures (or the error)."""
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    if result.returncode != 0 or not out.is_file():
        return {"error": (result.stderr or result.stdout).strip().splitlines()[-1:]}
    return json.loads(out.read_text())


def prepare_row(source: Path, work: Path, name: str) -> dict:
    out = work / f"prepare_{name}.json"
    return run_json([str(BENCH / "bench_prepare.py"), str(BASE), "--floor", "--json", str(out),
                     "--set", f"data.source={source}", "--set", "data.hub_config=null",
                     "--set", "data.num_workers=2"], out)


def train_row(config: Path, source: Path, cache: Path, steps: int, resume: int) -> dict:
    """bench_train_scale.py on ``cache`` (prepared first, with the WMT14 base data settings)."""
    data = ["--set", f"data.source={source}", "--set", "data.hub_config=null", "--set",
            f"data.prepared_dir={cache}", "--set", "data.name=scale", "--set", "data.num_workers=2"]
    if not (cache / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "mtcli.cli", "prepare", str(BASE), *data], check=True,
                       capture_output=True)
    shape = [] if config == BASE else [  # the Multi30k model on the WMT data settings' cache
        "--set", "data.valid_split=validation", "--set", "data.test_splits=[test]",
        "--set", "data.vocab_size=37000", "--set", "data.spm_model_type=bpe", "--set", "data.dedup=true",
        "--set", "model.output_vocab=joint"]
    before = set(BENCH.glob("results/train_scale_*.json"))
    args = [str(BENCH / "bench_train_scale.py"), str(config), *data, *shape, "--steps", str(steps),
            "--set", "train.update_freq=1", "--set", "train.device=cpu", "--set", "train.precision=auto"]
    if resume:
        args += ["--resume-steps", str(resume)]
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    new = sorted(set(BENCH.glob("results/train_scale_*.json")) - before)
    if result.returncode not in (0, 1) or not new:
        return {"error": result.stderr.strip().splitlines()[-1:]}
    figures = json.loads(new[-1].read_text())
    new[-1].unlink()
    return figures


def _against(seconds: float, floor: float | None) -> str:
    """``seconds (floor, ratio)``, or the seconds alone where there is no floor."""
    if floor is None:
        return f"{seconds:.1f}"
    return f"{seconds:.1f} ({floor:.1f}, {seconds / max(floor, 1e-9):.2f}x)"


def prepare_cells(r: dict) -> list[str]:
    floors = r["floors"]
    stages = [_against(r["stages"][k], floors.get(k)) for k in ("read+clean", "spm train", "encode")]
    written = floors.get("read+clean, text written")
    return [f"{r['seconds']:.1f}", *stages,
            f"{r['stages']['read+clean'] / written:.2f}x" if written else "-",
            _against(r["write_cpu"], floors.get("write")),
            f"{r['peak_rss_mb']:.0f} / {r['peak_rss_worker_mb']:.0f}", f"{r['noop_seconds']:.2f}"]


def train_cells(r: dict) -> list[str]:
    return [f"{r['command_to_first_step_s']:.1f}", f"{r['corpus_mb']:.0f}", f"{r['model_mb']:.0f}",
            f"{r['optimizer_mb']:.0f}", f"{r['peak_rss_mb']:.0f}", f"{r['tokens_per_s']:.0f}",
            f"{r['epoch_boundary_s']:.2f}", str(r.get("exact_resume", "–"))]


def print_table(header: list[str], rows: dict, cells) -> None:
    """A markdown table: one row per measurement, or its error."""
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, r in rows.items():
        print(f"| {name} | error: {r['error']} |" if "error" in r else f"| {name} | {' | '.join(cells(r))} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch directory (tens of GB at 4.5M)")
    parser.add_argument("--sizes", default="500000,1500000,4500000")
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--steps", type=int, default=5,
                        help="train steps per measurement (a base-shape step takes about a minute on 2 CPU cores)")
    parser.add_argument("--resume-steps", type=int, default=5, help="exact-resume check at the largest size")
    parser.add_argument("--parts", default="prepare,train", help="which tables: prepare, train or both")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    sizes = [int(s) for s in args.sizes.split(",") if s]
    forms = [f for f in args.forms.split(",") if f]
    args.work.mkdir(parents=True, exist_ok=True)
    multi30k = REPO.parent / "shared" / "data" / "multi30k"
    rows: dict = {"prepare": {}, "train": {}}
    rows["prepare"]["29000 text (Multi30k)"] = run_json(
        [str(BENCH / "bench_prepare.py"), str(SMALL), "--floor", "--json", str(args.work / "p29k.json")],
        args.work / "p29k.json") if multi30k.is_dir() else {"error": "no ../shared/data/multi30k"}
    for size in sizes:
        corpus = args.work / f"corpus_{size}"
        if not (corpus / "text" / "train.en").is_file():
            subprocess.run([sys.executable, str(BENCH / "make_wmt_corpus.py"), str(corpus), "--pairs", str(size),
                            "--forms", ",".join(dict.fromkeys(["text", *forms]))], check=True)
        for form in forms if "prepare" in parts else ():
            rows["prepare"][f"{size} {form}"] = prepare_row(corpus / form, args.work, f"{size}_{form}")
            print(json.dumps({f"prepare {size} {form}": rows["prepare"][f"{size} {form}"]}), flush=True)
        for label, config in (("base", BASE), ("multi30k shape", SMALL)) if "train" in parts else ():
            # exact resume at the largest size, in the cheap shape: the corpus-sized state it checks
            # (the data order and the position in the epoch) is the same in both shapes
            resume = args.resume_steps if size == sizes[-1] and label != "base" else 0
            rows["train"][f"{size} {label}"] = train_row(config, corpus / "text", args.work / f"cache_{size}",
                                                         args.steps, resume)
            print(json.dumps({f"train {size} {label}": rows["train"][f"{size} {label}"]}), flush=True)
    print_table(["pairs form", "prepare s", "read+clean (floor: a read)", "SentencePiece (floor)", "encode (floor)",
                 "read+clean against a read and a copy of the cleaned text", "write, CPU s (floor)",
                 "peak RSS MB main / worker", "no-op s"], rows["prepare"], prepare_cells)
    print_table(["pairs shape", "command to first step s", "corpus MB", "model MB", "optimizer MB",
                 "peak RSS MB", "tok/s", "epoch boundary s", "exact resume"], rows["train"], train_cells)
    out = BENCH / "results" / f"scale_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
