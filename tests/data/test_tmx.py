"""Tests of mtcli.data.tmx: a translation memory's units as pairs, its inline markup, its
encodings, and one-line errors naming the file and line."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from mtcli.data.sources import open_source
from mtcli.data.tmx import tmx_pairs
from mtcli.errors import DataError

MEMORY = """<?xml version="1.0" encoding="UTF-8"?>
<tmx version="1.4">
  <header creationtool="a CAT tool" srclang="en-GB" segtype="sentence" datatype="plaintext" o-tmf="x" adminlang="en"/>
  <body>
    <tu tuid="1">
      <prop type="x-client">acme</prop>
      <tuv xml:lang="en-GB"><seg>Press <bpt i="1">&lt;b&gt;</bpt>Save<ept i="1">&lt;/b&gt;</ept> &amp; wait.</seg></tuv>
      <tuv xml:lang="FR-fr"><seg>Appuyez sur <hi type="b">Enregistrer</hi> et attendez.</seg></tuv>
    </tu>
    <tu tuid="2">
      <tuv xml:lang="de"><seg>Nur Deutsch.</seg></tuv>
      <tuv xml:lang="en"><seg>English only.</seg></tuv>
    </tu>
    <tu tuid="3">
      <tuv lang="fr"><seg>
        Une ligne<ph x="1">{1}</ph>
        coupée.
      </seg></tuv>
      <tuv xml:lang="en_US"><seg>A broken
line.</seg></tuv>
    </tu>
  </body>
</tmx>
"""


def test_units_give_the_pair_of_the_two_languages_by_tag_or_first_subtag(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Native codes (bpt, ept, ph) are left out, <hi> text is kept, entities are decoded, line
    breaks in a segment are spaces; a unit without French is an empty pair, warned of once."""
    path = tmp_path / "train.tmx"
    path.write_text(MEMORY, encoding="utf-8")
    assert list(tmx_pairs(path, "en", "fr")) == [
        ("Press Save & wait.", "Appuyez sur Enregistrer et attendez."),
        ("", ""),
        ("A broken line.", "Une ligne         coupée."),
    ]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 1 translation unit(s) lacking the 'en' or the 'fr' segment (the first: line 10), read as empty pairs"]
    assert list(tmx_pairs(path, "fr", "en"))[0] == ("Appuyez sur Enregistrer et attendez.", "Press Save & wait.")


def test_a_validation_split_stops_at_a_unit_without_the_pair(tmp_path: Path) -> None:
    path = tmp_path / "valid.tmx"
    path.write_text(MEMORY, encoding="utf-8")
    with pytest.raises(DataError, match=r"valid.tmx:10: a translation unit without a 'fr' segment; a validation"):
        list(tmx_pairs(path, "en", "fr", verbatim=True))


def test_utf16_with_its_byte_order_mark_and_gzip_are_read(tmp_path: Path) -> None:
    plain = tmp_path / "plain.tmx"
    plain.write_text(MEMORY, encoding="utf-8")
    utf16 = tmp_path / "utf16.tmx.gz"
    utf16.write_bytes(gzip.compress(MEMORY.replace('encoding="UTF-8"', 'encoding="UTF-16"').encode("utf-16")))
    assert list(tmx_pairs(utf16, "en", "fr")) == list(tmx_pairs(plain, "en", "fr"))


def test_malformed_xml_and_a_file_without_the_pair_are_one_line_each(tmp_path: Path) -> None:
    broken = tmp_path / "broken.tmx"
    broken.write_text(MEMORY.replace("</tu>", "", 1), encoding="utf-8")
    with pytest.raises(DataError, match=r"broken.tmx:\d+: not a well-formed TMX file \(mismatched tag, column \d+\)"):
        list(tmx_pairs(broken, "en", "fr"))
    plain = tmp_path / "plain.tmx"
    plain.write_text(MEMORY, encoding="utf-8")
    with pytest.raises(DataError, match=r"plain.tmx: no translation unit holds both 'en' and 'cs' \(the languages "
                                        r"of its units: FR-fr, de, en, en-GB, en_US, fr\)"):
        list(tmx_pairs(plain, "en", "cs"))


def test_a_text_directory_reads_tmx_splits_and_refuses_a_split_in_two_forms(tmp_path: Path) -> None:
    (tmp_path / "train.tmx").write_text(MEMORY, encoding="utf-8")
    (tmp_path / "dev.en").write_text("a\n", encoding="utf-8")
    (tmp_path / "dev.fr").write_text("b\n", encoding="utf-8")
    source = open_source(str(tmp_path), "en", "fr")
    assert source.splits() == ["dev", "train"]
    source.check(["train", "dev"])
    assert next(source.pairs("train"))[0] == "Press Save & wait."
    assert source.plain_files("train") is None and source.num_pairs("train") is None
    (tmp_path / "dev.tmx").write_text(MEMORY, encoding="utf-8")
    with pytest.raises(DataError, match=r"dev.tmx and dev.en and dev.fr all hold split 'dev'; keep one form"):
        open_source(str(tmp_path), "en", "fr").check(["dev"])
