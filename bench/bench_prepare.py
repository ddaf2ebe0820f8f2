"""Benchmark `mtcli prepare`: wall time per phase, peak RSS, pairs/s, and the no-op re-run.

Usage (from the repository root):

    python bench/bench_prepare.py                                   # Multi30k de-en, 8k vocab
    python bench/bench_prepare.py configs/wmt_news_en_de.yaml
    python bench/bench_prepare.py --scale 4                         # training split repeated 4x:
                                                                    # peak RSS should stay flat
    python bench/bench_prepare.py configs/wmt14_en_de_base.yaml --floor \
        --set data.source=/tmp/wmt45/text --set data.hub_config=null   # a WMT-size corpus
                                                                    # (bench/make_wmt_corpus.py)

``--floor`` also measures, in the same run, what each stage cannot beat: one read of the input
files (gunzipped, or the parquet/arrow tables read), SentencePiece's own trainer on the same
cleaned text with the same sample size and threads, its encoder over every line on
``data.num_workers`` threads, and one write of the same number of bytes as the cache's arrays;
each stage's time is printed beside its floor and their ratio. Cleaning also writes the cleaned
training text, so read+clean is shown against a second floor too: the read plus one copy of
that text. The writes run in the main process while the
workers encode on every core; their CPU time and the time they waited for a core are printed
too, so the write's own cost can be told from the encoders' use of the cores.

The cache is built (always from scratch) in a temporary directory that is removed afterwards,
so the real ``data/prepared/`` is never touched. Peak RSS is ``ru_maxrss`` of this process and,
separately, of its largest child (encoding workers). Numbers depend on what else runs on the
machine; docs/performance.md gives each figure with its machine, command and JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import mtcli.data.prepare as prep
from mtcli.config import load_config
from mtcli.data.corpora import split_names
from mtcli.data.sources import TextDirSource, open_source
from mtcli.logs import setup_logging


def _run_queue_seconds() -> float:
    """Seconds this thread has waited for a core so far (Linux schedstat; 0 where there is none)."""
    try:
        with open("/proc/thread-self/schedstat") as handle:
            return int(handle.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class PhaseTimer:
    """Wraps prepare's phases (text writing, SentencePiece training, encoding) with timers.

    The writes happen in the main process while the workers encode on every core, so beside
    their wall time it also keeps the CPU time the main thread spent in them and the time it
    waited for a core inside them (``write_cpu``, ``write_waiting``): what writing itself costs,
    and what is the encoders' use of the cores."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"read+clean": 0.0, "spm train": 0.0, "encode": 0.0, "write": 0.0}
        self.write_cpu = self.write_waiting = 0.0

    def wrap(self, name: str, func):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed

    def wrap_write(self, func):
        timed = self.wrap("write", func)

        def counted(*args, **kwargs):
            cpu, waited = time.thread_time(), _run_queue_seconds()
            try:
                return timed(*args, **kwargs)
            finally:
                self.write_cpu += time.thread_time() - cpu
                self.write_waiting += _run_queue_seconds() - waited

        return counted

    def install(self) -> None:
        prep.write_eval = self.wrap("read+clean", prep.write_eval)
        prep.write_training = self.wrap("read+clean", prep.write_training)
        prep.encode_file = self.wrap("encode", prep.encode_file)
        prep.ArrayWriter.append = self.wrap_write(prep.ArrayWriter.append)
        prep._train_spm = self.wrap("spm train", prep._train_spm)  # drawing the sample, and training


def scaled_copy(config, scale: int, workdir: Path) -> str:
    """A text directory whose training split is the original repeated ``scale`` times."""
    data = config.data
    source = open_source(data.source, data.src_lang, data.tgt_lang, data.hub_config)
    if not isinstance(source, TextDirSource):
        raise SystemExit("--scale needs a text-directory source")
    out = workdir / "scaled"
    out.mkdir()
    for split in split_names(data):
        for lang in (data.src_lang, data.tgt_lang):
            src = source.path(split, lang)
            if src.suffix == ".gz":
                raise SystemExit("--scale needs plain (not .gz) files")
            dst = out / f"{split}.{lang}"
            with open(dst, "wb") as handle:
                for _ in range(scale if split == data.train_split else 1):
                    with open(src, "rb") as part:
                        shutil.copyfileobj(part, handle)
    return str(out)


def _read_floor(config) -> float:
    """Seconds for one read of every input file (text, .gz, parquet, arrow): for a text
    directory the config's splits and languages, else every file under the source."""
    import gzip

    import pyarrow.parquet as pq
    from pyarrow import ipc

    d = config.data
    source = open_source(d.source, d.src_lang, d.tgt_lang, d.hub_config)
    if isinstance(source, TextDirSource):
        paths = [source.path(split, lang) for split in split_names(d) for lang in (d.src_lang, d.tgt_lang)]
    else:
        paths = sorted(Path(d.source).rglob("*"))
    start = time.perf_counter()
    for path in paths:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as handle:
                while handle.read(1 << 22):
                    pass
        elif path.suffix == ".parquet":
            pq.read_table(path)
        elif path.suffix == ".arrow":
            with open(path, "rb") as handle:
                ipc.open_stream(handle).read_all()
        elif path.is_file() and path.suffix not in (".json",):
            with open(path, "rb") as handle:
                while handle.read(1 << 22):
                    pass
    return time.perf_counter() - start


def _copy_seconds(paths: list[Path], workdir: Path) -> float:
    """Seconds to write a copy of ``paths`` (a copy inside the kernel, as cleaning writes its
    kept lines): what writing the cleaned text costs on its own."""
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb") as source, open(workdir / f"copy.{path.name}", "wb") as target:
            left = path.stat().st_size
            while left > 0:
                copied = os.copy_file_range(source.fileno(), target.fileno(), left)
                if copied == 0:
                    break
                left -= copied
    seconds = time.perf_counter() - start
    for path in paths:
        (workdir / f"copy.{path.name}").unlink()
    return seconds


def floors(config, cache: Path, workdir: Path) -> dict[str, float]:
    """What each stage cannot beat, measured on this machine now (see the module docstring)."""
    import numpy as np
    import sentencepiece as spm

    from mtcli.data.cache import token_dtype
    from mtcli.data.textio import read_lines

    d = config.data
    texts = [cache / f"{d.train_split}.{lang}.txt" for lang in (d.src_lang, d.tgt_lang)]
    out: dict[str, float] = {"read+clean": _read_floor(config)}
    out["read+clean, text written"] = out["read+clean"] + _copy_seconds(texts, workdir)
    start = time.perf_counter()
    spm.SentencePieceTrainer.train(
        input=",".join(map(str, texts)), model_prefix=str(workdir / "floor"), vocab_size=d.vocab_size,
        model_type=d.spm_model_type, character_coverage=d.character_coverage,
        input_sentence_size=d.spm_max_sentences, shuffle_input_sentence=True, pad_id=0, unk_id=1,
        bos_id=2, eos_id=3, num_threads=max(1, d.num_workers), minloglevel=2)
    out["spm train"] = time.perf_counter() - start
    processor = spm.SentencePieceProcessor(model_file=str(cache / "spm.model"))
    encode = total = 0.0
    pieces = offsets = 0
    for path in sorted(cache.glob("*.txt")):
        lines = list(read_lines(path))
        offsets += len(lines) + 1  # the .idx file: one int64 offset a sentence, and a leading 0
        start = time.perf_counter()
        for i in range(0, len(lines), 100_000):
            pieces += sum(map(len, processor.encode(lines[i:i + 100_000], num_threads=max(1, d.num_workers))))
        encode += time.perf_counter() - start
    out["encode"] = encode
    itemsize = token_dtype(processor.get_piece_size()).itemsize
    blob = np.zeros(pieces * itemsize + offsets * 8, dtype=np.uint8)  # the .bin and .idx bytes
    start = time.perf_counter()
    blob.tofile(workdir / "floor.bin")
    total = time.perf_counter() - start
    out["write"] = total
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default="configs/multi30k_de_en.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value")
    parser.add_argument("--scale", type=int, default=1, help="repeat the training split N times")
    parser.add_argument("--verbose", action="store_true", help="show mtcli's log lines")
    parser.add_argument("--floor", action="store_true", help="measure each stage's floor in the same run")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()

    setup_logging(verbose=False)
    if not args.verbose:
        logging.getLogger("mtcli").setLevel(logging.WARNING)
    workdir = Path(tempfile.mkdtemp(prefix="bench_prepare."))
    try:
        overrides = list(args.overrides) + [f"data.prepared_dir={workdir / 'prepared'}"]
        config = load_config(args.config, overrides)
        if args.scale > 1:
            config = load_config(args.config, overrides + [f"data.source={scaled_copy(config, args.scale, workdir)}"])
        timer = PhaseTimer()
        timer.install()

        start = time.perf_counter()
        report = prep.prepare(config, force=True)
        total = time.perf_counter() - start

        start = time.perf_counter()
        again = prep.prepare(config)
        noop = time.perf_counter() - start
        assert again.skipped, "second run should be a no-op"

        rss_self = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rss_child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        floor = floors(config, report.directory, workdir) if args.floor else {}
        timer.seconds["encode"] -= timer.seconds["write"]  # appends happen inside encode_file
        train = report.counts[config.data.train_split]
        tokens = sum(sum(t.values()) for t in report.tokens.values())
        d = config.data
        rows = [
            ("config", f"{args.config} (scale {args.scale})"),
            ("vocab / model", f"{report.vocab_size} {d.spm_model_type}, spm_max_sentences {d.spm_max_sentences}"),
            ("workers", str(d.num_workers)),
            ("train pairs read / kept", f"{train['read']} / {train['kept']}"),
            ("tokens encoded (all splits)", f"{tokens}"),
            ("wall time, full prepare", f"{total:.2f} s"),
            *((f"  {name}", f"{sec:.2f} s" + (f"  (floor {floor[name]:.2f} s, {sec / max(floor[name], 1e-9):.2f}x)"
                                               if name in floor else "")) for name, sec in timer.seconds.items()),
            ("    write, on a CPU / waiting for one", f"{timer.write_cpu:.2f} s"
             + (f"  (floor {floor['write']:.2f} s, {timer.write_cpu / max(floor['write'], 1e-9):.2f}x)"
                if "write" in floor else "") + f" / {timer.write_waiting:.2f} s"),
            *((("    read+clean against a read and one write of the cleaned text",
                f"(floor {floor['read+clean, text written']:.2f} s, "
                f"{timer.seconds['read+clean'] / floor['read+clean, text written']:.2f}x)"),)
              if "read+clean, text written" in floor else ()),
            ("  other (hash, manifest, checks)", f"{total - sum(timer.seconds.values()):.2f} s"),
            ("train pairs / s", f"{train['read'] / total:,.0f}"),
            ("wall time, no-op re-run", f"{noop:.2f} s"),
            ("peak RSS, main process", f"{rss_self:.0f} MiB"),
            ("peak RSS, largest worker", f"{rss_child:.0f} MiB" if rss_child else "n/a (in-process)"),
        ]
        if args.json is not None:
            args.json.write_text(json.dumps({
                "pairs_read": train["read"], "pairs_kept": train["kept"], "seconds": total,
                "stages": timer.seconds, "write_cpu": timer.write_cpu,
                "write_waiting": timer.write_waiting, "floors": floor, "noop_seconds": noop,
                "peak_rss_mb": rss_self, "peak_rss_worker_mb": rss_child}, indent=2) + "\n")
        width = max(len(k) for k, _ in rows)
        print(f"{'metric':<{width}}  value")
        print(f"{'-' * width}  {'-' * 30}")
        for key, value in rows:
            print(f"{key:<{width}}  {value}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
