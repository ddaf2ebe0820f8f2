"""Scoring a large test set: seconds, lines/s and peak RSS of :func:`mtcli.metrics.score`.

Scores ``--repeat`` copies of a reference file against hypotheses made from it (each line's words
in reverse order, so every n-gram order has matches and misses), in a child process per run so
that the peak RSS is the scoring's own. Prints one JSON object: the lines, the scores (for
comparing two versions of the code: they must be equal) and, per run, seconds and peak RSS.

Usage (from the repository root)::

    python bench/bench_score.py ../shared/data/wmt-news-en-de/train.de --repeat 8
    python bench/bench_score.py ../shared/data/wmt-news-en-de/train.de --repeat 8 --metrics bleu chrf ter
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(path: str, repeat: int, metrics: list[str]) -> dict:
    """Score ``repeat`` copies of ``path`` in this process; the scores, seconds and peak RSS."""
    from mtcli.metrics import score

    with open(path, encoding="utf-8") as handle:
        references = handle.read().splitlines() * repeat
    hypotheses = [" ".join(reversed(line.split())) for line in references]
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    result = score(hypotheses, references, metrics=metrics)
    seconds = time.perf_counter() - start
    return {"lines": len(references), "seconds": round(seconds, 2),
            "lines_per_s": round(len(references) / seconds),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "rss_after_loading_mb": round(loaded / 1024),
            "scores": {name: round(result[name], 6) for name in ("bleu", "bleu_lc", *metrics) if name in result}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("references", help="a reference file, one sentence per line")
    parser.add_argument("--repeat", type=int, default=8, help="copies of the file scored as one corpus")
    parser.add_argument("--metrics", nargs="+", default=["bleu", "chrf"], help="as evaluate --metrics")
    parser.add_argument("--runs", type=int, default=1, help="child processes, one after another")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.references, args.repeat, args.metrics)))
        return
    command = [sys.executable, __file__, args.references, "--repeat", str(args.repeat), "--metrics",
               *args.metrics, "--child"]
    runs = [json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            for _ in range(args.runs)]
    from mtcli.device import cpu_name

    print(json.dumps({"cpu": cpu_name(), "references": args.references,
                      "repeat": args.repeat, "metrics": args.metrics, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
