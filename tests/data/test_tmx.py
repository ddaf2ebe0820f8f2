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
    """Native codes (bpt, ept, ph) are left out, <hi> text is kept, entities are decoded, runs of
    white space (indentation, line breaks) in a segment are one space; a unit without French is
    an empty pair, warned of once."""
    path = tmp_path / "train.tmx"
    path.write_text(MEMORY, encoding="utf-8")
    assert list(tmx_pairs(path, "en", "fr")) == [
        ("Press Save & wait.", "Appuyez sur Enregistrer et attendez."),
        ("", ""),
        ("A broken line.", "Une ligne coupée."),
    ]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 1 translation unit(s) lacking the 'en' or the 'fr' segment (the first: line 10), read as empty pairs"]
    assert list(tmx_pairs(path, "fr", "en"))[0] == ("Appuyez sur Enregistrer et attendez.", "Press Save & wait.")


def test_an_exact_variant_wins_and_several_near_ones_are_refused(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """For 'zh', a unit's zh segment is read before its zh-TW; a unit with zh-CN and zh-TW and no
    zh (taking the first would mix the two scripts unseen) stops a validation split, naming its
    line, and is dropped from training, warned of; 'zh-TW' reads its own."""
    def unit(*variants: tuple[str, str]) -> str:
        return "<tu>" + "".join(f'<tuv xml:lang="{v}"><seg>{t}</seg></tuv>' for v, t in variants) + "</tu>\n"

    path = tmp_path / "train.tmx"
    path.write_text('<?xml version="1.0" encoding="UTF-8"?>\n<tmx version="1.4"><header/><body>\n'
                    + unit(("en", "a dog"), ("zh-TW", "一隻狗"), ("zh", "一只狗"))
                    + unit(("en", "a cat"), ("zh-CN", "一只猫"), ("zh-TW", "一隻貓")) + "</body></tmx>\n",
                    encoding="utf-8")
    with pytest.raises(DataError, match=r"train.tmx:4: a translation unit holds several 'zh' variants \(zh-CN, zh-TW\)"):
        list(tmx_pairs(path, "en", "zh", verbatim=True))
    assert list(tmx_pairs(path, "en", "zh")) == [("a dog", "一只狗"), ("", "")]
    assert "among them, " in caplog.text and "train.tmx:4: a translation unit holds several 'zh' variants" in caplog.text
    assert list(tmx_pairs(path, "en", "zh_TW")) == [("a dog", "一隻狗"), ("a cat", "一隻貓")]
    # a language's other code: data.tgt_lang kor found no 'ko-KR' segment, though kor is Korean for BLEU
    korean = tmp_path / "ko.tmx"
    korean.write_text('<?xml version="1.0" encoding="UTF-8"?>\n<tmx version="1.4"><header/><body>\n'
                      + unit(("en", "a dog"), ("ko-KR", "개")) + unit(("eng", "a cat"), ("kor", "고양이"))
                      + "</body></tmx>\n", encoding="utf-8")
    assert list(tmx_pairs(korean, "en", "kor")) == [("a dog", "개"), ("a cat", "고양이")]
    assert list(tmx_pairs(korean, "en", "ko")) == [("a dog", "개"), ("a cat", "고양이")]  # eng is en too
    assert list(tmx_pairs(korean, "eng", "ko")) == [("a dog", "개"), ("a cat", "고양이")]
    with pytest.raises(DataError, match="no translation unit holds both 'en' and 'ko-KP'"):  # a region: its own only
        list(tmx_pairs(korean, "en", "ko-KP"))
    # Chinese's members are other languages: zh reads zh-CN beside yue-HK, and never yue or lzh alone
    chinese = tmp_path / "zh.tmx"
    chinese.write_text('<?xml version="1.0" encoding="UTF-8"?>\n<tmx version="1.4"><header/><body>\n'
                       + unit(("en", "a dog"), ("zh-CN", "一只狗"), ("yue-HK", "一隻狗"))
                       + unit(("en", "a cat"), ("lzh", "貓")) + "</body></tmx>\n", encoding="utf-8")
    assert list(tmx_pairs(chinese, "en", "zh")) == [("a dog", "一只狗"), ("", "")]


def _memory(*units: tuple[str, str]) -> str:
    """A TMX file of one unit per (English, French) segment markup."""
    body = "".join(f'<tu><tuv xml:lang="en"><seg>{en}</seg></tuv><tuv xml:lang="fr"><seg>{fr}</seg></tuv></tu>\n'
                   for en, fr in units)
    return f'<?xml version="1.0" encoding="UTF-8"?>\n<tmx version="1.4"><header/><body>\n{body}</body></tmx>\n'


def test_sub_flow_text_inside_a_native_code_is_kept(tmp_path: Path) -> None:
    """<sub> inside <ph>, <bpt>, <it> or <ut> is text where it stands; the code around it is
    not, nor a code inside the <sub>; the depth outside is restored when the <sub> ends."""
    path = tmp_path / "train.tmx"
    path.write_text(_memory(
        ('See<ph x="1">&lt;fn text="<sub>a footnote</sub>"/&gt;</ph> here.',
         'Voir<ph x="1">{fn:<sub>une note</sub>}</ph> ici.'),
        ('A <bpt i="1">&lt;a title="<sub>the <hi>title</hi></sub>"&gt;</bpt>link<ept i="1">&lt;/a&gt;</ept>.',
         'Un <it pos="begin">&lt;a title="<sub>le <ph>{x}</ph>titre</sub>"&gt;</it>lien.'),
        ('<ut>{<sub>one</sub> code <sub>two</sub> code}</ut> end',
         '<bpt i="1"><sub>un <bpt i="2">[<sub>deux</sub>]</bpt> trois</sub> code</bpt>fin'),
    ), encoding="utf-8")
    assert list(tmx_pairs(path, "en", "fr")) == [
        ("See a footnote here.", "Voir une note ici."),
        ("A the title link.", "Un le titre lien."),
        ("one two end", "un deux trois fin"),
    ]


def test_white_space_runs_collapse_but_a_no_break_space_stays(tmp_path: Path) -> None:
    path = tmp_path / "train.tmx"
    path.write_text(_memory(("  Two\t\tspaces  <ph>{1}</ph>  here &#13;&#10; now. ",
                             "Deux espaces\u00a0: ici\u00a0\u00a0!")), encoding="utf-8")
    assert list(tmx_pairs(path, "en", "fr")) == [("Two spaces here now.", "Deux espaces\u00a0: ici\u00a0\u00a0!")]
    # at a segment's ends too: only XML's spaces are stripped (str.strip took every Unicode space)
    path.write_text(_memory((" x&#160; ", "\u3000y\u2028")), encoding="utf-8")
    assert list(tmx_pairs(path, "en", "fr")) == [("x\u00a0", "\u3000y\u2028")]


@pytest.mark.parametrize("damage, detail", [
    (lambda data: data[:10] + b"\xff" * 200, "invalid"),  # junk after a gzip header
    (lambda data: data[:-30], "Compressed file ended before the end-of-stream marker was reached"),
    (lambda data: MEMORY.encode(), "Not a gzipped file (b'<?')"),  # plain XML named .tmx.gz
], ids=["junk", "truncated", "not-gzip"])
def test_a_corrupt_gzipped_memory_is_one_line_naming_the_file(tmp_path: Path, damage, detail: str) -> None:
    """The same message as any other gzipped text (mtcli.data.textio.read_errors_named)."""
    path = tmp_path / "train.tmx.gz"
    path.write_bytes(damage(gzip.compress(MEMORY.encode())))
    with pytest.raises(DataError) as caught:
        list(open_source(str(tmp_path), "en", "fr").pairs("train"))
    message = str(caught.value)
    assert message.startswith(f"{path}: corrupt gzip data (") and detail in message and "\n" not in message


def test_a_validation_split_stops_at_a_unit_without_the_pair(tmp_path: Path) -> None:
    path = tmp_path / "valid.tmx"
    path.write_text(MEMORY, encoding="utf-8")
    with pytest.raises(DataError, match=r"valid.tmx:10: a translation unit without a 'fr' segment \(its languages: de, "
                                        r"en\); a validation"):
        list(tmx_pairs(path, "en", "fr", verbatim=True))


def test_utf16_with_its_byte_order_mark_and_gzip_are_read(tmp_path: Path) -> None:
    plain = tmp_path / "plain.tmx"
    plain.write_text(MEMORY, encoding="utf-8")
    utf16 = tmp_path / "utf16.tmx.gz"
    utf16.write_bytes(gzip.compress(MEMORY.replace('encoding="UTF-8"', 'encoding="UTF-16"').encode("utf-16")))
    assert list(tmx_pairs(utf16, "en", "fr")) == list(tmx_pairs(plain, "en", "fr"))


@pytest.mark.parametrize("declared", ["Shift_JIS", "GB2312", "Big5", "UTF8", "utf8", "windows-1252"])
def test_an_encoding_its_declaration_names_is_read(tmp_path: Path, declared: str) -> None:
    """expat reads UTF-8, UTF-16 and ISO-8859-1 itself: Shift_JIS or GB2312 (an old memory's)
    was a ValueError traceback ("multi-byte encodings are not supported"), and UTF-8 declared
    as "UTF8" failed at its first non-ASCII character ("invalid token")."""
    text = {"Shift_JIS": "こんにちは、世界", "GB2312": "你好，世界", "Big5": "你好，世界"}.get(declared, "Grüße, café")
    memory = MEMORY.replace('encoding="UTF-8"', f'encoding="{declared}"').replace("Nur Deutsch.", text)
    memory = memory if declared in ("UTF8", "utf8", "windows-1252") else memory.replace("é", "e")  # (no é in them)
    path = tmp_path / "memory.tmx"
    path.write_bytes(memory.encode("utf-8" if declared.lower().startswith("utf") else declared))
    assert list(tmx_pairs(path, "de", "en")) == [("", ""), (text, "English only."), ("", "")]


def test_an_encoding_that_cannot_be_read_is_one_line(tmp_path: Path) -> None:
    """An unknown name was a LookupError traceback; a UTF-16 file with its byte-order mark that
    declares "Unicode" (as some Windows tools write it) was one too."""
    path = tmp_path / "memory.tmx"
    path.write_text(MEMORY.replace('encoding="UTF-8"', 'encoding="utf-9"'), encoding="utf-8")
    with pytest.raises(DataError, match=r"memory.tmx: its XML declaration names the encoding 'utf-9', which Python "
                                        "does not know; convert the file to UTF-8"):
        list(tmx_pairs(path, "de", "en"))
    path.write_bytes(MEMORY.replace('encoding="UTF-8"', 'encoding="Unicode"').encode("utf-16"))
    assert list(tmx_pairs(path, "de", "en"))[1] == ("Nur Deutsch.", "English only.")
    path.write_bytes(MEMORY.replace('encoding="UTF-8"', 'encoding="GB2312"').encode("ascii", "replace")
                     .replace(b"Nur Deutsch.", b"\xff\xfe"))  # bytes that are no GB2312
    with pytest.raises(DataError, match=r"memory.tmx: not gb2312 text, as its XML declaration says"):
        list(tmx_pairs(path, "de", "en"))
    path.write_bytes(MEMORY.replace("Nur Deutsch.", "caf\u00e9").encode("cp1252"))  # says UTF-8
    with pytest.raises(DataError, match=r"memory.tmx:\d+: not a well-formed TMX file \(not well-formed \(invalid "
                                        r"token\), column \d+\); bytes not in the encoding its declaration names"):
        list(tmx_pairs(path, "de", "en"))


def test_malformed_xml_and_a_file_without_the_pair_are_one_line_each(tmp_path: Path) -> None:
    broken = tmp_path / "broken.tmx"
    broken.write_text(MEMORY.replace("</tu>", "", 1), encoding="utf-8")
    with pytest.raises(DataError, match=r"broken.tmx:\d+: not a well-formed TMX file \(mismatched tag, column \d+\)"):
        list(tmx_pairs(broken, "en", "fr"))
    # an HTML entity: an error, and also under a DOCTYPE (a CAT tool's), where its text was dropped unsaid
    for doctype in ("", '<!DOCTYPE tmx SYSTEM "tmx14.dtd">\n'):
        entity = tmp_path / "entity.tmx"
        entity.write_text(MEMORY.replace("<tmx", f"{doctype}<tmx", 1).replace("</seg>", "&nbsp;x</seg>", 1),
                          encoding="utf-8")
        with pytest.raises(DataError, match=r"entity.tmx:\d+: not a well-formed TMX file \(undefined entity"):
            list(tmx_pairs(entity, "en", "fr"))
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


def test_an_entity_of_another_files_text_is_refused_not_dropped(tmp_path: Path) -> None:
    """<!ENTITY x SYSTEM "file:..."> in the file's own DOCTYPE: never read (good), but its place
    in the segment was dropped unsaid, in a test split too."""
    (tmp_path / "secret.txt").write_text("secret", encoding="utf-8")
    doctype = f'<!DOCTYPE tmx [<!ENTITY x SYSTEM "file://{tmp_path}/secret.txt">]>\n'
    outside = tmp_path / "outside.tmx"
    outside.write_text(MEMORY.replace("<tmx", f"{doctype}<tmx", 1).replace("</seg>", " &x; end</seg>", 1),
                       encoding="utf-8")
    with pytest.raises(DataError, match=r"outside.tmx:\d+: not a TMX file mtcli reads \(an entity whose text is in "
                                        r"another file, file://.*secret.txt, column \d+\): write its text itself"):
        list(tmx_pairs(outside, "en", "fr", verbatim=True))
