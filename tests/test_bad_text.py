"""Bad text: property-based tests (hypothesis) of reading, translating and preparing
random Unicode, control characters, invalid UTF-8, empty lines, 10,000-character lines and mixed
line endings. Translation never crashes and keeps the line count; invalid UTF-8 is one clear
error naming file and line; `prepare` builds a cache or raises one clear DataError.

Line endings, the same for every reader (prepare: ``mtcli.corpus.read_lines``; translate and
evaluate: ``mtcli.data.textio.iter_binary_lines``): only ``\\n`` ends a line, ``\\r\\n`` counts as
``\\n``, a lone ``\\r`` (an old-Mac ending or a stray byte) stays inside its line as a space, and
other Unicode separators (U+0085, U+2028, U+2029, form feed...) stay inside the line as they are.

Each example runs on a tiny random model (the session's ``tiny_run_dir``, never modified) and
calls library functions directly; one `mtcli translate` subprocess covers the command itself.
"""

from __future__ import annotations

import dataclasses
import io
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import REPO, TOY_CONFIG, TOY_DIR
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from mtcli.config import load_config
from mtcli.data.cache import PreparedCorpus
from mtcli.data.textio import is_utf8, iter_binary_lines, read_lines
from mtcli.errors import DataError
from mtcli.infer.files import translate_files
from mtcli.infer.translate import translate_lines
from tests.utf8_cases import python_utf8, short_utf8_samples

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    database=None,  # nothing written into the repository; failures print their example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

WORDS = sorted(set((TOY_DIR / "train.src").read_text(encoding="utf-8").split()))
#: Any code point but surrogates (not encodable) and \n (the line break itself).
ANY_CHAR = st.characters(blacklist_categories=("Cs",), blacklist_characters="\n")
ODD_CHARS = [chr(c) for c in range(0x20) if c != 0x0A] + [
    "\x7f", "\x85", "\xa0", "\u2028", "\u2029", "\ufeff", "\u200b", "\u200d", "\u3000", "\ufffd",
    "\U0001f408", "\u0301", "\U0010ffff",
]
WORD = st.sampled_from(WORDS)
ODD = st.sampled_from(ODD_CHARS)
SHORT_LINE = st.text(ANY_CHAR, max_size=40)
MIXED_LINE = st.lists(st.one_of(WORD, ODD, st.text(ANY_CHAR, min_size=1, max_size=3)), max_size=12).map(" ".join)
LONG_LINE = st.builds(
    lambda unit, sep: ((unit + sep) * 10_000)[:10_000], st.one_of(WORD, st.text(ANY_CHAR, min_size=1, max_size=6)),
    st.sampled_from(["", " "]),
)
BLANK_LINE = st.sampled_from(["", " ", "\t", "\r", " \u3000 ", "\x0b\x0c"])
LINE = st.one_of(SHORT_LINE, MIXED_LINE, BLANK_LINE, LONG_LINE, WORD)
ENDING = st.sampled_from(["\n", "\r\n"])

#: Byte sequences that are never valid UTF-8, whatever valid text surrounds them.
INVALID_UTF8 = st.sampled_from([
    b"\xff", b"\xfe", b"\x80", b"\xbf", b"\xc3\x28", b"\xc0\xaf", b"\xe2\x82", b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80", b"\xf0\x9f\x90",
])


def encode_lines(lines: list[str], endings: list[str], final: bool) -> bytes:
    """``lines`` joined with the given endings (cycled); the last one ended only if ``final``."""
    return encode_and_expect(lines, endings, final)[0]


def encode_and_expect(lines: list[str], endings: list[str], final: bool) -> tuple[bytes, list[str]]:
    """The bytes of :func:`encode_lines` and the lines any mtcli reader must make of them: one
    ``\\r`` right before ``\\n`` belongs to the ending, every other ``\\r`` becomes a space, a
    leading byte-order mark is dropped, an unterminated empty last line is no line."""
    parts, expected = [], []
    for i, line in enumerate(lines):
        ending = "" if i == len(lines) - 1 and not final else endings[i % len(endings)]
        parts.append(line + ending)
        if ending == "" and line == "":
            continue
        text = line[:-1] if ending == "\n" and line.endswith("\r") else line
        expected.append(text.replace("\r", " "))
    if expected and expected[0].startswith("\ufeff"):
        expected[0] = expected[0][1:]
    return "".join(parts).encode("utf-8"), expected


# ----------------------------------------------------------------------------- reading


@SETTINGS
@given(
    lines=st.lists(st.one_of(SHORT_LINE, MIXED_LINE, BLANK_LINE), max_size=8),
    endings=st.lists(ENDING, min_size=1, max_size=3),
    final=st.booleans(),
)
@example(lines=["\r\r"], endings=["\n"], final=False)  # a text of one line with two \r: classic Mac OS ends
def test_translate_and_prepare_read_lines_alike(lines: list[str], endings: list[str], final: bool) -> None:
    """Mixed \\n / \\r\\n, lone \\r, odd separators: translate's reader and prepare's reader give
    the same lines, as many as there are \\n-separated lines, or both refuse a text of one line
    with more than one \\r (its lines end in a lone \\r, mtcli.data.textio.refuse_lone_cr_ends)."""
    data, expected = encode_and_expect(lines, endings, final)
    body = data.removesuffix(b"\n").removesuffix(b"\r") if data.endswith(b"\r\n") else data.removesuffix(b"\n")
    mac = b"\n" not in body and body.count(b"\r") > 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "in.txt"
        path.write_bytes(data)
        if mac:
            for read in (lambda: list(iter_binary_lines(io.BytesIO(data), "in.txt")), lambda: list(read_lines(path))):
                with pytest.raises(DataError, match="its lines end in a lone"):
                    read()
            return
        got = list(iter_binary_lines(io.BytesIO(data), "in.txt"))
        assert got == expected
        assert list(read_lines(path)) == got


@SETTINGS
@given(
    before=st.lists(st.one_of(SHORT_LINE, MIXED_LINE, BLANK_LINE), max_size=6),
    bad=INVALID_UTF8,
    prefix=SHORT_LINE,
    suffix=SHORT_LINE,
    after=st.lists(SHORT_LINE, max_size=3),
    endings=st.lists(ENDING, min_size=1, max_size=2),
)
def test_invalid_utf8_is_one_error_naming_the_line(
    tiny_run_dir: Path, before: list[str], bad: bytes, prefix: str, suffix: str, after: list[str],
    endings: list[str],
) -> None:
    data = encode_lines(before, endings, True) + prefix.encode() + bad + suffix.encode() + b"\n"
    data += encode_lines(after, endings, True)
    lineno = len(before) + 1
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "in.txt", Path(tmp) / "out.txt"
        src.write_bytes(data)
        with pytest.raises(DataError) as info:
            translate_files(tiny_run_dir, [src], out, overrides=["decode.beam_size=1"])
        message = str(info.value)
        assert message.startswith(f"{src}:{lineno}: invalid UTF-8") and "\n" not in message
        assert sorted(p.name for p in Path(tmp).iterdir()) == ["in.txt"]  # no output, no temporary


# ----------------------------------------------------------------------------- translating


@pytest.fixture(scope="module")
def bundle(tiny_run_dir: Path):  # noqa: ANN201
    from mtcli.infer.loading import load_for_inference

    return load_for_inference(tiny_run_dir, "best")


@SETTINGS
@given(lines=st.lists(LINE, max_size=6), window=st.integers(1, 4), beam=st.sampled_from([1, 1, 2]))
@example(lines=["a" * 10_000, "", "\x00\x1b[0m\r\x85", "katze " * 1666, "\u2028"], window=2, beam=1)
def test_translate_lines_never_crashes_and_keeps_line_count(bundle, lines: list[str], window: int, beam: int) -> None:  # noqa: ANN001
    decode = dataclasses.replace(bundle.config.decode, beam_size=beam, nbest=1, max_tokens=2048)
    out = list(translate_lines(bundle, lines, decode, "cpu", window=window))
    assert len(out) == len(lines)
    for line, nbest in zip(lines, out, strict=True):
        assert len(nbest) == 1 and isinstance(nbest[0].text, str)
        assert "\n" not in nbest[0].text and "\r" not in nbest[0].text  # one output line per input line
        if not line.strip():
            assert nbest[0].text == "" and nbest[0].tokens == []
        limit = bundle.config.model.max_positions - 1
        assert nbest[0].source_tokens is None or len(nbest[0].source_tokens) <= limit


def test_cli_translate_keeps_line_count_on_nasty_input(tiny_run_dir: Path) -> None:
    """BOM, \\r\\n and \\n mixed, lone \\r, control characters, 10,000-character lines, odd
    separators, blank lines and no final newline, through `mtcli translate` (stdin to stdout)."""
    lines = [
        "\ufeffeine katze", "", "rot\rblau", "\x00\x01\x1b[31m rot\x7f", "x" * 10_000, "ein " * 2_500,
        "\u2028\u2029\x85\x0b\x0c", "   ", "\ud7ff\U0010ffff\U0001f408 katze", "letzte ohne Zeilenende",
    ]
    data = encode_lines(lines, ["\r\n", "\n", "\n"], final=False)
    res = subprocess.run(
        [sys.executable, "-m", "mtcli.cli", "translate", str(tiny_run_dir), "--beam", "1"],
        input=data, capture_output=True, cwd=REPO, timeout=300,
    )
    err = res.stderr.decode()
    assert res.returncode == 0, err
    # line 5 is one run of characters unknown to the vocabulary: a single <unk> piece
    assert "Traceback" not in err and "line 6: source has" in err and "line 5:" not in err
    out = res.stdout.decode("utf-8")
    assert out.count("\n") == len(lines) and out.endswith("\n")
    rows = out.split("\n")[:-1]
    assert rows[1] == "" and rows[7] == ""


# ----------------------------------------------------------------------------- preparing

TOY_TRAIN = [
    (s, t) for s, t in zip(
        (TOY_DIR / "train.src").read_text(encoding="utf-8").splitlines()[:200],
        (TOY_DIR / "train.tgt").read_text(encoding="utf-8").splitlines()[:200], strict=True,
    )
]


@st.composite
def corpora(draw: st.DrawFn) -> dict[str, bytes]:
    """A text-directory corpus: 200 toy training pairs with random pairs mixed in, random
    val/test splits (sometimes with mismatched line counts or an invalid byte), mixed endings."""
    files: dict[str, bytes] = {}
    pairs = list(TOY_TRAIN)
    for _ in range(draw(st.integers(0, 6))):
        pairs.insert(draw(st.integers(0, len(pairs))), (draw(LINE), draw(LINE)))
    endings = draw(st.lists(ENDING, min_size=1, max_size=2))
    files["train.src"] = encode_lines([s for s, _ in pairs], endings, draw(st.booleans()))
    files["train.tgt"] = encode_lines([t for _, t in pairs], endings, draw(st.booleans()))
    for split in ("val", "test"):
        n = draw(st.integers(1, 5))
        for lang in ("src", "tgt"):
            count = n + (1 if draw(st.integers(0, 9)) == 0 else 0)  # now and then one line too many
            lines = draw(st.lists(LINE, min_size=count, max_size=count))
            files[f"{split}.{lang}"] = encode_lines(lines, endings, True)
    if draw(st.integers(0, 9)) == 0:
        name = draw(st.sampled_from(sorted(files)))
        files[name] = files[name] + draw(INVALID_UTF8) + b"\n"
    return files


def toy_corpus_files() -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in TOY_DIR.iterdir() if p.is_file()}


@SETTINGS
@given(files=corpora())
@example(files=toy_corpus_files())  # always one corpus that prepares
@example(files={**toy_corpus_files(), "val.tgt": b"ok\n\xc3\x28\n"})  # always one that cannot
def test_prepare_gives_a_cache_or_one_data_error(files: dict[str, bytes]) -> None:
    from mtcli.data.prepare import prepare

    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp) / "corpus", Path(tmp) / "prepared"
        source.mkdir()
        for name, data in files.items():
            (source / name).write_bytes(data)
        config = load_config(TOY_CONFIG, [f"data.source={source}", f"data.prepared_dir={out}"])
        try:
            prepare(config)
        except DataError as exc:
            message = str(exc)
            assert message and "\n" not in message
            event("DataError: " + re.sub(r"\S*/\S*|\d+", "#", message)[:60])
            with pytest.raises(DataError):  # nothing a later step would accept
                PreparedCorpus.open(out)
            return
        corpus = PreparedCorpus.open(out, verify=True)
        event("cache built")
        for split in ("val", "test"):  # valid/test splits keep every line, even blank ones
            src_lines = list(read_lines(source / f"{split}.src"))
            assert len(corpus.array(split, "src")) == len(corpus.array(split, "tgt")) == len(src_lines)
            assert list(read_lines(corpus.text_path(split, "src"))) == src_lines
        assert 0 < len(corpus.array("train", "src")) <= len(list(read_lines(source / "train.src")))


def test_is_utf8_agrees_with_python_on_every_short_sequence() -> None:
    """Every 1- and 2-byte sequence, and 3- and 4-byte ones over every lead and second byte
    (overlong forms, surrogates, past U+10FFFF, cut short): the fast check decides as Python."""
    wrong = [raw for raw in short_utf8_samples() if is_utf8(b"ok " + raw + b" ok") != python_utf8(raw)]
    assert not wrong, wrong[:10]


@given(st.binary(max_size=64))
@settings(max_examples=300)
def test_is_utf8_agrees_with_python_on_any_bytes(raw: bytes) -> None:
    assert is_utf8(raw) == python_utf8(raw)
