"""Corpus scores with sacreBLEU (Post, 2018, "A Call for Clarity in Reporting BLEU Scores").

All on detokenised text:

* **BLEU** with sacreBLEU's defaults (13a tokenisation, cased, exponential smoothing):
  ``BLEU = BP * exp(sum_n 1/4 * log p_n)`` with ``BP = min(1, exp(1 - r/c))``;
* **chrF** (Popović, 2015): character n-gram F-score, ``beta = 2``;
* **lowercased BLEU** (``-lc``, 13a): only for comparison with papers that report it.

Every score comes with its sacreBLEU signature, so a number in a table says exactly how it was
computed. Used by ``mtcli evaluate`` and by the validation BLEU during training.
"""

from __future__ import annotations

from typing import Any

from sacrebleu.metrics import BLEU, CHRF

from mtcli.errors import DataError


def score(hypotheses: list[str], references: list[str]) -> dict[str, Any]:
    """Corpus BLEU, chrF and lowercased BLEU of ``hypotheses`` against one reference each.

    Returns ``bleu``, ``chrf``, ``bleu_lc`` (floats, 0-100), their signatures as
    ``bleu_signature``/``chrf_signature``/``bleu_lc_signature`` (also grouped under
    ``signatures``), and BLEU's details (``bleu_precisions``, ``bleu_bp``, ``sys_len``,
    ``ref_len``). Raises :class:`DataError` if the two lists differ in length.
    """
    if len(hypotheses) != len(references):
        raise DataError(
            f"{len(hypotheses)} hypotheses but {len(references)} references: counts must match"
        )
    refs = [list(references)]
    bleu, chrf, bleu_lc = BLEU(), CHRF(), BLEU(lowercase=True)
    b = bleu.corpus_score(list(hypotheses), refs)
    c = chrf.corpus_score(list(hypotheses), refs)
    lc = bleu_lc.corpus_score(list(hypotheses), refs)
    signatures = {
        "bleu": str(bleu.get_signature()),
        "chrf": str(chrf.get_signature()),
        "bleu_lc": str(bleu_lc.get_signature()),
    }
    return {
        "bleu": round(float(b.score), 4),
        "chrf": round(float(c.score), 4),
        "bleu_lc": round(float(lc.score), 4),
        "bleu_signature": signatures["bleu"],
        "chrf_signature": signatures["chrf"],
        "bleu_lc_signature": signatures["bleu_lc"],
        "signatures": signatures,
        "bleu_precisions": [round(float(p), 4) for p in b.precisions],
        "bleu_bp": round(float(b.bp), 4),
        "sys_len": int(b.sys_len),
        "ref_len": int(b.ref_len),
    }
