"""Cleaning the training split in worker processes against one process: time, peak RSS, and
whether the cleaned files are the same.

Runs each mode in its own process (so peak RSS is that mode's) on one source, with the WMT14
base recipe's cleaning settings (max_length 250, ratio 3, dedup), and prints the seconds, the
counts, the peak RSS and a sha256 prefix of each cleaned side.

Usage (from the repository root)::

    python bench/bench_clean.py /tmp/scale/corpus_4500000/text              # 2 workers, then 1 process
    python bench/bench_clean.py /tmp/scale/corpus_4500000/parquet --workers 4
    python bench/bench_clean.py /tmp/wmt45/tsv                                 # train.en-de.tsv
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _sha(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()[:16]


def measure(source_dir: str, src: str, tgt: str, split: str, workers: int) -> dict:
    """Clean ``split`` of the source with ``workers`` processes (1: the one-process cleaner)."""
    from mtcli.data.cleaning import PairCleaner, clean_text_blocks, clean_text_files
    from mtcli.data.sources import open_source

    source = open_source(source_dir, src, tgt)
    cleaner = PairCleaner(max_length=250, max_ratio=3.0, dedup=True)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        out_src, out_tgt = Path(tmp) / "clean.src", Path(tmp) / "clean.tgt"
        start = time.perf_counter()
        files = source.plain_files(split)
        if workers == 1:
            with open(out_src, "w", encoding="utf-8") as src_out, open(out_tgt, "w", encoding="utf-8") as tgt_out:
                for src_line, tgt_line in cleaner(source.pairs(split)):
                    src_out.write(src_line + "\n")
                    tgt_out.write(tgt_line + "\n")
        elif files is not None:
            clean_text_files(*files, out_src, out_tgt, cleaner, workers)
        else:  # as prepare does it: workers read parquet's row groups themselves (a .tsv: blocks made here)
            readers = source.block_readers(split)
            clean_text_blocks(source.text_blocks(split) if readers is None else readers, out_src, out_tgt,
                              cleaner, workers)
        seconds = time.perf_counter() - start
        return {"workers": workers, "seconds": round(seconds, 2), "counts": cleaner.counts.to_dict(),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                "sha256": [_sha(out_src), _sha(out_tgt)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a text (a file a side, or .tsv), parquet or save_to_disk directory")
    parser.add_argument("--langs", default="en,de")
    parser.add_argument("--split", default="train")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    src, tgt = args.langs.split(",")
    if args.one:
        print(json.dumps(measure(args.source, src, tgt, args.split, args.one)))
        return 0
    rows = []
    for workers in (args.workers, 1):
        result = subprocess.run([sys.executable, __file__, args.source, "--langs", args.langs, "--split",
                                 args.split, "--one", str(workers)], capture_output=True, text=True, check=True)
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    same = rows[0]["sha256"] == rows[1]["sha256"] and rows[0]["counts"] == rows[1]["counts"]
    print(f"{args.workers} workers: {rows[0]['seconds']} s, one process: {rows[1]['seconds']} s "
          f"({rows[1]['seconds'] / rows[0]['seconds']:.2f}x); same files and counts: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
