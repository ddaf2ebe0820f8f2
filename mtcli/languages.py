"""What mtcli knows about a language from its code: where spaces do not separate its words.

Three places treat such languages differently, each as the tool it follows does:

* cleaning (:mod:`mtcli.data.cleaning`) measures Chinese and Japanese text in characters, not
  words, as OpusFilter's length filters do with ``unit: char``: a whole unspaced sentence would
  otherwise count as one word and fail the length-ratio rule against any longer English one
  (sacreBLEU's ``zh`` tokeniser, too, counts a Chinese character as a word);
* SentencePiece covers 99.95% of their characters rather than all of them (its own advice for
  languages with rich character sets), so that thousands of rare characters do not take the
  vocabulary (:func:`default_character_coverage`);
* BLEU tokenises a Chinese, Japanese or Korean target as sacreBLEU's ``-l`` does
  (:mod:`mtcli.metrics`);
* SentencePiece keeps a Chinese or Japanese target's text as written (``identity``) rather than
  NFKC-normalise it, which turns their full-width punctuation (``，！（）``) into ASCII that no
  reference holds (:func:`default_normalization`).
"""

from __future__ import annotations

from collections.abc import Iterable

#: ISO 639 codes that mean Chinese (the macrolanguage ``zho``/``chi`` and its members, Literary
#: Chinese ``lzh`` too: all written in Han characters without spaces), Japanese and Korean
_CHINESE = ("zho", "chi", "cmn", "yue", "wuu", "hak", "nan", "gan", "hsn", "cdo", "cjy", "cpx", "czh", "czo",
            "mnp", "lzh")
_ALIASES = {**dict.fromkeys(_CHINESE, "zh"), "jpn": "ja", "kor": "ko"}
#: Languages written without spaces between words, measured in characters by the cleaning rules.
CHARACTER_LANGUAGES = ("zh", "ja")
#: SentencePiece's character coverage for a vocabulary that holds such a language (1.0 otherwise).
RICH_SCRIPT_COVERAGE = 0.9995


def language_code(lang: str | None) -> str:
    """``lang`` as its two-letter code: ``zh_TW``, ``zh-Hans``, ``cmn``, ``wuu``, ``lzh`` ->
    ``zh``; ``jpn`` -> ``ja``; ``""`` for None."""
    code = (lang or "").lower().replace("_", "-").split("-")[0]
    return _ALIASES.get(code, code)


def measured_in_characters(lang: str | None) -> bool:
    """Whether the cleaning rules measure text in ``lang`` in characters, not words."""
    return language_code(lang) in CHARACTER_LANGUAGES


def default_character_coverage(langs: Iterable[str]) -> float:
    """``data.character_coverage`` when a config does not set it: 0.9995 when one of ``langs``
    is Chinese or Japanese, else 1.0."""
    return RICH_SCRIPT_COVERAGE if any(measured_in_characters(lang) for lang in langs) else 1.0


def default_normalization(target_langs: Iterable[str]) -> str:
    """``data.spm_normalization`` when a config does not set it: ``identity`` when one of
    ``target_langs`` is Chinese or Japanese (a model then writes their full-width punctuation
    as the references do), else SentencePiece's own ``nmt_nfkc``."""
    return "identity" if any(measured_in_characters(lang) for lang in target_langs) else "nmt_nfkc"
