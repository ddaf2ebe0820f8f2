"""``mtcli prepare``: read, clean, learn a joint SentencePiece model, and binarise a corpus.

Steps (each streamed, so memory stays flat in corpus size):

1. open the source (:func:`mtcli.data.sources.open_source`) and check every split and language exist;
2. hash the inputs; if ``data.prepared_path()`` already holds a verified cache built from the same
   inputs and data config, stop: re-running is a no-op (``force=True`` rebuilds);
3. inside a temporary directory that is swapped in only when complete
   (:func:`mtcli.builddir.atomic_dir`):

   a. write ``<split>.<lang>.txt``: the validation and test splits verbatim (an empty line
      stays; an empty validation split stops here), then the training split cleaned by
      :class:`~mtcli.data.cleaning.PairCleaner` (counts per reason; a large split by
      ``data.num_workers`` processes, with the same result);
   b. train one SentencePiece model on both sides of the cleaned training text only, sampling
      at most ``data.spm_max_sentences`` sentences; or, with ``data.spm_model``, copy the given
      model (a trained run's, to adapt it to this corpus: the same pieces get the same ids);
   c. encode every split into ``<split>.<lang>.bin/.idx`` (:class:`~mtcli.data.cache.ArrayWriter`), in
      chunks; large files are spread over ``data.num_workers`` processes (:mod:`mtcli.data.encoding`);
   d. write ``manifest.json`` last, with sizes and sha256 of every file.

An interrupted run (even SIGKILL) leaves at most a hidden ``.<name>.*.tmp`` directory, which the
next run removes; the cache path holds either the previous complete cache or nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import sentencepiece

from mtcli.builddir import atomic_dir, check_replaceable, restore_swap
from mtcli.config import Config, DataConfig
from mtcli.data.cache import (
    FORMAT_VERSION,
    SPM_MODEL,
    ArrayWriter,
    CacheLock,
    PreparedCorpus,
    token_dtype,
    write_manifest,
)
from mtcli.data.cleaning import CLEANING_RULES, CleanCounts
from mtcli.data.corpora import (
    Plan,
    given_spm_model,
    plan_corpora,
    text_path,
    write_eval,
    write_training,
)
from mtcli.data.coverage import warn_of_changed_text, warn_of_unknown
from mtcli.data.encoding import encode_file, encode_with_vocab, line_blocks
from mtcli.data.overlap import warn_of_overlap
from mtcli.data.scan import take_spans
from mtcli.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    MIN_SAMPLE,
    PAD_ID,
    UNK_ID,
    Tokenizer,
    copy_model,
    is_word_model,
    train_model,
)
from mtcli.data.vocabmap import VocabTokenizer, load_tokenizer, tokenizer_files
from mtcli.data.workers import forked_pool, result_of
from mtcli.errors import DataError
from mtcli.fileio import NO_ROOM, FileHasher, check_directory, copy_file, file_stamp, sha256_file
from mtcli.languages import measured_in_characters
from mtcli.logs import get_logger
from mtcli.rundir import VOCAB_NAME
from mtcli.version import __version__

SPM_SEED = 1
# SentencePiece's model depends on how many threads train it, so that number is fixed, not the
# machine's data.num_workers: one config builds one vocabulary everywhere (two threads train the
# WMT14 recipe's 2M-sentence sample in about 20 s).
SPM_THREADS = 2
# Data-config keys that do not change the cache's content (where it goes, how fast it is built).
KEY_EXCLUDES = ("name", "prepared_dir", "num_workers", "source", "sources", "spm_model")
# What only a trained SentencePiece model depends on (a given one makes them moot).
SPM_TRAINING_KEYS = ("vocab_size", "spm_model_type", "character_coverage", "spm_max_sentences", "spm_normalization")


@dataclass
class PrepareReport:
    """What ``prepare`` did: counts per split, vocab, time; ``skipped`` when it was a no-op."""

    directory: Path
    skipped: bool
    source: str
    counts: dict[str, dict[str, Any]] = field(default_factory=dict)
    tokens: dict[str, dict[str, int]] = field(default_factory=dict)
    vocab_size: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        """A few human-readable lines for the terminal."""
        if self.skipped:
            return (
                f"up to date: {self.directory} (same inputs and data config; nothing to do, "
                "--force rebuilds)"
            )
        lines = [f"prepared {self.directory} from {self.source} in {self.seconds:.1f} s"]
        for split, c in self.counts.items():
            dropped = c.get("dropped", {})
            if any(dropped.values()):
                why = ", ".join(f"{k} {v}" for k, v in dropped.items())
                lines.append(f"  {split}: read {c['read']}, kept {c['kept']} (dropped: {why})")
            else:
                lines.append(f"  {split}: {c['kept']} pairs")
        lines.append(
            f"  vocab {self.vocab_size} (pad={PAD_ID} unk={UNK_ID} bos={BOS_ID} eos={EOS_ID}), "
            f"{self.directory / SPM_MODEL}"
        )
        return "\n".join(lines)


def given_sha256(given: Path) -> str:
    """What identifies a given tokenizer: its spm.model's sha256, or that of its three files."""
    files = tokenizer_files(given)
    if len(files) == 1:
        return sha256_file(given)
    return hashlib.sha256("".join(sha256_file(f) for f in files).encode()).hexdigest()


def spells_in_bytes(data: DataConfig) -> bool:
    """Whether the SentencePiece model trained here spells a character without a piece of its
    own in UTF-8 byte pieces: where ``data.character_coverage`` leaves the rarest characters
    out of the vocabulary (Chinese, Japanese), so they are still read and written, not unknown
    (``⁇``). At full coverage no training text holds byte pieces, so the model could not
    learn them: there they would only take 256 pieces of the vocabulary. A word model has none:
    it would spell a word it does not know in bytes with the word's ``▁``, written out as a
    literal ``▁``; there such a word is unknown."""
    return data.character_coverage < 1.0 and data.spm_model_type != "word"


def measured_languages(data: DataConfig) -> list[str]:
    """The languages of ``data``'s corpora that the cleaning rules measure in characters, sorted."""
    return sorted({lang for c in data.corpora() for lang in c.langs or () if measured_in_characters(lang)})


def build_key(data: DataConfig, fingerprint: dict[str, Any], spm_sha256: str | None = None,
              spm_texts: list[list[Any]] | None = None, word_model: bool = False) -> str:
    """sha256 over everything the cache content depends on: inputs, data config, format, and
    the given SentencePiece model's sha256 (``data.spm_model``), not its path; else, of several
    corpora, the texts SentencePiece learns from (``spm_texts``: corpus index and language).
    ``word_model``: the model is a word model, whose ids are those of whole sentences."""
    excluded = KEY_EXCLUDES + (SPM_TRAINING_KEYS if spm_sha256 else ())
    settings = {k: v for k, v in dataclasses.asdict(data).items() if k not in excluded}
    if settings.get("spm_normalization") == "nmt_nfkc":  # SentencePiece's default: a cache made before the key
        del settings["spm_normalization"]
    if data.sources:  # where each corpus is and how often it is drawn do not change the content
        settings["sources"] = [{"tag": c.tag, "langs": c.langs, "hub_config": c.hub_config} for c in data.corpora()]
    settings["cleaning"] = CLEANING_RULES  # (a cache of the first rules, before the key: prepared again)
    measured = measured_languages(data)
    if measured:  # the cleaning rules measure these languages in characters
        settings["characters"] = measured
    if spm_sha256:
        settings["spm_model_sha256"] = spm_sha256
    elif spells_in_bytes(data):
        settings["byte_fallback"] = True
    if spm_texts is not None and not spm_sha256:
        settings["spm_texts"] = spm_texts
    if word_model:  # its ids are those of whole sentences (WordCache encodes no word alone)
        settings["word_model_ids"] = "sentences"
    blob = json.dumps(
        {
            "format": FORMAT_VERSION,
            "sentencepiece": sentencepiece.__version__,
            "spm_seed": SPM_SEED,
            "settings": settings,
            "inputs": fingerprint,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _check_writable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"cannot write the prepared cache to {out}: it exists and is not a directory")
    check_directory(out)  # a file above it: named (mkdir said only "File exists")
    check_replaceable(out, "manifest.json")  # a directory of the user's own files: refused before the work
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out.parent):
            pass
    except OSError as exc:
        raise DataError(f"cannot write the prepared cache to {out}: {exc.strerror or exc}") from None


def _previous_manifest(out: Path) -> dict[str, Any]:
    """The existing cache's manifest as recorded, or {} (none, or unreadable: checked later)."""
    try:
        manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


#: What a word model's cache records (``word_model_ids``): its ids are those of whole sentences,
#: as ``translate`` encodes them. An older mtcli encoded such sentences a word at a time.
WORD_MODEL_IDS = "sentences"


def word_ids_stale(corpus: PreparedCorpus) -> bool:
    """Whether ``corpus`` is a word model's cache from before :data:`WORD_MODEL_IDS`: its ids
    are not the ones ``translate`` gives (two ``<unk>`` where a sentence encodes to one)."""
    model = corpus.spm_path
    return (corpus.manifest.get("word_model_ids") != WORD_MODEL_IDS and len(tokenizer_files(model)) == 1
            and is_word_model(model))


def _current_cache(out: Path, key: str) -> PreparedCorpus | None:
    """The existing cache if it is complete, verified, and built from ``key``; else None."""
    if not (out / "manifest.json").is_file():
        return None
    try:
        corpus = PreparedCorpus.open(out, verify=True)
    except DataError as exc:
        get_logger().warning("existing cache is unusable (%s); rebuilding", exc)
        return None
    if word_ids_stale(corpus):
        get_logger().info("%s was made by an older mtcli, which encoded a word model's sentences a word at a "
                          "time; rebuilding", out)
        return None
    if corpus.manifest.get("build_key") != key:
        get_logger().info("inputs or data settings changed since %s was built, or the versions of mtcli's cache "
                          "or of sentencepiece did; rebuilding", out)
        return None
    return corpus


# ----------------------------------------------------------------------------- prepare


@contextlib.contextmanager
def _naming_write_errors(out: Path, build: Path) -> Iterator[None]:
    """Turn a write that fails without naming a file, or for want of room naming one in the
    hidden ``build`` directory (disk full, file-size limit), into a one-line :class:`DataError`
    naming the cache being built."""
    try:
        yield
    except OSError as exc:
        if exc.errno is None or (exc.filename is not None and not (
                str(exc.filename).startswith(str(build)) and exc.errno in NO_ROOM)):
            raise
        kept = "the previous cache is unchanged" if (out / "manifest.json").is_file() else "nothing was written"
        raise DataError(f"{out}: cannot write the prepared cache ({exc.strerror}); {kept}") from None


def spm_sample(paths: list[Path], total: int, cap: int, seed: int) -> Iterator[bytes]:
    """The lines of ``paths`` (``total`` of them in all) SentencePiece trains on, as blocks of
    whole lines (UTF-8 bytes, each line ended by ``\n``): every line when ``cap`` is 0 or
    ``total <= cap``, else a uniform sample of ``cap`` lines without replacement, in file order,
    drawn from ``seed``.

    SentencePiece can sample a stream itself (``input_sentence_size``), but its reservoir is
    not reproducible: two runs of one command on a 4.5M-pair corpus gave two vocabularies. This
    sample depends on the seed and the count only, and holds just the chosen line numbers.
    """
    chosen = np.sort(np.random.default_rng(seed).choice(total, size=cap, replace=False)) if 0 < cap < total else None
    first = 0  # the line number of the block's first line
    for path in paths:
        for block, ends in line_blocks(path):
            if chosen is None:
                yield bytes(block)
                continue
            lo, hi = np.searchsorted(chosen, [first, first + len(ends)])
            picked = chosen[lo:hi] - first
            yield take_spans(block, np.concatenate(([0], ends[:-1]))[picked], ends[picked])
            first += len(ends)


def _train_spm(tmp: Path, data: DataConfig, plan: Plan, counts: dict[str, CleanCounts]) -> Path:
    """Train the joint SentencePiece model on the cleaned training texts in ``tmp``, each
    distinct one once (:meth:`Plan.spm_texts`), or on :func:`spm_sample`'s sample of them,
    written to a file beside them for SentencePiece to read (and removed)."""
    texts = plan.spm_texts()
    train_txt = [text_path(tmp, c.train_name, lang) for c, lang in texts]
    sentences = sum(counts[c.train_name].kept for c, _ in texts)
    cap = max(data.spm_max_sentences, MIN_SAMPLE) if data.spm_max_sentences > 0 else 0
    sample = tmp / ".spm_sample.txt"
    if 0 < cap < sentences:
        get_logger().info("SentencePiece trains on a uniform sample of %d of the %d training sentences "
                          "(data.spm_max_sentences)", cap, sentences)
        with open(sample, "wb") as handle:
            handle.writelines(spm_sample(train_txt, sentences, cap, SPM_SEED))
        train_txt = [sample]
    settings = dict(vocab_size=data.vocab_size, model_type=data.spm_model_type,
                    character_coverage=data.character_coverage, byte_fallback=spells_in_bytes(data),
                    normalization=data.spm_normalization,
                    max_sentences=0,  # the sample is drawn above; SentencePiece takes every line it is given
                    seed=SPM_SEED, num_threads=SPM_THREADS, control_symbols=plan.symbols())
    try:
        # In a child process: SentencePiece's trainer does not look at signals, so Ctrl-C or SIGTERM
        # would wait for it (minutes at WMT size); the parent stops at once and the pool ends the child.
        # A new one, not a fork: its OpenMP threads would wait forever in a child of a process that
        # ran OpenMP code before (a training, in the same Python process).
        with forked_pool(1, start="spawn") as pool:
            return result_of(pool, pool.apply_async(train_model, (train_txt, tmp / "spm", settings)))
    finally:
        sample.unlink(missing_ok=True)


def _encode_splits(tmp: Path, plan: Plan, model_path: Path, dtype: np.dtype, counts: dict[str, CleanCounts],
                   workers: int, given: bool, data: DataConfig) -> dict[str, dict[str, int]]:
    """Encode every split's text in ``tmp`` into its binarised arrays, a corpus's tags before each
    of its training sources; tokens per split and language. ``given``: the SentencePiece model
    is the config's ``data.spm_model``, not trained here (said, or else how ``data`` trained it,
    in the unknown-token warning)."""
    tokenizer = load_tokenizer(model_path)
    prefixes = {(c.train_name, c.langs[0]): [tokenizer.piece_to_id(t) for t in c.prefix] for c in plan.corpora}
    sources = {c.langs[0] for c in plan.corpora}
    tokens: dict[str, dict[str, int]] = {}
    for split, langs in plan.split_langs().items():
        tokens[split] = {}
        for lang in langs:
            with ArrayWriter(tmp, split, lang, dtype, prefix=prefixes.get((split, lang), ())) as writer:
                if isinstance(tokenizer, VocabTokenizer):  # separate source and target models (import-hf)
                    training = {c.train_name: c.langs for c in plan.corpora}.get(split)
                    target = lang == training[1] if training else lang not in sources
                    encode_with_vocab(tokenizer, text_path(tmp, split, lang), writer, target)
                else:
                    encode_file(model_path, text_path(tmp, split, lang), writer, num_lines=counts[split].kept,
                                workers=workers, show_progress=True)
            tokens[split][lang] = writer.tokens
            warn_of_unknown(split, lang, writer.unknown, writer.tokens, given, data)
        get_logger().info("encoded %s: %s tokens", split, tokens[split])
    return tokens


def _spm_record(data: DataConfig, plan: Plan, given: Path | None, model_path: Path, vocab_size: int) -> dict[str, Any]:
    """The manifest's ``spm`` entry: how the SentencePiece model was trained, or where it came from."""
    if given is not None:
        return {"model": model_path.name, "vocab_size": vocab_size, "given": str(given.resolve()),
                "sha256": sha256_file(model_path), "sentencepiece_version": sentencepiece.__version__}
    return {
        "model": SPM_MODEL,
        "model_type": data.spm_model_type,
        "vocab_size": data.vocab_size,
        "character_coverage": data.character_coverage,
        "byte_fallback": spells_in_bytes(data),
        "normalization": data.spm_normalization,
        "max_sentences": data.spm_max_sentences,
        "trained_on": f"{data.train_split} ({data.src_lang}+{data.tgt_lang}, cleaned)" if not plan.several else
                      f"{data.train_split} of every corpus (both sides, cleaned)",
        "seed": SPM_SEED,
        "sha256": sha256_file(model_path),
        "sentencepiece_version": sentencepiece.__version__,
    }


def _corpora_records(plan: Plan, counts: dict[str, CleanCounts], tokenizer: Tokenizer) -> dict[str, Any]:
    """The manifest's entries for a cache of several corpora: each corpus with its counts, the
    languages of each split, and the tags with their ids."""
    return {
        "corpora": [dict(c.record(), counts=counts[c.train_name].to_dict()) for c in plan.corpora],
        "split_langs": plan.split_langs(),
        "tags": {tag: tokenizer.piece_to_id(tag) for tag in plan.symbols()},
        "target_tags": plan.target_tags,
    }


def _manifest(data: DataConfig, plan: Plan, key: str, fingerprint: dict[str, Any],
              counts: dict[str, CleanCounts], tokens: dict[str, dict[str, int]], dtype: np.dtype,
              spm: dict[str, Any]) -> dict[str, Any]:
    """What ``manifest.json`` records: where the cache came from, how it was built, what it holds."""
    vocab_size = spm["vocab_size"]
    source = plan.corpora[0].source
    return {
        "build_key": key,
        "mtcli_version": __version__,
        "cleaning": {"rules": CLEANING_RULES, "characters": measured_languages(data)},
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "source": {"kind": source.kind, "location": source.location, "hub_config": data.hub_config},
        "inputs": fingerprint,
        "data_config": dataclasses.asdict(data),
        "src_lang": data.src_lang,
        "tgt_lang": data.tgt_lang,
        "splits": plan.splits(),
        "train_split": data.train_split,
        "valid_split": data.valid_split,
        "test_splits": list(dict.fromkeys(data.test_splits)),
        "counts": {split: c.to_dict() for split, c in counts.items()},
        "sentences": {split: c.kept for split, c in counts.items()},
        "tokens": tokens,
        "token_dtype": dtype.name,
        "vocab": {"size": vocab_size, "pad_id": PAD_ID, "unk_id": UNK_ID, "bos_id": BOS_ID, "eos_id": EOS_ID},
        "spm": spm,
    }


def _spm_model(tmp: Path, data: DataConfig, plan: Plan, given: Path | None,
               counts: dict[str, CleanCounts]) -> Path:
    """The cache's SentencePiece model: ``data.spm_model``'s copy (which must hold every tag), or
    one trained on the cleaned training text of every corpus."""
    if given is None:
        return _train_spm(tmp, data, plan, counts)
    if given.name == VOCAB_NAME:
        for file in tokenizer_files(given):
            copy_file(file, tmp / file.name)
        model_path = tmp / VOCAB_NAME
    else:
        model_path = copy_model(given, tmp / "spm")
    get_logger().info("encoding with the given SentencePiece model %s (data.spm_model)", given)
    tokenizer = load_tokenizer(model_path)
    missing = [tag for tag in plan.symbols() if tokenizer.piece_to_id(tag) == UNK_ID]
    if missing:
        raise DataError(f"data.spm_model: {given} has no symbol for the tags {', '.join(missing)} "
                        "(a model trained with them, or none, is needed)")
    return model_path


def prepare(config: Config, force: bool = False) -> PrepareReport:
    """Prepare ``config.data`` into ``config.data.prepared_path()``; a no-op when up to date.

    Raises :class:`DataError` (one line, nothing written) on bad input: mismatched line counts,
    invalid UTF-8, a missing split or language, an empty training split after cleaning, an empty
    validation split, an unwritable output directory, or a hub dataset that cannot be loaded.
    """
    log = get_logger()
    data = config.data
    out = data.prepared_path()
    plan = plan_corpora(data)
    for note in plan.notes:
        log.warning("%s", note)
    if len(plan.target_tags) == 1:
        log.info("each source starts with %s, as in the multilingual model data.spm_model comes from",
                 ", ".join(plan.target_tags.values()))
    if restore_swap(out):
        log.info("%s: put in place the cache a killed prepare had built but not swapped in", out)
    given = given_spm_model(data)
    previous = _previous_manifest(out)
    inputs = FileHasher(previous.get("input_files"), by_path=True)  # unchanged inputs are not re-read
    fingerprint = plan.fingerprint(inputs)
    word_model = (data.spm_model_type == "word" if given is None
                  else len(tokenizer_files(given)) == 1 and is_word_model(given))
    key = build_key(data, fingerprint, given_sha256(given) if given is not None else None,
                    [[corpus.index, lang] for corpus, lang in plan.spm_texts()] if plan.several else None,
                    word_model)
    seen = file_stamp(out / "manifest.json")
    current = None if force else _current_cache(out, key)
    if current is None:  # to be built: a place to write it, and no one else using it (a trainer, a prepare)
        _check_writable(out)
        here = str(Path(config.path).resolve()) if config.path != "<config>" else None
        if previous.get("config_file") not in (None, here) and previous.get("build_key") != key:
            log.warning("%s was prepared for %s, a config of the same data.name (%s): it is prepared again for this "
                        "one; give either its own data.name to keep both", out, previous["config_file"], data.name)
        with CacheLock(out, exclusive=True) as lock:
            if not force and file_stamp(out / "manifest.json") != seen:  # another prepare built it meanwhile
                current = _current_cache(out, key)
            if current is None:
                return _build(data, out, plan, given, inputs, fingerprint, key, lock, here)
    log.info("%s is up to date with %s; nothing to do (--force rebuilds)", out, plan.describe())
    warn_of_overlap(current.manifest.get("shared_with_training", {}))
    return PrepareReport(directory=out, skipped=True, source=plan.describe(), counts=current.counts(),
                         tokens=current.manifest.get("tokens", {}), vocab_size=current.vocab_size)


def _build(data: DataConfig, out: Path, plan: Plan, given: Path | None, inputs: FileHasher,
           fingerprint: dict[str, Any], key: str, lock: CacheLock, config_file: str | None) -> PrepareReport:
    """Write the cache of ``data`` (of the config file ``config_file``) into ``out``
    (:func:`prepare`, which holds ``lock``: on the cache there was, if any)."""
    log = get_logger()
    start = time.perf_counter()
    log.info("preparing %s from %s (splits: %s)", out, plan.describe(), ", ".join(plan.splits()))
    workers = data.num_workers
    with contextlib.ExitStack() as swap, atomic_dir(out, mark="manifest.json") as tmp, _naming_write_errors(out, tmp):
        eval_counts = write_eval(plan, data, tmp)  # first: small, and an empty validation split stops here
        counts, shared = write_training(plan, data, tmp, workers)
        counts.update(eval_counts)
        model_path = _spm_model(tmp, data, plan, given, counts)
        tokenizer = load_tokenizer(model_path)
        warn_of_changed_text(tmp, plan, tokenizer, data.spm_normalization if given is None else None)
        dtype = token_dtype(tokenizer.vocab_size)
        tokens = _encode_splits(tmp, plan, model_path, dtype, counts, workers, given is not None, data)
        spm = _spm_record(data, plan, given, model_path, tokenizer.vocab_size)
        manifest = _manifest(data, plan, key, fingerprint, counts, tokens, dtype, spm)
        if plan.several:
            manifest.update(_corpora_records(plan, counts, tokenizer))
        manifest["input_files"], manifest["config_file"] = inputs.records, config_file
        manifest["shared_with_training"] = shared  # {} for none (a cache without it was not counted)
        if len(tokenizer_files(model_path)) == 1 and is_word_model(model_path):
            manifest["word_model_ids"] = WORD_MODEL_IDS
        write_manifest(tmp, manifest)
        PreparedCorpus.open(tmp, verify=False)
        if lock.fd is None:  # there was none: one another prepare put there since is replaced only
            swap.enter_context(CacheLock(out, exclusive=True))  # if no trainer holds it (held past the swap)
    seconds = time.perf_counter() - start
    log.info("wrote %s in %.1f s", out, seconds)
    return PrepareReport(directory=out, skipped=False, source=plan.describe(),
                         counts={split: c.to_dict() for split, c in counts.items()}, tokens=tokens,
                         vocab_size=tokenizer.vocab_size, seconds=seconds)
