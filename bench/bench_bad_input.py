"""Bad input at WMT size: `mtcli prepare` on a corpus whose target file is one line short, and on
one with invalid UTF-8 deep inside (default: line 3,000,000), must fail with one line naming the
file and the line, exit non-zero, and leave no cache behind.

Reads a text corpus written by bench/make_wmt_corpus.py (``CORPUS/text``), makes the two broken
copies beside it in a temporary directory (the training files rewritten, the other splits
linked), and runs `mtcli prepare configs/wmt14_en_de_base.yaml` on each. Prints, per case, the
exit code, the seconds until the error, the error line, and whether anything was left.

Usage::

    python bench/make_wmt_corpus.py /tmp/wmt45 --pairs 4500000 --forms text
    python bench/bench_bad_input.py /tmp/wmt45/text                      # line 3,000,000
    python bench/bench_bad_input.py /tmp/small/text --bad-line 2000      # a small corpus
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def broken_copy(corpus: Path, out: Path, case: str, bad_line: int) -> int:
    """``out``: ``corpus`` with train.de one line short, or train.en's line ``bad_line`` holding
    an invalid byte; returns the line the error should name."""
    out.mkdir(parents=True)
    for path in corpus.iterdir():
        if not path.name.startswith("train."):
            (out / path.name).symlink_to(path.resolve())
    lines = 0
    with open(corpus / "train.en", "rb") as src, open(out / "train.en", "wb") as dst:
        for lines, raw in enumerate(src, start=1):
            dst.write(raw[:-1] + b" \xff\n" if case == "utf8" and lines == bad_line else raw)
    with open(corpus / "train.de", "rb") as src, open(out / "train.de", "wb") as dst:
        for n, raw in enumerate(src, start=1):
            if case == "short" and n == lines:
                break
            dst.write(raw)
    return bad_line if case == "utf8" else lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("corpus", type=Path, help="a text directory from bench/make_wmt_corpus.py")
    parser.add_argument("--bad-line", type=int, default=3_000_000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_bad_input."))
    ok = True
    try:
        for case in ("short", "utf8"):
            source = work / case
            line = broken_copy(args.corpus, source, case, args.bad_line)
            cache = work / f"prepared-{case}"
            start = time.perf_counter()
            result = subprocess.run(
                [sys.executable, "-m", "mtcli.cli", "prepare", str(REPO / "configs" / "wmt14_en_de_base.yaml"),
                 "--set", f"data.source={source}", "--set", "data.hub_config=null",
                 "--set", f"data.prepared_dir={cache}", "--set", "data.num_workers=2"],
                capture_output=True, text=True)
            seconds = time.perf_counter() - start
            errors = [ln for ln in result.stderr.splitlines() if ln.startswith("mtcli: error:")]
            left = cache.exists() or any(work.glob(f".prepared-{case}*"))
            named = len(errors) == 1 and (f":{line}" in errors[0] or f"{line}" in errors[0])
            print(f"{case}: exit {result.returncode} after {seconds:.1f} s; error names line {line}: {named}; "
                  f"traceback: {'Traceback' in result.stderr}; cache left: {left}")
            print(f"  {errors[0] if errors else result.stderr.strip()[-300:]}")
            ok &= result.returncode != 0 and named and not left and "Traceback" not in result.stderr
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
