"""What mtcli knows about a language from its code: where spaces do not separate its words.

Four places treat such languages differently, each as the tool it follows does:

* cleaning (:mod:`mtcli.data.cleaning`) measures Chinese, Japanese, Thai, Lao, Khmer, Burmese,
  Tibetan and Dzongkha text in characters, not words, as OpusFilter's length filters do with
  ``unit: char``: a whole unspaced sentence (or phrase: the spaces of Thai or Burmese, where
  there are any, part phrases) would otherwise count as one word and fail the length-ratio
  rule against any longer English one (sacreBLEU's ``zh`` tokeniser, too, counts a Chinese
  character as a word);
* SentencePiece covers 99.95% of the characters of Chinese and Japanese rather than all of them (its own advice for
  languages with rich character sets), so that thousands of rare characters do not take the
  vocabulary (:func:`default_character_coverage`);
* BLEU tokenises a Chinese, Japanese or Korean target as sacreBLEU's ``-l`` does
  (:mod:`mtcli.metrics`);
* SentencePiece keeps a target's text as written (``identity``) rather than NFKC-normalise it
  where that rewrites the language's ordinary text into what no reference holds
  (:func:`default_normalization`): Chinese and Japanese full-width punctuation (``，！（）``)
  becomes ASCII, Thai and Lao SARA AM (``ำ``, ``ຳ``) two other characters, Korean's
  compatibility jamo (``ㅋㅠ``) other jamo or syllables, and SentencePiece's ``nmt_nfkc`` turns the
  zero-width non-joiner of Persian and Central Kurdish words into a space, splitting them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import langcodes

#: ISO 639 codes that mean Chinese (the macrolanguage ``zho``/``chi`` and its members, Literary
#: Chinese ``lzh`` too: all written in Han characters without spaces); langcodes makes ``zh`` of
#: ``zho``, ``chi`` and ``cmn`` alone
_CHINESE = ("zho", "chi", "cmn", "yue", "wuu", "hak", "nan", "gan", "hsn", "cdo", "cjy", "cpx", "czh", "czo",
            "mnp", "lzh")
#: Languages written without spaces between words, measured in characters by the cleaning rules.
CHARACTER_LANGUAGES = ("zh", "ja", "th", "lo", "km", "my", "bo", "dz")
#: Those of them with thousands of characters (Han, kana), whose full-width punctuation NFKC turns into ASCII.
RICH_SCRIPT_LANGUAGES = ("zh", "ja")
#: Targets whose ordinary text SentencePiece's NFKC rewrites (module docstring): kept as written.
AS_WRITTEN_LANGUAGES = (*RICH_SCRIPT_LANGUAGES, "th", "lo", "ko", "fa", "ckb")
#: SentencePiece's character coverage for a vocabulary that holds such a language (1.0 otherwise).
RICH_SCRIPT_COVERAGE = 0.9995


@functools.cache
def language_code(lang: str | None) -> str:
    """``lang``'s language as its shortest ISO 639 code (langcodes' standard form): ``deu``,
    ``ger``, ``de-AT`` -> ``de``; ``jpn_Jpan`` -> ``ja``; ``iw`` -> ``he``; ``zh_TW``, ``zh-Hans``,
    ``cmn``, ``wuu``, ``lzh`` -> ``zh`` (all written in Han characters); a code langcodes does not
    know as it is, lowercased; ``""`` for None."""
    code = (lang or "").lower().replace("_", "-").split("-")[0]
    if code in _CHINESE:
        return "zh"
    try:
        return langcodes.standardize_tag(code, macro=True)
    except (langcodes.LanguageTagError, ValueError):  # not a language subtag (a one-letter name)
        return code


@functools.cache
def standard_tag(lang: str) -> str:
    """``lang`` in langcodes' standard form, region and script kept where they say something:
    ``deu`` -> ``de``, ``fra_Latn`` -> ``fr`` (Latin is French's script), ``pt_br`` -> ``pt-BR``,
    ``zh-hant`` -> ``zh-Hant``; a tag langcodes cannot read, as it is."""
    try:
        return langcodes.standardize_tag(lang.replace("_", "-"), macro=True)
    except (langcodes.LanguageTagError, ValueError):
        return lang


def known_code(lang: str) -> bool:
    """Whether langcodes knows ``lang`` as a language tag (``zn``, a typo of ``zh``, it does not)."""
    return langcodes.tag_is_valid(lang.replace("_", "-"))


def same_language(code: str, other: str) -> bool:
    """Whether two codes without a region are one language's (``kor`` and ``ko``, ``ger`` and
    ``de``): Chinese's members aside (``yue`` and ``lzh`` are not ``zh``, though BLEU and
    cleaning treat them alike)."""
    code, other = code.lower(), other.lower()
    return code == other or (code not in _CHINESE and other not in _CHINESE and language_code(code) == language_code(other))


def measured_in_characters(lang: str | None) -> bool:
    """Whether the cleaning rules measure text in ``lang`` in characters, not words."""
    return language_code(lang) in CHARACTER_LANGUAGES


def default_character_coverage(langs: Iterable[str]) -> float:
    """``data.character_coverage`` when a config does not set it: 0.9995 when one of ``langs``
    is Chinese or Japanese, else 1.0."""
    return RICH_SCRIPT_COVERAGE if any(language_code(lang) in RICH_SCRIPT_LANGUAGES for lang in langs) else 1.0


def default_normalization(target_langs: Iterable[str]) -> str:
    """``data.spm_normalization`` when a config does not set it: ``identity`` when one of
    ``target_langs`` is one of :data:`AS_WRITTEN_LANGUAGES` (a model then writes their text as
    the references do), else SentencePiece's own ``nmt_nfkc``."""
    return "identity" if any(language_code(lang) in AS_WRITTEN_LANGUAGES for lang in target_langs) else "nmt_nfkc"
