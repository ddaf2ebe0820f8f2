"""How well a tokenizer covers a corpus, said by ``prepare`` once it has encoded it: a side
whose tokens are largely unknown (``⁇``), and evaluation text that does not come back as written
through the tokenizer. Either is text a model can neither learn nor write, so it is warned of
before a training spends hours on it."""

from __future__ import annotations

import difflib
import itertools
import re
from pathlib import Path

from mtcli.config import DataConfig
from mtcli.data.corpora import Plan, text_path
from mtcli.data.tokenizer import Tokenizer
from mtcli.data.vocabmap import VocabTokenizer
from mtcli.logs import get_logger

#: The most lines of an evaluation split's target side that :func:`warn_of_changed_text` checks
#: (every k-th line of a longer one), and the share of them coming back otherwise through the
#: tokenizer above which it warns.
ROUND_TRIP_LINES, ROUND_TRIP_WARN_SHARE = 10_000, 0.01


def warn_of_changed_text(tmp: Path, plan: Plan, tokenizer: Tokenizer | VocabTokenizer, rule: str | None) -> None:
    """Warn when the tokenizer does not give back an evaluation split's target text as written
    (its normalisation, ``rule``; unknown characters): a model can then never write those
    references, and BLEU against them is capped (SentencePiece's default NFKC turns Chinese
    full-width punctuation into ASCII, an NFD corpus into NFC)."""
    if isinstance(tokenizer, VocabTokenizer):  # an import's two models: it encodes sources, not targets
        return
    targets = {c.langs[1] for c in plan.corpora}
    for split, langs in plan.split_langs().items():
        for lang in (lang for lang in langs if split in plan.eval_splits and lang in targets):
            path = text_path(tmp, split, lang)
            with open(path, "rb") as handle:  # (each line ends with "\n", as prepare writes them)
                total = sum(block.count(b"\n") for block in iter(lambda: handle.read(1 << 20), b""))
            step = round_trip_step(total)
            with open(path, encoding="utf-8") as handle:
                lines = [line.rstrip("\n") for line in itertools.islice(handle, 0, None, step)]
            warn_of_unwritable(f"{split}.{lang}", lines, tokenizer, rule, step, total)


def round_trip_step(total: int) -> int:
    """Which lines of ``total`` :func:`warn_of_unwritable` reads: every step-th, at most
    :data:`ROUND_TRIP_LINES` spread over the text rather than its head."""
    return -(-total // ROUND_TRIP_LINES) or 1


def warn_of_unwritable(name: str, lines: list[str], tokenizer: Tokenizer | VocabTokenizer, rule: str | None,
                       step: int = 1, total: int | None = None) -> None:
    """Warn when more than :data:`ROUND_TRIP_WARN_SHARE` of ``lines`` (reference text, every
    ``step``-th line of ``total``: :func:`round_trip_step`) do not come back as written through
    ``tokenizer``, whose normalisation is ``rule`` (None: not known), naming the first such line
    and what it becomes."""
    if isinstance(tokenizer, VocabTokenizer):  # an import's two models: it encodes sources, not targets
        return
    # runs of ASCII spaces collapsed, as SentencePiece does (a no-break or ideographic space stays)
    written = [re.sub(" +", " ", line).strip(" ") for line in lines]
    back = [tokenizer.decode(tokenizer.encode(line)) for line in lines]
    changed = [i for i, (a, b) in enumerate(zip(written, back, strict=True)) if a != b]
    if len(changed) <= ROUND_TRIP_WARN_SHARE * len(lines):
        return
    i = changed[0]
    fix = _advice(rule, unknown="⁇" in back[i] and "⁇" not in written[i])
    checked = f"{len(lines)} lines" + ("" if step == 1 else f" (one in {step} of {total})")
    get_logger().warning("%s: %d of %s do not come back as written through the SentencePiece model (line %d: %s): "
                         "a model cannot write them as the references do, which caps its scores; %s",
                         name, len(changed), checked, i * step + 1, _change(written[i], back[i]), fix)


def _change(written: str, back: str) -> str:
    """The first difference of ``written`` and ``back``, said so a reader can see it: the
    characters in quotes and as code points (a combining mark, a jamo or a zero-width character
    looks alike, or like nothing, printed), after a few characters of context."""
    start = next((k for k, (a, b) in enumerate(zip(written, back, strict=False)) if a != b),
                 min(len(written), len(back)))
    # (difflib over a window from there: over whole lines of 100k characters it takes minutes)
    window_a, window_b = written[start:start + 32], back[start:start + 32]
    tag, i1, i2, j1, j2 = next((op for op in difflib.SequenceMatcher(None, window_a, window_b, autojunk=False)
                                .get_opcodes() if op[0] != "equal"), ("replace", 0, len(window_a), 0, len(window_b)))
    was, now = window_a[i1:i2][:8], window_b[j1:j2][:8]
    i1 += start

    def points(text: str) -> str:
        return " ".join(f"U+{ord(c):04X}" for c in text) or "nothing"

    return f"{written[max(0, i1 - 8):i1]!r} then {was!r} ({points(was)}) becomes {now!r} ({points(now)})"


def _advice(rule: str | None, unknown: bool) -> str:
    """What to change when references do not come back as written: ``rule`` is the model's
    normalisation (None for a given model); ``unknown``, whether they came back with ``⁇``."""
    if rule is None:
        return "the given data.spm_model normalises it or lacks some of its characters"
    if unknown or rule == "identity":
        return ("the vocabulary lacks some of its characters: they are not in the training text (train on text "
                "that holds them), or a data.character_coverage below 1.0 left them out")
    return f"its normalisation ({rule}) changes them: data.spm_normalization: identity keeps the text as written"


#: The share of unknown tokens (``⁇``) in a split's side above which ``prepare`` warns.
UNKNOWN_WARN_SHARE = 0.01


def warn_of_unknown(split: str, lang: str, unknown: int, tokens: int, given: bool, data: DataConfig) -> None:
    """Warn when more than :data:`UNKNOWN_WARN_SHARE` of a split's ``lang`` tokens are unknown to
    the vocabulary: the model can neither read nor write that text (a ``data.spm_model`` made for
    other languages or scripts, a word vocabulary, a character coverage far too low, or
    characters the training text does not hold), with what to do about it (``data``: the
    settings the model was trained under)."""
    if not tokens or unknown <= UNKNOWN_WARN_SHARE * tokens:
        return
    if given:
        fix = "data.spm_model was made for other text: leave it out to train one on this corpus"
    elif data.spm_model_type == "word":
        fix = "data.spm_model_type word knows only the training text's words: unigram or bpe spell the others"
    elif data.spm_model_type == "char":
        fix = (f"a char model of data.vocab_size={data.vocab_size} pieces has no room for every character: "
               "raise data.vocab_size, or its characters are not in the training text")
    elif data.character_coverage >= 1.0:
        fix = ("its characters are not in the training text (another script?), or only in lines SentencePiece "
               "leaves out of its training (over 4,192 bytes): train on text that holds them")
    else:
        fix = "raise data.character_coverage"
    get_logger().warning("%s.%s: %d of %d tokens (%.1f%%) are unknown to the SentencePiece model (⁇): the model "
                         "can neither read nor write that text; %s", split, lang, unknown, tokens,
                         100 * unknown / tokens, fix)


__all__ = ["ROUND_TRIP_LINES", "ROUND_TRIP_WARN_SHARE", "UNKNOWN_WARN_SHARE", "warn_of_changed_text", "warn_of_unknown",
           "round_trip_step", "warn_of_unwritable"]
