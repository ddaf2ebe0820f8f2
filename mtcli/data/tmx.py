"""``<split>.tmx[.gz]``: a translation memory as a split of a text directory.

TMX is the exchange format of translation tools (a CAT tool's memory exports to it) and one of
OPUS's downloads. Each translation unit (``<tu>``) holds a variant (``<tuv xml:lang="...">``) a
language, its text in ``<seg>``; a file may hold many languages. A unit gives the pair of its
``data.src_lang`` and ``data.tgt_lang`` variants. A language matches a variant's ``xml:lang``
exactly or by its first subtag, case aside: ``en`` reads ``en-GB`` and ``EN``. A unit with an
exact match reads it; one with several variants and none exact (``zh-CN`` and ``zh-TW`` for
``zh``) is read from neither (an error naming its line in a validation or test split, a dropped
unit in training, warned of), so that two varieties are never mixed unseen.

Inline markup is read as TMX means it: the text inside ``<hi>`` is the sentence's; the native
codes inside ``<bpt>``, ``<ept>``, ``<it>``, ``<ph>`` and ``<ut>`` are not, but a ``<sub>``
inside a code (a sub-flow: a footnote, a link's title) is text again, kept where it stands and set
off by a space on each side (a flow of its own: ``See<ph>{fn:<sub>a note</sub>}</ph> here`` reads
``See a note here``).
XML white space (spaces, tabs, line breaks: a file's indentation, and what a removed code leaves)
is collapsed to one space a run, and a segment's ends are stripped; other spaces (a no-break
space) stay as they are.

A unit without one of the two languages is an empty pair: a training split drops and counts it
in cleaning, with a warning at the end; a validation or test split (``verbatim``), which keeps
every unit, stops at it, naming its line. A file none of whose units holds the pair says which
languages it has. The file is parsed as it streams (expat, from the standard library: UTF-8, or
with its byte-order mark UTF-16, or any encoding its XML declaration names that Python knows,
Shift_JIS or GB2312 say, decoded into UTF-8 first), so its size does not matter.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from xml.parsers import expat

from mtcli.data.textio import open_binary, read_errors_named
from mtcli.errors import DataError
from mtcli.languages import same_language
from mtcli.logs import get_logger

#: Elements whose text is a native code (formatting of the tool that wrote the file), not words.
_CODES = frozenset({"bpt", "ept", "it", "ph", "ut"})

_READ_BYTES = 1 << 20

#: A run of XML white space (``S`` of the XML spec), collapsed to one space in a segment.
_XML_SPACE = re.compile(r"[ \t\r\n]+")


def _segment(unit: dict[str, str], lang: str, where: str) -> str | None:
    """The text of ``unit``'s variant in ``lang``: the one whose ``xml:lang`` is ``lang``, else
    the one variant of it (a region, a script; else its other code, ``ko-KR`` or ``kor`` for
    ``ko``, :func:`~mtcli.languages.same_language`); None when there is none. Several variants and
    none exactly ``lang`` (``zh-CN`` and ``zh-TW`` for ``zh``) is a :class:`DataError` naming
    ``where``: one would be taken at random."""
    wanted = lang.lower().replace("_", "-")
    named = {variant: variant.lower().replace("_", "-") for variant in unit}
    exact = [v for v, n in named.items() if n == wanted]
    if exact:
        return unit[exact[0]]
    near = [v for v, n in named.items() if n.split("-", 1)[0] == wanted]
    if not near and "-" not in wanted:  # its other code mtcli knows (kor: ko-KR; ko: kor)
        near = [v for v, n in named.items() if same_language(n.split("-", 1)[0], wanted)]
    if len(near) > 1:
        raise DataError(f"{where}: a translation unit holds several '{lang}' variants ({', '.join(near)}); "
                        "name the one to read as the language (e.g. data.tgt_lang)")
    return unit[near[0]] if near else None


class _Units:
    """expat's callbacks over a TMX file: the finished units as ``{xml:lang: text}`` with the
    line each began on."""

    def __init__(self, parser: expat.XMLParserType, path: Path) -> None:
        self.parser, self.path = parser, path
        self.done: list[tuple[int, dict[str, str]]] = []
        self.unit: dict[str, str] | None = None
        self.line = 0
        self.lang = ""
        self.text: list[str] | None = None  # inside a <seg>
        self.codes = 0  # depth inside native codes, within the innermost <sub> (or the <seg>)
        self.outer: list[int] = []  # the code depths around each open <sub>
        parser.StartElementHandler = self.start
        parser.EndElementHandler = self.end
        parser.CharacterDataHandler = self.characters
        parser.SkippedEntityHandler = self.skipped
        parser.ExternalEntityRefHandler = self.external

    def external(self, context: str | None, base: str | None, system_id: str | None, public_id: str | None) -> int:
        """An entity whose text is another file's (``<!ENTITY x SYSTEM "file:...">``): never
        read, and its place in the text not dropped unsaid."""
        raise DataError(f"{self.path}:{self.parser.CurrentLineNumber}: not a TMX file mtcli reads (an entity whose "
                        f"text is in another file, {system_id}, column {self.parser.CurrentColumnNumber + 1}): "
                        "write its text itself")

    def skipped(self, name: str, is_parameter_entity: bool) -> None:
        """An entity no declaration read defines (``&nbsp;`` under a DOCTYPE whose DTD expat does
        not read): its text would be dropped, unsaid, as it is an error without a DOCTYPE."""
        if is_parameter_entity:  # the DTD's own, not text
            return
        raise DataError(f"{self.path}:{self.parser.CurrentLineNumber}: not a well-formed TMX file (undefined entity "
                        f"&{name};, column {self.parser.CurrentColumnNumber + 1}; its DOCTYPE's DTD is not read): "
                        "write the character itself")

    def start(self, name: str, attrs: dict[str, str]) -> None:
        if name == "tu":
            self.unit, self.line = {}, self.parser.CurrentLineNumber
        elif name == "tuv":
            self.lang = attrs.get("xml:lang") or attrs.get("lang") or ""
        elif name == "seg":
            self.text, self.codes, self.outer = [], 0, []
        elif name in _CODES and self.text is not None:
            self.codes += 1
        elif name == "sub" and self.text is not None:
            self.outer.append(self.codes)  # a sub-flow: text again, even inside a code
            self.codes = 0
            self.text.append(" ")

    def end(self, name: str) -> None:
        if name == "seg" and self.text is not None and self.unit is not None:
            text = "".join(self.text)
            if "  " in text or "\n" in text or "\t" in text or "\r" in text:  # most segments need nothing
                text = _XML_SPACE.sub(" ", text)
            self.unit.setdefault(self.lang, text.strip(" "))  # XML's spaces are one space by now
            self.text = None
        elif name in _CODES and self.text is not None:
            self.codes -= 1
        elif name == "sub" and self.text is not None and self.outer:
            self.codes = self.outer.pop()
            self.text.append(" ")
        elif name == "tu" and self.unit is not None:
            self.done.append((self.line, self.unit))
            self.unit = None

    def characters(self, data: str) -> None:
        if self.text is not None and not self.codes:
            self.text.append(data)


def tmx_units(path: Path) -> Iterator[tuple[int, dict[str, str]]]:
    """The translation units of the TMX file ``path``: the line each begins on and its
    segments by ``xml:lang``. Malformed XML raises :class:`DataError` naming line and column."""
    parser: Any = None
    units: _Units | None = None
    try:
        with read_errors_named(path), open_binary(path) as handle:
            chunk = handle.read(_READ_BYTES)
            override, decoder = _reading(path, chunk)
            parser = expat.ParserCreate(override)
            units = _Units(parser, path)
            while chunk:
                parser.Parse(decoder.decode(chunk).encode("utf-8") if decoder else chunk, False)
                yield from units.done
                units.done.clear()
                chunk = handle.read(_READ_BYTES)
            parser.Parse(decoder.decode(b"", final=True).encode("utf-8") if decoder else b"", True)
    except expat.ExpatError as exc:
        hint = ("; bytes not in the encoding its declaration names (UTF-8 if none)? convert it to that"
                if exc.code == expat.errors.codes[expat.errors.XML_ERROR_INVALID_TOKEN] else "")
        raise DataError(f"{path}:{exc.lineno}: not a well-formed TMX file ({expat.ErrorString(exc.code)}, "
                        f"column {exc.offset + 1}){hint}") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not {exc.encoding} text, as its XML declaration says ({exc.reason} at a byte "
                        f"{exc.object[exc.start]:#04x}); convert it to UTF-8") from None
    if units is not None:
        yield from units.done


#: Encodings expat reads itself; any other a file declares is decoded by Python's codec into UTF-8.
_EXPAT_ENCODINGS = ("utf-8", "utf-16", "utf-16-le", "utf-16-be", "iso8859-1", "ascii")


def _reading(path: Path, head: bytes) -> tuple[str | None, Any]:
    """How to parse a TMX file that starts with ``head``: the encoding to tell expat instead of
    the one its XML declaration names (None: the declared one), and a Python decoder to turn its
    bytes into UTF-8 first (None: expat reads them). expat knows UTF-8, UTF-16 and ISO-8859-1
    only; an old memory may declare Shift_JIS, GB2312 or Big5, or name UTF-8 ``UTF8``."""
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):  # whatever its declaration says ("Unicode")
        return "UTF-16", None
    declared = re.match(rb"(?:\xef\xbb\xbf)?\s*<\?xml[^>]*?encoding\s*=\s*[\"']([A-Za-z0-9._:-]+)[\"']", head)
    if declared is None:
        return None, None
    name = declared[1].decode("ascii")
    try:
        codec = codecs.lookup(name).name
    except LookupError:
        raise DataError(f"{path}: its XML declaration names the encoding '{name}', which Python does not know; "
                        "convert the file to UTF-8 (and declare that)") from None
    if codec in _EXPAT_ENCODINGS:
        return ("UTF-8" if codec == "utf-8" else None), None
    return "UTF-8", codecs.getincrementaldecoder(codec)()


def tmx_pairs(path: Path, src_lang: str, tgt_lang: str, verbatim: bool = False) -> Iterator[tuple[str, str]]:
    """The (source, target) pairs of the TMX file ``path`` (see the module docstring)."""
    missing, first_missing, pairs, seen, unsure = 0, 0, 0, set(), None
    for line, unit in tmx_units(path):
        try:
            src, tgt = _segment(unit, src_lang, f"{path}:{line}"), _segment(unit, tgt_lang, f"{path}:{line}")
        except DataError as exc:  # several variants, none exact: a training split drops the unit
            if verbatim:
                raise
            src = tgt = None
            unsure = unsure or str(exc)
        if src is None or tgt is None:
            lacking = src_lang if src is None else tgt_lang
            if verbatim:
                raise DataError(f"{path}:{line}: a translation unit without a '{lacking}' segment (its languages: "
                                f"{', '.join(sorted(unit)) or 'none'}); a validation or test split keeps every unit: "
                                "mend the file")
            seen.update(unit)
            missing, first_missing = missing + 1, first_missing or line
            yield "", ""
            continue
        pairs += 1
        yield src, tgt
    if missing and not pairs:
        found = ", ".join(sorted(seen)) or "none"
        raise DataError(f"{path}: no translation unit holds both '{src_lang}' and '{tgt_lang}' "
                        f"(the languages of its units: {found})")
    if missing:
        get_logger().warning("%s: %d translation unit(s) lacking the '%s' or the '%s' segment (the first: line %d), "
                             "read as empty pairs%s", path, missing, src_lang, tgt_lang, first_missing,
                             f"; among them, {unsure}" if unsure else "")
