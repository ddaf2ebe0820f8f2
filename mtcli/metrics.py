"""Corpus scores with sacreBLEU (Post, 2018, "A Call for Clarity in Reporting BLEU Scores").

All on detokenised text:

* **BLEU** with sacreBLEU's defaults (13a tokenisation, cased, exponential smoothing):
  ``BLEU = BP * exp(sum_n 1/4 * log p_n)`` with ``BP = min(1, exp(1 - r/c))``. Where spaces do
  not separate words, 13a would count a whole sentence as one word, so a Chinese, Japanese or
  Korean target is tokenised as sacreBLEU's command line does for it (``zh``, ``ja-mecab``,
  ``ko-mecab``; the last two need MeCab: the ``ja`` or ``ko`` extra), and
  TER splits its characters (``asian_support``, which sacreBLEU applies only with its
  tercom normalisation, so such a TER's signature also says ``norm:yes``);
* **chrF** (Popović, 2015): character n-gram F-score, ``beta = 2``;
* **lowercased BLEU** (``-lc``, BLEU's tokeniser): only for comparison with papers that report it;
* **TER** (Snover et al., 2006), when asked for: edits per reference word, lower is better.

Several references per sentence are several reference streams, as sacreBLEU takes them.

Every score comes with its sacreBLEU signature, so a number in a table says exactly how it was
computed. Used by ``mtcli evaluate`` and by the validation BLEU during training.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sacrebleu.metrics import BLEU, CHRF, TER

from mtcli.errors import ConfigError, DataError, MtcliError, install_advice
from mtcli.languages import language_code, measured_in_characters
from mtcli.logs import get_logger

#: What ``evaluate --metrics`` may name (BLEU and lowercased BLEU are always scored).
METRICS = ("bleu", "chrf", "ter")

#: Lines whose n-grams are held at once while scoring. sacreBLEU's ``corpus_score`` extracts every
#: reference's n-grams before it scores one line (about 50 kB a line for BLEU and chrF together):
#: gigabytes for a test set of 200k lines. Its segment statistics add up, so the corpus is scored
#: a block at a time to the same numbers.
SCORE_BLOCK = 10_000


#: BLEU's tokeniser for the target languages whose words spaces do not separate (13a for the rest)
BLEU_TOKENIZERS = {"zh": "zh", "ja": "ja-mecab", "ko": "ko-mecab"}


#: What :func:`mtcli.data.textio.read_lines` says of a hypothesis or reference file that opens
#: with a byte-order mark: the scores here are of its text without it.
BOM_NOTE = ("opens with a byte-order mark, which mtcli drops; sacreBLEU's command line keeps it, in the "
            "first word: strip it (sed -i '1s/^\\xEF\\xBB\\xBF//') to get these scores there")


def check_one_language(option: str, tgt_lang: str | None) -> None:
    """:class:`ConfigError` for a language pair given as the target's language (sacreBLEU's
    ``-l en-zh``): read as English with a region, it would be scored with 13a, without a word."""
    code, tags = language_code(tgt_lang), (tgt_lang or "").lower().replace("_", "-").split("-")
    if len(tags) > 1 and language_code(tags[1]) in BLEU_TOKENIZERS and code not in BLEU_TOKENIZERS:
        raise ConfigError(f"{option} {tgt_lang!r}: the target's language alone, not a pair (sacreBLEU's -l): as "
                          f"given it is {code} text, scored with 13a; give {tags[1]}")


def scorer(name: str, tgt_lang: str | None = None, *, lowercase: bool = False, instead: str = "") -> BLEU | CHRF | TER:
    """sacreBLEU's metric ``name`` (one of :data:`METRICS`) with its default settings, except
    BLEU's tokeniser and TER's character splitting for a Chinese, Japanese or Korean
    ``tgt_lang`` (see the module docstring). Raises :class:`MtcliError` when the tokeniser's
    package is not installed (its message ends with ``instead``: what else the caller can do)."""
    check_one_language("language", tgt_lang)
    code = language_code(tgt_lang)
    if name == "chrf":
        return CHRF()
    if name == "ter":
        asian = code in BLEU_TOKENIZERS  # sacreBLEU ignores asian_support without normalized
        return TER(normalized=asian, asian_support=asian)
    tokenize = BLEU_TOKENIZERS.get(code, "13a")
    try:  # force: the check for tokenised text is warn_if_tokenised's, once a corpus, not sacreBLEU's each time
        return BLEU(tokenize=tokenize, lowercase=lowercase, force=True)
    except RuntimeError:  # sacreBLEU's MeCab tokenisers import MeCab when made
        raise MtcliError(f"BLEU of '{tgt_lang}' text tokenises it with MeCab ({tokenize}): "
                         f"{install_advice(code)}{instead}") from None


def phrase_bleu_note(tgt_lang: str | None) -> str | None:
    """What BLEU measures of a target in a language written without spaces between words for
    which sacreBLEU has no tokeniser of its own (Thai, Lao, Khmer, Burmese, Tibetan, Dzongkha): 13a splits
    it at its spaces, which part phrases at most, so its "words" are whole phrases and its BLEU
    says little; chrF, of characters, is the score to read. None for any other language."""
    if not measured_in_characters(tgt_lang) or language_code(tgt_lang) in BLEU_TOKENIZERS:
        return None
    return (f"BLEU of '{tgt_lang}' text splits it into words at its spaces (13a), which part phrases in it, not "
            "words: its BLEU counts whole phrases; read chrF")


def metric_names(metrics: Sequence[str]) -> tuple[str, ...]:
    """``metrics`` without repeats, in order; :class:`ConfigError` naming any not in
    :data:`METRICS` (said before a decoding, not after it)."""
    if not metrics:  # (an empty variable, --metrics "": a report without a score)
        raise ConfigError(f"no metric given: name at least one of {', '.join(METRICS)}")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ConfigError(f"unknown metric {', '.join(map(repr, unknown))} (known: {', '.join(METRICS)})")
    return tuple(dict.fromkeys(metrics))


#: How many hypotheses may end in a tokenised period before :func:`warn_if_tokenised` says so (sacreBLEU's own rule)
TOKENISED_LINES = 100


def warn_if_tokenised(hypotheses: Sequence[str], name: str = "hypotheses") -> None:
    """Warn, once, when :data:`TOKENISED_LINES` or more of ``hypotheses`` (``name``: whose) end
    in a tokenised period (``" ."``), as sacreBLEU does: BLEU of tokenised text is not comparable
    to others' BLEU."""
    count = sum(line.endswith(" .") for line in hypotheses)
    if count >= TOKENISED_LINES:
        get_logger().warning("%s: %d of %d lines end in a tokenised period (' .'); BLEU is of detokenised text: "
                             "detokenise them (and their references) for a score others can compare",
                             name, count, len(hypotheses))


def corpus_score(metric: BLEU | CHRF | TER, hypotheses: list[str], references: list[list[str]]) -> Any:
    """``metric.corpus_score(hypotheses, references)``, in the same memory for any number of
    lines: the segment statistics of :data:`SCORE_BLOCK` lines at a time (sacreBLEU's own
    per-segment counts), summed once at the end as ``corpus_score`` sums them."""
    stats: list[Any] = []
    for start in range(0, len(hypotheses), SCORE_BLOCK):
        end = start + SCORE_BLOCK
        stats += metric._extract_corpus_statistics(hypotheses[start:end], [r[start:end] for r in references])
    return metric._aggregate_and_compute(stats)


def score(hypotheses: list[str], references: list[str], *, more_references: Sequence[list[str]] = (),
          metrics: Sequence[str] = ("bleu", "chrf"), tgt_lang: str | None = None) -> dict[str, Any]:
    """Corpus scores of ``hypotheses`` against ``references`` (and ``more_references``: further
    reference streams, one line per hypothesis each), both in ``tgt_lang`` (which picks BLEU's
    tokeniser, see :func:`scorer`).

    The metrics ``metrics`` names: BLEU with lowercased BLEU (``bleu``, ``bleu_lc``, floats
    0-100), chrF and TER (``chrf``, ``ter``; lower TER is better). Each with its signature as
    ``<metric>_signature`` (also grouped under ``signatures``), and BLEU's details
    (``bleu_precisions``, ``bleu_bp``, ``sys_len``, ``ref_len``). Raises :class:`DataError` if a
    reference stream's length differs from the hypotheses' or when there are none, and
    :class:`ConfigError` on an unknown metric.
    """
    metrics = metric_names(metrics)
    refs = [list(references), *(list(r) for r in more_references)]
    if not hypotheses:
        raise DataError("no hypotheses to score (an empty test set)")
    for stream in refs:
        if len(hypotheses) != len(stream):
            raise DataError(f"{len(hypotheses)} hypotheses but {len(stream)} references: counts must match")
    hyps = list(hypotheses)
    warn_if_tokenised(hyps)
    scorers = {"bleu": scorer("bleu", tgt_lang), "bleu_lc": scorer("bleu", tgt_lang, lowercase=True)} \
        if "bleu" in metrics else {}  # (chrF and TER need no tokeniser: no MeCab for --metrics chrf)
    scorers.update({name: scorer(name, tgt_lang) for name in ("chrf", "ter") if name in metrics})
    results = {name: corpus_score(scorer, hyps, refs) for name, scorer in scorers.items()}
    signatures = {name: str(scorer.get_signature()) for name, scorer in scorers.items()}
    b = results.get("bleu")
    return {
        **{name: float(r.score) for name, r in results.items()},  # unrounded: shown to 2 places as sacreBLEU's
        **{f"{name}_signature": sig for name, sig in signatures.items()},
        "signatures": signatures,
        **({"bleu_precisions": [float(p) for p in b.precisions], "bleu_bp": float(b.bp), "sys_len": int(b.sys_len),
            "ref_len": int(b.ref_len)} if b is not None else {}),
    }
