"""Build a WMT-size English-German corpus from real pairs: ../shared/data's, else mtcli's download.

The WMT14 en-de training set has 4.5M pairs; this script writes ``--pairs`` of them (default
4,500,000) so that `prepare` and `train` can be measured at that size on a machine without
internet. Each training pair joins two real pairs drawn at random from the Multi30k and WMT news
training text (about 55k pairs, so sentences are about as long as WMT's), and then, in a share
of the pairs (``--mutate``, default 0.3), one word on each side gets a suffix drawn from a Zipf
law: new word types keep appearing as the corpus grows, as they do in real text (Heaps' law),
instead of stopping at the 55k sentences' vocabulary, which would flatter SentencePiece. Both
sides get the same suffix, like a name that is copied. Validation and test are the real
newstest2013 and newstest2014. Output is deterministic for a ``--seed``.

Forms, each under ``OUT/<form>/``, with the WMT14 hub splits ``train``, ``validation``, ``test``:

* ``text``: ``<split>.en`` / ``<split>.de``;
* ``gz``: the same, gzipped (``<split>.<lang>.gz``);
* ``parquet``: ``data/<split>-NNNNN-of-NNNNN.parquet``, rows ``{"translation": {"en", "de"}}``
  (the schema of the WMT hub datasets), 500k rows a file;
* ``dataset``: ``datasets.DatasetDict.save_to_disk`` of the same rows;
* ``tsv``: ``<split>.en-de.tsv``, both sides of a pair on one line, tab-separated.

Usage::

    python bench/make_wmt_corpus.py /tmp/wmt45 --pairs 4500000          # every form
    python bench/make_wmt_corpus.py /tmp/wmt05 --pairs 500000 --forms text

then ``mtcli prepare configs/wmt14_en_de_base.yaml --set data.source=/tmp/wmt45/text
--set data.hub_config=null --set data.prepared_dir=...``.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import string
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from mtcli.data.textio import read_lines  # noqa: E402  (the one strict line reader)
from mtcli.errors import MtcliError, one_line  # noqa: E402

SHARED = REPO.parent / "shared" / "data"


def corpus_dir(name: str) -> Path:
    """Where corpus ``name``'s files are: ../shared/data beside the checkout, else the files
    ``mtcli prepare`` downloads (once, verified: :func:`mtcli.data.download.locate`)."""
    if (SHARED / name).is_dir():
        return SHARED / name
    from mtcli.data.download import locate

    return locate(name)


def pools() -> tuple[Path, Path]:
    """The training text every generated pair is made of: ``<prefix>.en`` and ``<prefix>.de``."""
    return corpus_dir("multi30k") / "train", corpus_dir("wmt-news-en-de") / "train"


def real_splits() -> dict[str, Path]:
    """The real validation and test sets, by split: ``<prefix>.en`` and ``<prefix>.de``."""
    news = corpus_dir("wmt-news-en-de")
    return {"validation": news / "newstest2013", "test": news / "newstest2014"}


SPLITS = ("validation", "test")
FORMS = ("text", "gz", "parquet", "dataset", "tsv")
LANGS = ("en", "de")
CHUNK = 100_000
PARQUET_ROWS = 500_000
LETTERS = string.ascii_lowercase


def read_pool() -> tuple[list[str], list[str]]:
    """The real training pairs every generated pair is made of."""
    en: list[str] = []
    de: list[str] = []
    for prefix in pools():
        a, b = list(read_lines(f"{prefix}.en")), list(read_lines(f"{prefix}.de"))
        if len(a) != len(b):
            raise SystemExit(f"{prefix}: .en has {len(a)} lines, .de {len(b)}")
        en += a
        de += b
    return en, de


def suffix(j: int) -> str:
    """A short letter suffix for Zipf rank ``j`` (1 -> 'a', 27 -> 'ba', ...)."""
    out = ""
    while j > 0:
        j, r = divmod(j - 1, 26)
        out = LETTERS[r] + out
    return out


def _mutated(sentence: str, position: float, tag: str) -> str:
    """``sentence`` with ``tag`` added to the word at ``position`` (0..1), before its punctuation."""
    words = sentence.split(" ")
    i = min(int(position * len(words)), len(words) - 1)
    core = words[i].rstrip(".,;:!?\"')")
    words[i] = core + tag + words[i][len(core):]
    return " ".join(words)


def training_pairs(n: int, seed: int, mutate: float) -> Iterator[tuple[list[str], list[str]]]:
    """``n`` generated pairs, in chunks of :data:`CHUNK` (lists of English and German lines)."""
    pool_en, pool_de = read_pool()
    rng = np.random.default_rng(seed)
    done = 0
    while done < n:
        size = min(CHUNK, n - done)
        first, second = rng.integers(0, len(pool_en), size), rng.integers(0, len(pool_en), size)
        mutated = rng.random(size) < mutate
        ranks = rng.zipf(1.2, size)
        where = rng.random((size, 2))
        en, de = [], []
        for k in range(size):
            a = f"{pool_en[first[k]]} {pool_en[second[k]]}"
            b = f"{pool_de[first[k]]} {pool_de[second[k]]}"
            if mutated[k]:
                tag = suffix(int(ranks[k]))
                a, b = _mutated(a, where[k, 0], tag), _mutated(b, where[k, 1], tag)
            en.append(a)
            de.append(b)
        done += size
        yield en, de


def write_corpus(out: Path, pairs: int, forms: list[str], seed: int = 1, mutate: float = 0.3) -> dict:
    """Write the corpus in ``forms`` under ``out``; returns counts and timings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    handles = {}
    if "text" in forms:
        (out / "text").mkdir(exist_ok=True)
        handles["text"] = {lang: open(out / "text" / f"train.{lang}", "w", encoding="utf-8") for lang in LANGS}
    if "gz" in forms:
        (out / "gz").mkdir(exist_ok=True)
        handles["gz"] = {lang: gzip.open(out / "gz" / f"train.{lang}.gz", "wt", encoding="utf-8", compresslevel=1)
                         for lang in LANGS}
    table = None
    if "tsv" in forms:
        (out / "tsv").mkdir(exist_ok=True)
        table = open(out / "tsv" / "train.en-de.tsv", "w", encoding="utf-8")
    parquet_dir = out / "parquet" / "data"
    files = max(1, -(-pairs // PARQUET_ROWS))
    writer, rows_in_file, file_index = None, 0, 0
    if "parquet" in forms or "dataset" in forms:
        parquet_dir.mkdir(parents=True, exist_ok=True)
    types: dict[str, set[str]] = {lang: set() for lang in LANGS}
    for en, de in training_pairs(pairs, seed, mutate):
        for lines, lang in ((en, "en"), (de, "de")):
            for handle in (h[lang] for h in handles.values()):
                handle.write("\n".join(lines) + "\n")
            for line in lines[:: max(1, len(lines) // 2000)]:  # a sample: the type count's growth
                types[lang].update(line.split())
        if table is not None:
            table.write("".join(f"{a}\t{b}\n" for a, b in zip(en, de, strict=True)))
        if parquet_dir.is_dir():
            start_row = 0
            while start_row < len(en):
                if writer is None:
                    name = parquet_dir / f"train-{file_index:05d}-of-{files:05d}.parquet"
                    writer = pq.ParquetWriter(name, pa.schema([("translation", pa.struct(
                        [("en", pa.string()), ("de", pa.string())]))]))
                take = min(len(en) - start_row, PARQUET_ROWS - rows_in_file)
                rows = [{"en": a, "de": b} for a, b in zip(en[start_row:start_row + take],
                                                           de[start_row:start_row + take], strict=True)]
                writer.write_table(pa.table({"translation": rows}))
                start_row += take
                rows_in_file += take
                if rows_in_file == PARQUET_ROWS:
                    writer.close()
                    writer, rows_in_file, file_index = None, 0, file_index + 1
    if writer is not None:
        writer.close()
    for group in handles.values():
        for handle in group.values():
            handle.close()
    if table is not None:
        table.close()
    for split, prefix in real_splits().items():
        lines = {lang: list(read_lines(f"{prefix}.{lang}")) for lang in LANGS}
        if "tsv" in forms:
            (out / "tsv" / f"{split}.en-de.tsv").write_text(
                "".join(f"{a}\t{b}\n" for a, b in zip(lines["en"], lines["de"], strict=True)), encoding="utf-8")
        for lang in LANGS:
            text = "\n".join(lines[lang]) + "\n"
            if "text" in forms:
                (out / "text" / f"{split}.{lang}").write_text(text, encoding="utf-8")
            if "gz" in forms:
                (out / "gz" / f"{split}.{lang}.gz").write_bytes(gzip.compress(text.encode(), compresslevel=1))
        if parquet_dir.is_dir():
            pq.write_table(pa.table({"translation": [{"en": a, "de": b} for a, b in
                                                     zip(lines["en"], lines["de"], strict=True)]}),
                           parquet_dir / f"{split}-00000-of-00001.parquet")
    if "dataset" in forms:
        import datasets

        parts = {split: sorted(str(p) for p in parquet_dir.glob(f"{split}-*.parquet"))
                 for split in ("train", *SPLITS)}
        dataset = datasets.DatasetDict({split: datasets.Dataset.from_parquet(files) for split, files in parts.items()})
        dataset.save_to_disk(str(out / "dataset"))
    if "parquet" not in forms and parquet_dir.is_dir():
        shutil.rmtree(out / "parquet")
    return {"pairs": pairs, "forms": forms, "seconds": round(time.perf_counter() - start, 1),
            "sampled_types": {lang: len(v) for lang, v in types.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--pairs", type=int, default=4_500_000)
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--mutate", type=float, default=0.3, help="share of pairs with a suffixed word")
    args = parser.parse_args()
    forms = [f for f in args.forms.split(",") if f]
    unknown = set(forms) - set(FORMS)
    if unknown:
        parser.error(f"unknown forms {sorted(unknown)} (known: {', '.join(FORMS)})")
    try:
        prefixes = (*pools(), *real_splits().values())
    except MtcliError as exc:  # offline, without ../shared/data
        parser.error(f"{one_line(exc)}; or put multi30k/ and wmt-news-en-de/ in {SHARED}")
    for prefix in prefixes:
        if not Path(f"{prefix}.en").is_file():
            parser.error(f"{prefix}.en not found")
    print(write_corpus(args.out, args.pairs, forms, args.seed, args.mutate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
