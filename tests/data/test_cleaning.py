"""Tests of mtcli.data.cleaning: the filters over arrays equal the filters over pairs, word counts
over bytes equal ``str.split``, and cleaning in several processes writes what one process writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mtcli.data import cleaning
from mtcli.data.cleaning import (
    CleanCounts,
    PairCleaner,
    aligned_ranges,
    clean_text_files,
)
from mtcli.data.scan import line_hashes, line_layout
from mtcli.errors import DataError
from mtcli.languages import measured_in_characters


@pytest.mark.parametrize("kept", [[], [0], [5], [0, 1, 2, 3, 4, 5], [1, 2, 4], [0, 5], [2, 3]])
def test_kept_lines_are_written_as_spans_of_the_block(tmp_path, kept: list[int]) -> None:
    lines = [b"eins", b"", b"drei und", b"vier", b"f\xc3\xbcnf", b"sechs"]
    block = b"".join(line + b"\n" for line in lines)
    stops, _ = line_layout(block)
    with open(tmp_path / "part", "wb") as out:
        out.write(b"before\n")
        ends = cleaning._write_lines(out, block, stops, np.array(kept, dtype=np.intp))
    wanted = [lines[i] for i in kept]
    assert (tmp_path / "part").read_bytes() == b"before\n" + b"".join(line + b"\n" for line in wanted)
    assert ends.tolist() == cleaning._line_ends(wanted).tolist()


def _pairs() -> list[tuple[str, str]]:
    long = " ".join(["w"] * 11)
    return [("a b", "c d"), ("", "x"), ("x", "   "), (long, long), ("a", "a b c d"), ("a b", "c d"),
            ("a b c", "a"), ("a\u3000b c", "d e"), ("ä", "ü")] * 3


def test_clean_lines_equals_the_cleaner_over_pairs() -> None:
    pairs = _pairs()
    one = PairCleaner(max_length=10, max_ratio=3.0, dedup=True)
    expected = list(one(pairs))
    arrays = PairCleaner(max_length=10, max_ratio=3.0, dedup=True)
    src, tgt = [s.encode() for s, _ in pairs], [t.encode() for _, t in pairs]
    n_src = line_layout(b"".join(line + b"\n" for line in src))[1]
    n_tgt = line_layout(b"".join(line + b"\n" for line in tgt))[1]
    kept = arrays.clean_lines(n_src, n_tgt, line_hashes(src), line_hashes(tgt)).tolist()
    assert [(src[i].decode(), tgt[i].decode()) for i in kept] == expected
    assert arrays.counts == one.counts
    assert arrays.counts == CleanCounts(read=27, kept=4, empty=6, too_long=3, ratio=3, duplicate=11)


def test_chinese_and_japanese_are_measured_in_characters() -> None:
    """A whole unspaced sentence is one word: measured in words, a Chinese side fails the ratio
    rule against any English sentence of four words or more, and no Japanese side is too long."""
    pairs = [("一只猫在草地上玩", "a cat plays on the grass"), ("猫", "a cat plays on the grass"),
             ("今日はいい天気ですね" * 3, "nice weather")]
    by_words = PairCleaner(max_length=20, max_ratio=3.0)
    assert list(by_words(pairs)) == pairs[2:] and by_words.counts.ratio == 2
    by_characters = PairCleaner(max_length=20, max_ratio=3.0, characters=(True, False))
    assert list(by_characters(pairs)) == pairs[:1]
    assert by_characters.counts == CleanCounts(read=3, kept=1, too_long=1, ratio=1)
    assert [measured_in_characters(lang) for lang in ("zh", "zh_TW", "cmn", "ja", "jpn", "ko", "en", "de")] == [
        True, True, True, True, True, False, False, False]
    # the other Chinese languages and Literary Chinese, by their ISO 639-3 codes, with a region too
    assert all(measured_in_characters(lang) for lang in ("wuu", "hak", "nan", "gan", "lzh", "yue-HK", "nan_TW"))


def test_thai_lao_khmer_burmese_and_tibetan_are_measured_in_characters() -> None:
    """Their spaces, where there are any, part phrases, not words: measured in words, a Thai
    sentence was one or two words whatever it said, so the ratio rule dropped a pair for its
    English side's length alone, and no Thai side was ever too long."""
    from mtcli.languages import default_character_coverage

    pairs = [("I would like to book a table for two people tonight", "ฉันอยากจองโต๊ะสำหรับสองคนคืนนี้"),
             ("The weather is very hot today", "วันนี้อากาศร้อนมาก"),
             ("Where is the station", "สถานีรถไฟอยู่ที่ไหน ครับ"),
             ("It rains", "ฝนตก" * 40)]  # 160 characters, one word
    by_words = PairCleaner(max_length=100, max_ratio=3.0)
    assert list(by_words(pairs)) == pairs[2:] and by_words.counts == CleanCounts(read=4, kept=2, ratio=2)
    thai = PairCleaner(max_length=100, max_ratio=3.0, characters=(False, measured_in_characters("th")))
    assert list(thai(pairs)) == pairs[:2]  # characters against words: 2.8, 3.0, 5.75
    assert thai.counts == CleanCounts(read=4, kept=2, too_long=1, ratio=1)
    codes = ("th", "th_TH", "tha", "lo", "lao", "km", "khm", "my", "mya", "bur", "bo", "bod", "dz", "dzo")
    assert all(measured_in_characters(lang) for lang in codes)
    # small alphabets: SentencePiece covers all their characters
    assert default_character_coverage(["en", "th"]) == 1.0 and default_character_coverage(["en", "ja"]) < 1.0


@pytest.mark.parametrize(("lang", "text"), [("zh", "你好，世界！"), ("th", "ทำงาน"), ("lo", "ທຳ"), ("ko", "ㅋㅋ ㅠㅠ"),
                                            ("fa", "می\u200cخواهم"), ("tha", "ทำ"), ("per", "می\u200cروم"),
                                            ("ckb", "دە\u200cکەم")])
def test_a_target_whose_text_nfkc_rewrites_is_kept_as_written(lang: str, text: str, tiny_run_dir: Path) -> None:
    """Thai's and Lao's SARA AM became two other characters, Korean's jamo others, and a Persian
    word's zero-width non-joiner a space: a model of the default nmt_nfkc could not write its
    references, which cost it chrF."""
    import sentencepiece as spm

    from mtcli.languages import default_normalization

    assert default_normalization(["en", lang]) == "identity"
    nfkc = spm.SentencePieceProcessor(model_file=str(tiny_run_dir / "spm.model"))  # (the toy's: nmt_nfkc)
    assert nfkc.normalize(text).lstrip("▁") != text.replace(" ", "▁")  # what such a model would write
    assert default_normalization(["en", "km"]) == default_normalization(["de", "fr"]) == "nmt_nfkc"


def test_absorb_drops_what_an_earlier_range_kept() -> None:
    parent = PairCleaner(max_length=10, max_ratio=3.0, dedup=True)
    for chunk, expected in (([("a", "b"), ("c", "d")], None), ([("e", "f"), ("c", "d"), ("a", "b")], [1, 2])):
        worker = PairCleaner(max_length=10, max_ratio=3.0, dedup=True, record_keys=True)
        list(worker(chunk))
        drop = parent.absorb(worker.counts, np.concatenate(worker.kept_keys))
        assert (drop if drop is None else drop.tolist()) == expected
    assert parent.counts == CleanCounts(read=5, kept=3, duplicate=2)


def _write(path, lines: list[str], end: str = "\n", bom: bool = False) -> None:
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + "".join(line + end for line in lines).encode())


@pytest.mark.parametrize("block_bytes", [1 << 24, 7, 32, 100])
def test_aligned_ranges_cut_both_files_at_the_same_lines(tmp_path, monkeypatch, block_bytes: int) -> None:
    monkeypatch.setattr(cleaning, "CUT_BLOCK_BYTES", block_bytes)  # small: cuts counted across reads
    src, tgt = tmp_path / "a.src", tmp_path / "a.tgt"
    _write(src, [f"s{i}" + "x" * (i % 5) for i in range(103)])
    _write(tgt, [f"t{i}" + "yy" * (i % 3) for i in range(103)])
    ranges = aligned_ranges(src, tgt, 10)
    assert [r[0] for r in ranges] == list(range(1, 104, 10))
    for first, s0, s1, t0, t1 in ranges:
        got_src = src.read_bytes()[s0:s1].decode().splitlines()
        got_tgt = tgt.read_bytes()[t0:t1].decode().splitlines()
        assert got_src[0] == f"s{first - 1}" + "x" * ((first - 1) % 5)
        assert len(got_src) == len(got_tgt) == min(10, 103 - first + 1)
    assert ranges[-1][2] == src.stat().st_size and ranges[-1][4] == tgt.stat().st_size


def _serial(src, tgt, tmp_path, **settings) -> tuple[bytes, bytes, CleanCounts]:
    from mtcli.data.textio import read_lines

    cleaner = PairCleaner(**settings)
    kept = list(cleaner(zip(read_lines(src), read_lines(tgt), strict=True)))
    return ("".join(s + "\n" for s, _ in kept).encode(), "".join(t + "\n" for _, t in kept).encode(),
            cleaner.counts)


@pytest.mark.parametrize("characters", [(False, False), (False, True)])
@pytest.mark.parametrize("workers", [1, 2])
def test_clean_text_files_writes_what_one_process_writes(tmp_path, monkeypatch, workers: int,
                                                         characters: tuple[bool, bool]) -> None:
    rng = np.random.default_rng(0)
    words = ["ein", "Hund", "läuft", "über", "die", "Wiese", "a", "dog", "runs", "“x”", "猫", "日本"]
    pairs = [(" ".join(rng.choice(words, rng.integers(0, 14))), " ".join(rng.choice(words, rng.integers(0, 14))))
             for _ in range(400)]
    pairs += pairs[:50]  # duplicates in later ranges
    pairs[7] = ("carriage\rreturn here", "mit \r drin")  # the reader turns a lone CR into a space
    pairs[133] = ("a\u00a0b\u00a0c\u2009d\u3000e", "x y")  # 5 words, 2: dropped for the ratio
    src, tgt = tmp_path / "c.src", tmp_path / "c.tgt"
    _write(src, [s for s, _ in pairs], bom=True)
    _write(tgt, [t + ("\r" if i == 200 else "") for i, (_, t) in enumerate(pairs)])  # one Windows line end
    with open(src, "ab") as handle:
        handle.write(b"last line without an end")
    with open(tgt, "ab") as handle:
        handle.write(b"letzte Zeile ohne Ende")
    settings = {"max_length": 10, "max_ratio": 2.0, "dedup": True, "characters": characters}
    want_src, want_tgt, want_counts = _serial(src, tgt, tmp_path, **settings)
    cleaner = PairCleaner(**settings)
    clean_text_files(src, tgt, tmp_path / "o.src", tmp_path / "o.tgt", cleaner, workers, lines_per_range=37)
    assert (tmp_path / "o.src").read_bytes() == want_src
    assert (tmp_path / "o.tgt").read_bytes() == want_tgt
    assert cleaner.counts == want_counts and want_counts.duplicate > 0 and want_counts.ratio > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.src", "c.tgt", "o.src", "o.tgt"]  # no parts left


def test_clean_text_files_errors_name_the_file_and_line(tmp_path, monkeypatch) -> None:
    src, tgt = tmp_path / "e.src", tmp_path / "e.tgt"
    _write(src, [f"satz {i}" for i in range(100)])
    _write(tgt, [f"sentence {i}" for i in range(99)])
    with pytest.raises(DataError, match=r"e\.src has 100 lines but .*e\.tgt has 99 lines"):
        clean_text_files(src, tgt, tmp_path / "o.src", tmp_path / "o.tgt", PairCleaner(10, 3.0), 2, 7)
    lines = [f"sentence {i}".encode() for i in range(100)]
    lines[76] = b"bad \xff byte"
    tgt.write_bytes(b"".join(line + b"\n" for line in lines))
    with pytest.raises(DataError, match=r"e\.tgt:77: invalid UTF-8 \(byte 0xff at column 5\)"):
        clean_text_files(src, tgt, tmp_path / "o.src", tmp_path / "o.tgt", PairCleaner(10, 3.0), 2, 7)


@pytest.mark.parametrize("ends", [("\n", ""), ("", "\n"), ("\n", "\n")])
def test_aligned_ranges_when_the_last_range_is_full(tmp_path, monkeypatch, ends: tuple[str, str]) -> None:
    src, tgt = tmp_path / "f.src", tmp_path / "f.tgt"
    src.write_text("\n".join(f"s{i}" for i in range(20)) + ends[0])
    tgt.write_text("\n".join(f"t{i}" for i in range(20)) + ends[1])
    ranges = aligned_ranges(src, tgt, 10)
    assert [r[0] for r in ranges] == [1, 11]
    assert ranges[-1][2] == src.stat().st_size and ranges[-1][4] == tgt.stat().st_size


@pytest.mark.parametrize("drop", [None, [0], [4], [1, 2], [0, 1, 2, 3, 4], [0, 2, 4]])
@pytest.mark.parametrize("kernel_copy", [True, False])
def test_a_part_is_copied_without_its_dropped_lines(tmp_path, monkeypatch, drop, kernel_copy: bool) -> None:
    lines = [b"eins", b"", b"drei und", b"vier", b"f\xc3\xbcnf"]
    part = tmp_path / "part"
    part.write_bytes(b"".join(line + b"\n" for line in lines))
    if not kernel_copy:  # a system without copy_file_range: the same bytes through Python
        monkeypatch.setattr(cleaning.os, "copy_file_range", _no_copy_file_range, raising=False)
    with open(tmp_path / "out", "wb") as out:
        out.write(b"before\n")
        out.flush()
        at = out.tell()
        with open(part, "rb") as handle:
            for start, stop in cleaning._kept_spans(cleaning._line_ends(lines), None if drop is None else np.array(drop)):
                cleaning._copy_span(handle.fileno(), out.fileno(), start, stop, at)
                at += stop - start
        out.seek(at)
        out.write(b"after\n")
    kept = [line for i, line in enumerate(lines) if drop is None or i not in drop]
    assert (tmp_path / "out").read_bytes() == b"before\n" + b"".join(line + b"\n" for line in kept) + b"after\n"


def _no_copy_file_range(*args, **kwargs):
    raise OSError(38, "Function not implemented")


@pytest.mark.parametrize("seed", range(20))
def test_spans_of_runs_map_to_the_same_bytes_of_the_file(seed: int) -> None:
    rng = np.random.default_rng(seed)
    data = bytes(rng.integers(0, 256, 400, dtype=np.uint8))
    edges = np.sort(rng.choice(np.arange(1, 400), size=2 * int(rng.integers(1, 6)), replace=False))
    runs = edges.reshape(-1, 2).astype(np.int64)
    joined = b"".join(data[a:b] for a, b in runs.tolist())
    cuts = np.sort(rng.choice(np.arange(len(joined) + 1), size=2 * int(rng.integers(1, 4)), replace=False))
    spans = [(a, b) for a, b in cuts.reshape(-1, 2).tolist() if a < b]
    mapped = list(cleaning._through(spans, runs))
    assert b"".join(data[a:b] for a, b in mapped) == b"".join(joined[a:b] for a, b in spans)
    assert all(a < b for a, b in mapped)


def test_a_file_of_lone_cr_line_ends_is_refused_before_its_line_count(tmp_path) -> None:
    """Not 'line counts differ: ... has 1 lines but ... has 3 lines'."""
    src, tgt = tmp_path / "c.src", tmp_path / "c.tgt"
    tgt.write_bytes(b"x\ny\nz\n")
    for text in (b"a\rb\rc\r", b"a\rb\rc\r\n", b"a\rb\rc\n"):  # (ended by one \n: still one line)
        src.write_bytes(text)
        with pytest.raises(DataError, match=rf"^{src}: its lines end in a lone \\r"):
            aligned_ranges(src, tgt, 10)
