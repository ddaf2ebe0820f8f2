"""The corpora one prepared cache is built from: ``data.source``, or the list ``data.sources``.

With one corpus the cache is what it always was: the cleaned training pairs are the split
``data.train_split``, and every split holds ``data.src_lang`` and ``data.tgt_lang``.

With ``data.sources`` each corpus is cleaned and counted on its own, and its training pairs become
the split ``<train_split>.<k>`` (k its place in the list) in its own two languages. The
validation and test splits are each stored once per language, taken from the first corpus that
holds the split in that language (test_2016_flickr.fr from the en-fr corpus, say), so that every
direction between them can be scored, when the corpora share them (multi-parallel test sets). A
corpus whose split differs in a language an earlier corpus gives keeps its pairs apart, as the
split ``<split>.<src>-<tgt>``.

Tags are SentencePiece control symbols (atomic, never made from text, never written out by
decoding) put before a corpus's source sentences:

* a **target-language tag** ``<2xx>`` on every source, when the corpora have more than one target
  language (one model for several directions, Johnson et al. 2017); decoding puts the tag of the
  language asked for (``--tgt-lang``) before each input;
* a **corpus tag** (``data.sources[k].tag``, e.g. ``<bt>`` for back-translations, or a domain).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mtcli.config import CorpusConfig, DataConfig
from mtcli.data.cache import SPM_MODEL, array_name, direction_split, eval_split_name
from mtcli.data.cleaning import CleanCounts, PairCleaner, clean_text_blocks, clean_text_files
from mtcli.data.overlap import Record, count_overlap, warn_of_overlap
from mtcli.data.sourcebase import MissingSplitError, Source
from mtcli.data.sources import TextDirSource, open_source
from mtcli.data.tokenizer import UNK_ID
from mtcli.data.vocabmap import load_tokenizer
from mtcli.data.workers import can_fork
from mtcli.errors import DataError
from mtcli.fileio import FileHasher
from mtcli.languages import measured_in_characters, same_language
from mtcli.logs import get_logger
from mtcli.rundir import VOCAB_NAME

# Below this many pairs an Arrow split is cleaned in-process: forking workers costs about as much
# as it saves on a corpus the size of Multi30k.
PARALLEL_MIN_PAIRS = 50_000
# The same for plain-text files, in bytes of the smaller side (50k pairs of WMT text are about 8 MB),
# and twice that for a file of both sides (a .tsv).
PARALLEL_CLEAN_BYTES = 8 << 20


def target_tag(lang: str) -> str:
    """The symbol that asks for a translation into ``lang``: ``<2de>``."""
    return f"<2{lang}>"


def split_names(data: DataConfig) -> list[str]:
    """Training, validation and test split names, in that order, without repeats."""
    return list(dict.fromkeys([data.train_split, data.valid_split, *data.test_splits]))


@dataclass
class Corpus:
    """One corpus of the cache: its config, its opened source, the cache split of its training
    pairs, and the symbols put before its source sentences."""

    index: int
    config: CorpusConfig
    source: Source
    read_split: str  # its training split, in the source (data.train_split)
    train_name: str  # ... and in the cache
    prefix: list[str]
    provides: list[str] = field(default_factory=list)  # the validation/test splits read from it

    @property
    def langs(self) -> tuple[str, str]:
        """(source language, target language)."""
        src, tgt = self.config.langs or ("", "")
        return src, tgt

    def record(self) -> dict[str, Any]:
        """The manifest's entry for this corpus (its counts are added by ``prepare``)."""
        return {"split": self.train_name, "source": {"kind": self.source.kind, "location": self.source.location,
                                                     "hub_config": self.config.hub_config},
                "langs": list(self.langs), "tag": self.config.tag, "prefix": self.prefix}


@dataclass
class Plan:
    """What ``prepare`` reads from where: the corpora, and for each validation/test split and
    language the corpus (and its side, 0 source or 1 target) it comes from."""

    corpora: list[Corpus]
    all_splits: list[str]  # data.train_split, data.valid_split, data.test_splits
    eval_splits: list[str]
    providers: dict[tuple[str, str], tuple[Corpus, int]]
    read_as: dict[str, str]  # each validation/test split of the cache: the corpora's split it is read as
    target_tags: dict[str, str]
    several: bool
    notes: list[str] = field(default_factory=list)  # warnings about the corpora, which prepare gives

    def splits(self) -> list[str]:
        """Every split of the cache: the corpora's training splits, then validation and tests
        (and a corpus's own copy of one, ``test.en-zh``, after it)."""
        return list(dict.fromkeys([c.train_name for c in self.corpora] + list(self.read_as)))

    def split_langs(self) -> dict[str, list[str]]:
        """The languages each split of the cache holds."""
        langs = {c.train_name: list(c.langs) for c in self.corpora}
        for split in self.read_as:
            langs.setdefault(split, [lang for (s, lang) in self.providers if s == split])
        return langs

    def spm_texts(self) -> list[tuple[Corpus, str]]:
        """The training texts the joint SentencePiece model learns from, as (corpus, language):
        each corpus's two sides, but a text read by several corpora (one corpus in several
        directions, say) only once, from the first. Counted once, every language weighs in the
        vocabulary by its own text alone, whatever the number of directions that read it."""
        texts: dict[tuple[Any, ...], tuple[Corpus, str]] = {}
        for corpus in self.corpora:
            for lang in corpus.langs:
                key = (corpus.source.kind, _spelled(corpus.source.location), corpus.config.hub_config,
                       corpus.read_split, lang, _read_with(corpus))
                texts.setdefault(key, (corpus, lang))
        return list(texts.values())

    def symbols(self) -> list[str]:
        """Every tag, as SentencePiece control symbols: the target tags, then the corpus tags."""
        tags = sorted(self.target_tags.values()) + [c.config.tag for c in self.corpora if c.config.tag]
        return list(dict.fromkeys(tags))

    def describe(self) -> str:
        """The source(s), for messages."""
        if not self.several:
            return self.corpora[0].source.describe()
        return f"{len(self.corpora)} corpora (" + "; ".join(
            f"{c.source.location} {'->'.join(c.langs)}" for c in self.corpora) + ")"

    def fingerprint(self, hasher: FileHasher) -> dict[str, Any]:
        """What identifies the inputs (for one corpus, exactly what it always was)."""
        if not self.several:
            return self.corpora[0].source.fingerprint(self.all_splits, hasher)
        return {"corpora": [c.source.fingerprint([c.read_split, *c.provides], hasher) for c in self.corpora]}


def _spelled(location: str) -> str:
    """A corpus's place, one spelling of it (``corp/x``, ``./corp/x/`` and its absolute path
    are one directory; a hub id stays one id)."""
    return os.path.abspath(location) if location else location


def _read_with(corpus: Corpus) -> tuple[str, ...]:
    """What else decides the text of one language a corpus reads: nothing for a side file
    (``<split>.<lang>``, the same text in every pair), else its pair of languages (a ``.tsv`` of
    other languages, or a TMX's or a table's rows that hold both, hold other sentences)."""
    source, split = corpus.source, corpus.read_split
    if isinstance(source, TextDirSource) and source.table(split) is None and source.memory(split) is None:
        return ()
    return tuple(sorted((source.src_lang, source.tgt_lang)))


def _has_split(source: Source, split: str) -> bool:
    try:
        source.check([split])
    except DataError:
        return False
    return True


def _open(corpus: CorpusConfig, k: int) -> Source:
    src, tgt = corpus.langs or ("", "")
    return open_source(corpus.source, src, tgt, corpus.hub_config, f"data.sources[{k}].source")


def _providers(data: DataConfig, corpora: list[Corpus], eval_splits: Iterable[str], notes: list[str]
               ) -> tuple[dict[tuple[str, str], tuple[Corpus, int]], dict[str, str]]:
    """For each validation/test split of the cache and each of its languages, the corpus and
    side its text comes from: the first corpus holding the split in that language; and the
    split each is read as. A corpus joins a split's languages only when its text in each
    language an earlier corpus gives is that text, line for line (multi-parallel test sets,
    Multi30k's); else (no language in common either) its pairs are kept apart, as the split
    ``<split>.<src>-<tgt>``
    (:func:`~mtcli.data.cache.direction_split`; left out when the shared split comes to hold
    both its languages), since one corpus's English beside another's Chinese would pair
    unrelated sentences."""
    providers: dict[tuple[str, str], tuple[Corpus, int]] = {}
    read_as: dict[str, str] = {}
    for split in eval_splits:
        texts: dict[int, tuple[list[str], list[str]]] = {}  # each corpus's two sides of the split, read once

        def side(corpus: Corpus, i: int, split: str = split, texts: dict = texts) -> list[str]:
            if corpus.index not in texts:
                pairs = list(corpus.source.verbatim_pairs(split))
                texts[corpus.index] = ([pair[0] for pair in pairs], [pair[1] for pair in pairs])
            return texts[corpus.index][i]

        read_as[split] = split
        for corpus in (c for c in corpora if _has_split(c.source, split)):
            shared = [(i, providers[(split, lang)]) for i, lang in enumerate(corpus.langs) if (split, lang) in providers]
            if len(shared) == 2:  # both languages come from corpora before it: it adds nothing
                if not _same_text(corpus, shared, side):
                    notes.append(_unused(corpus, split, shared))
                continue
            corpus.provides.append(split)
            name = split
            joined = any(s == split for s, _ in providers)  # an earlier corpus gave the split: align or keep apart
            if joined and (not shared or not all(side(corpus, i) == side(*given) for i, given in shared)):
                name = direction_split(split, *corpus.langs)
                read_as.setdefault(name, split)
            for i, lang in enumerate(corpus.langs):
                providers.setdefault((name, lang), (corpus, i))
        for name in [n for n, of in read_as.items() if of == split and n != split]:
            langs = [lang for (s, lang) in providers if s == name]
            if all((split, lang) in providers for lang in langs):  # unused: the shared split holds both
                del read_as[name]
                for lang in langs:
                    del providers[(name, lang)]
        src, tgt = data.src_lang, data.tgt_lang
        holds = eval_split_name(split, src, tgt, lambda name, lang: (name, lang) in providers)
        if (holds, src) not in providers or (holds, tgt) not in providers:
            others = sorted({"->".join(c.langs) for (s, _), (c, _) in providers.items() if read_as.get(s) == split})
            if split == data.valid_split:  # (not a test split to leave out: validation scores this direction)
                hint = (f"; it is {', '.join(others)}'s: validate a direction that has it (data.src_lang, "
                        "data.tgt_lang), or name another split (data.valid_split)") if others else ""
            else:
                hint = (f"; it is {', '.join(others)}'s: leave it out of data.test_splits and score it with `mtcli "
                        "evaluate RUN --src FILE --ref FILE --src-lang L1 --tgt-lang L2`") if others else ""
            raise DataError(f"data.sources: no corpus holds split '{split}' in {data.src_lang} and "
                            f"{data.tgt_lang} (the direction data.src_lang -> data.tgt_lang){hint}")
    return providers, read_as


def _same_text(corpus: Corpus, shared: list[tuple[int, tuple[Corpus, int]]],
               side: Callable[[Corpus, int], list[str]]) -> bool:
    """Whether ``corpus``'s split is, in each language, the text of the corpus that gives it
    (False also when it cannot be read: it is not, whatever it holds)."""
    try:
        return all(side(corpus, i) == side(*given) for i, given in shared)
    except DataError:
        return False


def _unused(corpus: Corpus, split: str, shared: list[tuple[int, tuple[Corpus, int]]]) -> str:
    """That ``corpus``'s own ``split`` is not read: earlier corpora give it in both its languages,
    with other sentences (validation and evaluate read theirs)."""
    given = list(dict.fromkeys(f"data.sources[{c.index}] ({c.source.location})" for _, (c, _) in shared))
    return (f"data.sources[{corpus.index}] ({corpus.source.location}): its split '{split}' is not read: "
            f"{' and '.join(given)} {'give' if len(given) > 1 else 'gives'} it in {' and '.join(corpus.langs)} with "
            "other sentences, and validation and evaluate read that")


def _check_splits(source: Source, data: DataConfig, splits: list[str], corpus: str = "data") -> None:
    """``source.check(splits)``; a missing split also names the key that asked for it (and a
    source's advice on ``data.hub_config`` names the one of ``corpus``, ``data.sources[k]``)."""
    for split in splits:
        try:
            source.check([split])
        except MissingSplitError as exc:
            exc = MissingSplitError(str(exc).replace("set data.hub_config", f"set {corpus}.hub_config"))
            key = ("data.train_split" if split == data.train_split else
                   "data.valid_split" if split == data.valid_split else "data.test_splits")
            hint = ""
            if key == "data.valid_split":  # a corpus's own name for it (dev, valid, newstest2013)
                others = [s for s in source.splits() if s != data.train_split and s not in data.test_splits]
                hint = f" (the source's one other split: --set data.valid_split={others[0]})" if len(others) == 1 else ""
            raise DataError(f"{exc}; {key} names it{hint}") from None


def _repeated(configs: list[CorpusConfig], k: int) -> list[str]:
    """That corpus ``k`` is one listed before it again (source, direction, tag), if it is: both
    draw the same pairs, which is a weight, said twice."""
    this = replace(configs[k], source=_spelled(configs[k].source))
    same = next((j for j, c in enumerate(configs[:k])
                 if replace(c, weight=this.weight, source=_spelled(c.source)) == this), None)
    if same is None:
        return []
    return [f"data.sources[{k}] repeats data.sources[{same}] ({configs[k].source}, {'->'.join(configs[k].langs or ())}): "
            "its pairs are drawn with both weights together; list it once with the weight it should have"]


def given_spm_model(data: DataConfig) -> Path | None:
    """The SentencePiece model ``data.spm_model`` names (a run directory or prepared cache holding
    ``spm.model``, or the file itself; or a run ``mtcli import-hf`` made, with its ``vocab.json``
    beside ``source.spm`` and ``target.spm``), checked to be one mtcli can use; None when unset."""
    if not data.spm_model:
        return None
    path = Path(data.spm_model)
    model = path / SPM_MODEL if path.is_dir() else path
    if path.is_dir() and not model.is_file() and (path / VOCAB_NAME).is_file():
        model = path / VOCAB_NAME
    if not model.is_file():
        where = f"no {SPM_MODEL} in that directory" if path.is_dir() else "not found"
        raise DataError(f"data.spm_model: {data.spm_model}: {where} (give a run directory, a "
                        "prepared cache or an spm.model file)")
    try:
        load_tokenizer(model)
    except DataError as exc:
        raise DataError(f"data.spm_model: {exc}") from None
    return model


def keeps_target_tag(data: DataConfig) -> bool:
    """Whether sources of one target language start with its tag all the same: when
    ``data.spm_model`` is a multilingual run's (or cache's) model that holds that tag. A model
    fine-tuned from that run (``train.init_from``) then reads its sources as the run did; untagged,
    it starts from weights that never saw such a source (and wrote other languages). The corpora
    of ``data.sources`` get it; a ``data.source`` is warned of."""
    targets = data.target_langs()
    if not data.spm_model or len(targets) != 1:  # (nothing to read: the usual case costs no model load)
        return False
    try:
        given = given_spm_model(data)
    except DataError:  # (not there yet: a parent still to train; prepare says so itself)
        return False
    return given is not None and load_tokenizer(given).piece_to_id(target_tag(targets[0])) != UNK_ID


def one_language_twice(targets: list[str]) -> list[str]:
    """Warnings for target languages that look like one spelled two ways (``de`` and ``de_DE``,
    ``pt-BR`` and ``pt_BR``): each gets its own tag and its own share of the data, and a
    translation asked for one is never trained on the other's."""
    tags = [lang.lower().replace("_", "-").split("-") for lang in targets]

    def alike(x: list[str], y: list[str]) -> bool:  # one bare, or the same subtags spelt otherwise
        return same_language(x[0], y[0]) and (len(x) == 1 or len(y) == 1 or x[1:] == y[1:])

    return [f"target languages {targets[j]} and {targets[i]} look like one language spelled two ways: each gets its "
            f"own tag ({target_tag(targets[j])}, {target_tag(targets[i])}) and the data of its corpora only; spell "
            "them alike if they are one"
            for i in range(len(targets)) for j in range(i) if alike(tags[i], tags[j])]


def plan_corpora(data: DataConfig) -> Plan:
    """Open every corpus and decide what is read from where; :class:`DataError` (one line) for a
    missing corpus, split or language."""
    all_splits = split_names(data)
    eval_splits = [split for split in all_splits if split != data.train_split]
    tagged = keeps_target_tag(data)
    if not data.sources:
        source = open_source(data.source, data.src_lang, data.tgt_lang, data.hub_config)
        _check_splits(source, data, all_splits)
        corpus = Corpus(0, data.corpora()[0], source, data.train_split, data.train_split, [], eval_splits)
        providers = {(split, lang): (corpus, side) for split in eval_splits
                     for side, lang in enumerate((data.src_lang, data.tgt_lang))}
        notes = [f"data.spm_model holds the tag {target_tag(data.tgt_lang)} that its multilingual model's sources start "
                 "with, and sources read from data.source get none: a model fine-tuned from that one would start from "
                 "weights that never read an untagged source; list the corpus under data.sources ([{source: "
                 f"{data.source}}}]) to keep the tag"] if tagged else []
        notes += scored_on_training(data)
        return Plan([corpus], all_splits, eval_splits, providers, {s: s for s in eval_splits}, {}, several=False,
                    notes=notes)
    configs = data.corpora()
    targets = data.target_langs()
    target_tags = {lang: target_tag(lang) for lang in targets} if len(targets) > 1 or tagged else {}
    corpora: list[Corpus] = []
    notes = one_language_twice(targets) if target_tags else []
    for k, config in enumerate(configs):
        notes += _repeated(configs, k)
        source = _open(config, k)
        _check_splits(source, data, [data.train_split], f"data.sources[{k}]")
        tgt = (config.langs or ["", ""])[1]
        prefix = ([target_tags[tgt]] if target_tags else []) + ([config.tag] if config.tag else [])
        corpora.append(Corpus(k, config, source, data.train_split, f"{data.train_split}.{k}", prefix))
    providers, read_as = _providers(data, corpora, eval_splits, notes)
    notes += _untested(data, corpora, providers)
    return Plan(corpora, all_splits, eval_splits, providers, read_as, target_tags, several=True, notes=notes)


def _untested(data: DataConfig, corpora: list[Corpus], providers: dict[tuple[str, str], Any]) -> list[str]:
    """Warnings for the directions no test split holds in both languages: ``evaluate`` leaves
    them out (said only after the training, before)."""
    def tested(src: str, tgt: str) -> bool:
        holds = lambda name, lang: (name, lang) in providers  # noqa: E731
        return any(holds(name := eval_split_name(split, src, tgt, holds), src) and holds(name, tgt)
                   for split in data.test_splits)

    directions = dict.fromkeys(c.langs for c in corpora)
    return [f"{src}->{tgt}: no test split holds it in both languages (data.test_splits: "
            f"{', '.join(data.test_splits) or 'none'}); evaluate scores it only on files given (--src, --ref)"
            for src, tgt in directions if data.test_splits and not tested(src, tgt)]


def scored_on_training(data: DataConfig) -> list[str]:
    """Warnings for a validation or test split that is the training split itself (one corpus;
    with ``data.sources`` its text is compared with the training pairs like any other's)."""
    notes = []
    if data.valid_split == data.train_split:
        notes.append(f"data.valid_split is the training split ('{data.train_split}'): validation scores pairs the "
                     "model trains on, which rewards memorising when it picks checkpoints and stops the run; give a "
                     "split held out from training")
    if data.train_split in data.test_splits:
        notes.append(f"data.test_splits holds the training split ('{data.train_split}'): its scores are of pairs the "
                     "model trained on, not of text it has not seen")
    return notes


# ----------------------------------------------------------------------------- text


def _clean_split(corpus: Corpus, data: DataConfig, src_txt: Path, tgt_txt: Path, workers: int) -> PairCleaner:
    """Write the training split cleaned; return the cleaner, which holds the counts. A large
    split is cleaned by ``workers`` processes, with the same result as one: plain-text files by
    byte ranges the workers read themselves
    (:func:`~mtcli.data.cleaning.clean_text_files`); Arrow sources and ``.tsv`` files as blocks
    of text (:func:`~mtcli.data.cleaning.clean_text_blocks`), made from the rows by the workers
    from the parts they read themselves (parquet row groups, slices of a dataset's Arrow files),
    or else by this process (a ``.tsv`` file's columns, split by numpy)."""
    characters = (measured_in_characters(corpus.langs[0]), measured_in_characters(corpus.langs[1]))
    cleaner = PairCleaner(data.max_length, data.max_length_ratio, data.dedup, characters=characters)
    source, split = corpus.source, corpus.read_split
    files = source.plain_files(split)
    parallel = workers > 1 and can_fork()
    if parallel and files is not None and min(path.stat().st_size for path in files) >= PARALLEL_CLEAN_BYTES:
        clean_text_files(*files, src_txt, tgt_txt, cleaner, workers)
    elif parallel and files is None and ((source.num_pairs(split) or 0) >= PARALLEL_MIN_PAIRS
                                         or (source.block_file_bytes(split) or 0) >= 2 * PARALLEL_CLEAN_BYTES):
        readers = source.block_readers(split)  # then each worker reads its own parts
        blocks = source.text_blocks(split) if readers is None else readers
        clean_text_blocks(blocks, src_txt, tgt_txt, cleaner, workers)
    else:
        _write_sides(cleaner(source.pairs(split)), [src_txt, tgt_txt])  # (the cleaner counts them)
    return cleaner


def text_path(tmp: Path, split: str, lang: str) -> Path:
    """Where ``prepare`` writes the text of one split and language."""
    return tmp / f"{array_name(split, lang)}.txt"


def write_training(plan: Plan, data: DataConfig, tmp: Path, workers: int) -> tuple[dict[str, CleanCounts], Record]:
    """Write each corpus's training pairs, cleaned; return its counts by cache split, and the
    validation and test splits (their text is in ``tmp`` already: :func:`write_eval`) that share
    pairs with a corpus's training pairs, each counted and warned of (:mod:`mtcli.data.overlap`)."""
    log = get_logger()
    counts: dict[str, CleanCounts] = {}
    shared: Record = {}
    split_langs = plan.split_langs()
    for corpus in plan.corpora:
        src, tgt = corpus.langs
        texts = (text_path(tmp, corpus.train_name, src), text_path(tmp, corpus.train_name, tgt))
        cleaner = _clean_split(corpus, data, *texts, workers)
        c = counts[corpus.train_name] = cleaner.counts
        evaluations = {split: (text_path(tmp, split, src), text_path(tmp, split, tgt))
                       for split in plan.read_as if {src, tgt} <= set(split_langs[split])}
        held = cleaner.kept_among if cleaner.dedup else None
        for split, (n, pairs) in count_overlap(texts, evaluations, held).items():
            shared.setdefault(split, {})[corpus.train_name] = {"langs": [src, tgt], "shared": n, "pairs": pairs}
        why = ", ".join(f"{k} {v}" for k, v in c.dropped().items())
        log.info("read %s: %d pairs, kept %d (dropped: %s)", corpus.train_name, c.read, c.kept, why)
        _warn_of_heavy_drops(corpus, c, data)
        if c.kept == 0:
            raise DataError(
                f"{corpus.source.describe()}: training split '{data.train_split}' is empty after cleaning "
                f"(read {c.read} pairs; dropped: {why})"
            )
    warn_of_overlap(shared)
    return counts, shared


# A length rule that drops more than this share of a corpus is more likely wrong for it than right.
HEAVY_DROP_SHARE = 0.2


def _warn_of_heavy_drops(corpus: Corpus, counts: CleanCounts, data: DataConfig) -> None:
    """Warn when a length rule dropped much of a corpus, naming the key that sets it and how
    each side was measured."""
    units = "/".join(f"{lang} in {'characters' if measured_in_characters(lang) else 'words'}"
                     for lang in corpus.langs)
    for dropped, key, value in ((counts.too_long, "data.max_length", data.max_length),
                                (counts.ratio, "data.max_length_ratio", data.max_length_ratio)):
        if counts.read and dropped > HEAVY_DROP_SHARE * counts.read:
            get_logger().warning("%s: %s=%g dropped %d of %d pairs (%.0f%%; lengths: %s); if that is "
                                 "not what you want, raise it", corpus.train_name, key, value, dropped,
                                 counts.read, 100 * dropped / counts.read, units)


def _write_sides(pairs: Iterable[tuple[str, str]], paths: list[Path | None]) -> tuple[int, int]:
    """Write the sides of ``pairs`` whose path is given; return how many pairs, and how many of
    them hold text (other than white space) on both sides."""
    handles = [open(p, "w", encoding="utf-8", newline="\n") if p is not None else None for p in paths]
    n = texted = 0
    try:
        for pair in pairs:
            for handle, text in zip(handles, pair, strict=True):
                if handle is not None:
                    handle.write(text + "\n")
            n += 1
            texted += all(text.strip() for text in pair)
    finally:
        for handle in handles:
            if handle is not None:
                handle.close()
    return n, texted


def write_eval(plan: Plan, data: DataConfig, tmp: Path) -> dict[str, CleanCounts]:
    """Write every validation and test split verbatim (an empty line stays), each language from
    the corpus the plan names; :class:`DataError` when a split's languages differ in length or
    the validation split has no pairs (training would fail at its first validation); a warning
    for an empty test split (``mtcli evaluate`` cannot score it)."""
    counts: dict[str, CleanCounts] = {}
    for split, read_as in plan.read_as.items():
        lines: dict[str, tuple[int, Corpus]] = {}
        texted = 0
        for corpus in plan.corpora:
            paths: list[Path | None] = [None, None]
            for (s, lang), (provider, side) in plan.providers.items():
                if s == split and provider is corpus:
                    paths[side] = text_path(tmp, split, lang)
            if any(paths):
                n, with_text = _write_sides(corpus.source.verbatim_pairs(read_as), paths)
                texted = max(texted, with_text)
                lines.update({lang: (n, corpus) for lang, path in zip(corpus.langs, paths, strict=True) if path})
        sizes = {n for n, _ in lines.values()}
        if len(sizes) > 1:
            what = ", ".join(f"{lang} {n} (from {c.source.location})" for lang, (n, c) in lines.items())
            raise DataError(f"split '{split}': its languages differ in length ({what}); the validation and test "
                            "splits of data.sources must be line-aligned across languages")
        n = sizes.pop()
        counts[split] = CleanCounts(read=n, kept=n)
        get_logger().info("read %s: %d sentences in %s (kept as they are)", split, n, ", ".join(lines))
        if split != read_as:
            corpus = next(iter(lines.values()))[1]
            shared = any((read_as, lang) in plan.providers for lang in corpus.langs)
            get_logger().info("%s is the split '%s' of %s, kept apart: %s", split, read_as, corpus.source.location,
                              "its text in a language an earlier corpus gives differs from that corpus's" if shared
                              else "it has no language of an earlier corpus's, to show its sentences are theirs")
        if texted == 0:
            _refuse_empty(split, read_as, data, plan, next(iter(lines.values()))[1], n)
    return counts


def _refuse_empty(split: str, read_as: str, data: DataConfig, plan: Plan, corpus: Corpus, n: int) -> None:
    """A validation split without a pair of text (of ``n`` lines), the one validation reads
    (data.src_lang -> data.tgt_lang), is a :class:`DataError`: it would score 0 at every
    validation, and ``train.patience`` would stop the run. Such a test split, or another
    corpus's validation split, is a warning."""
    where = f"{corpus.source.describe()}: split '{read_as}'"
    none = "has no pairs" if n == 0 else f"has {n} lines, none of them a pair of text (empty or blank lines)"
    if read_as == data.valid_split:
        validated = eval_split_name(read_as, data.src_lang, data.tgt_lang, lambda name, lang: (name, lang) in plan.providers)
        if split == validated:
            raise DataError(f"{where} (data.valid_split) {none}; validation needs at least one pair")
        get_logger().warning("%s (data.valid_split; kept apart as %s) %s; validation reads %s (data.src_lang "
                             "-> data.tgt_lang)", where, split, none, validated)
        return
    get_logger().warning("%s (data.test_splits) %s; mtcli evaluate cannot score it (scoring every direction, it "
                         "leaves it out)", where, none)
