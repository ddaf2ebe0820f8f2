"""Whether a prepared cache is the one a config asks for, before ``train`` reads it.

``prepare`` rebuilds a cache whose inputs or data settings changed; ``train`` only reads one. So
that a data setting changed in the config (or by ``--set``), or a corpus file edited, is not
trained on silently from the old cache, :func:`open_prepared` compares what the cache's manifest
recorded with the config: its data settings (those that shape the content: not where the cache
is, its name or how many workers built it), and the content of its input files while they are
still where they were (a file whose size, time and inode are as recorded is not read again).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mtcli.builddir import live_builders
from mtcli.config import Config, DataConfig
from mtcli.data.cache import CacheLock, PreparedCorpus
from mtcli.data.cleaning import CLEANING_RULES
from mtcli.data.corpora import given_spm_model, plan_corpora
from mtcli.data.download import CORPORA, located
from mtcli.data.prepare import KEY_EXCLUDES, SPM_TRAINING_KEYS, measured_languages, word_ids_stale
from mtcli.data.sources import looks_like_path
from mtcli.errors import DataError
from mtcli.fileio import FileHasher, sha256_file
from mtcli.logs import get_logger


def open_prepared(config: Config, check_inputs: bool = True, resuming: bool = False) -> PreparedCorpus:
    """The prepared cache of ``config`` (checksums verified); :class:`DataError` if it is missing,
    corrupt, or prepared from other data settings or (with ``check_inputs``; under DDP, rank 0
    alone reads them) inputs than the config's. ``resuming``: a run begun on the cache is to
    go on, which preparing it again would end (the advice says so first)."""
    path = config.data.prepared_path()
    lock = CacheLock(path, exclusive=False)  # held while the corpus is: no prepare rebuilds it meanwhile
    if path.exists() and not path.is_dir():
        raise DataError(f"{path}: a file, where the prepared cache should be a directory")
    if not path.is_dir():  # (the lock waited for a prepare between its two renames)
        building = live_builders(path)
        if building:
            raise DataError(f"{path}: another process is preparing it now (`mtcli prepare`, pid {building[0]}): "
                            "train once it has finished")
        here = "" if path.is_absolute() else f" (relative paths are from {Path.cwd()}, where prepare writes it too)"
        raise DataError(f"{path}: no prepared cache{here}; run `{config.prepare_command()}` first")
    try:
        corpus = PreparedCorpus.open(path, verify=True)
    except DataError as exc:  # its advice with this config's command line
        raise DataError(str(exc).replace("`mtcli prepare CONFIG`", f"`{config.prepare_command()}`")) from None
    corpus.lock = lock
    data = config.data
    if len(corpus.corpora) != len(data.sources):
        raise DataError(f"{path}: prepared from {len(corpus.corpora) or 'one'} corpora, the config lists "
                        f"{len(data.sources) or 'one'}; run `{config.prepare_command()}`")
    for split in [data.valid_split] + ([] if data.sources else [data.train_split]):
        if split not in corpus.splits:
            raise DataError(f"{path}: the prepared cache has no split '{split}'; run `{config.prepare_command()} "
                            "--force`")
    if (corpus.src_lang, corpus.tgt_lang) != (data.src_lang, data.tgt_lang):
        raise DataError(f"{path}: prepared for {corpus.src_lang}->{corpus.tgt_lang}, config says "
                        f"{data.src_lang}->{data.tgt_lang}")
    if word_ids_stale(corpus):
        raise DataError(f"{path} was made by an older mtcli, which encoded a word model's sentences a word at a "
                        f"time (other ids than translate gives); run `{config.prepare_command()}`")
    changed = changed_data_settings(corpus.manifest.get("data_config") or {}, data)
    changed += changed_corpora(corpus.corpora, data) + changed_tokenizer(corpus.manifest.get("spm") or {}, data)
    if check_inputs and (files := changed_inputs(data, corpus.manifest.get("inputs") or {},
                                                 corpus.manifest.get("input_files"))):
        changed.append(f"other content in {', '.join(files)}")
    if changed:
        had = " ".join(settings_prepare_had(corpus.manifest.get("data_config") or {}, data))
        settings = f"give this command the data settings prepare had{f' ({had})' if had else ''}"
        if resuming:  # (preparing again first, as the other advice says, made the run one that cannot resume)
            raise DataError(f"{path} was prepared with {'; '.join(changed)}, and {config.train.run_dir} was begun on "
                            f"it as it is: to resume the run, {settings}, or restore the files as they were; to "
                            f"train on the new data, run `{config.prepare_command()}` and train into a new "
                            "train.run_dir (the run resumes only on its own pairs and vocabulary)")
        raise DataError(f"{path} was prepared with {'; '.join(changed)}; run `{config.prepare_command()}`, or "
                        f"{settings}: the cache follows the config's data section and its files")
    if older := _older_cleaning(corpus.manifest.get("cleaning") or {}, measured_languages(data)):
        get_logger().warning("%s was cleaned by an older mtcli's rules (%s): a run resumed on it keeps them; for a new "
                             "run, `%s` cleans it again", path, "; ".join(older), config.prepare_command())
    for source, location in missing_sources(data, corpus.manifest):
        get_logger().warning("data.source %s: no such directory; the cache %s was prepared from %s, and is trained "
                             "on as it is (a mistyped path?)", source, path, location)
    return corpus


def _older_cleaning(cleaned: dict[str, Any], measured: list[str]) -> list[str]:
    """How a cache's cleaning (its manifest's ``cleaning``: none before it was recorded) differs
    from what ``prepare`` does now, whose length rules measure ``measured`` in characters."""
    older = []
    if cleaned.get("rules", 1) < CLEANING_RULES:
        older.append("a side of invisible format characters alone was kept")
    recorded = cleaned.get("characters")  # (None: not recorded, a difference only if some are measured now)
    if recorded != measured and (recorded is not None or measured):
        then = "not recorded" if recorded is None else ", ".join(recorded) or "none"
        older.append(f"languages measured in characters: {', '.join(measured) or 'none'} now, {then} then")
    return older


def missing_sources(data: DataConfig, manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """``(config's path, recorded location)`` for each corpus the config names by a path (not a
    corpus name or hub id) that does not exist and that is not where the cache read it from: a
    cache may outlive its corpus, but a mistyped path would train on the old data unseen."""
    recorded = [c.get("source") or {} for c in manifest.get("corpora") or []] or [manifest.get("source") or {}]
    found = []
    for corpus, source in zip(data.corpora(), recorded, strict=False):
        path = Path(corpus.source).expanduser()
        was = Path(str(source.get("location") or "")).expanduser()
        if looks_like_path(corpus.source) and not path.exists() and path.resolve() != was.resolve():
            found.append((corpus.source, str(source.get("location"))))
    return found


def changed_data_settings(saved: dict[str, Any], data: DataConfig) -> list[str]:
    """The data settings that shape a cache's content (those of
    :func:`~mtcli.data.prepare.build_key`) whose value in ``saved`` (a manifest's
    ``data_config``) is not ``data``'s, as ``data.key=old (the config: new)``. Keys a cache from
    an older mtcli did not record are not compared, except those :data:`BEFORE_THE_KEY` knows
    the value of."""
    return [f"data.{key}={old!r} (the config: {new!r})" for key, old, new in _changed(saved, data)]


def settings_prepare_had(saved: dict[str, Any], data: DataConfig) -> list[str]:
    """``--set data.key=value`` for each setting :func:`changed_data_settings` finds changed: the
    cache's values, which a command given them reads the cache with."""
    return [f"--set data.{key}={old}" for key, old, _ in _changed(saved, data)]


def _changed(saved: dict[str, Any], data: DataConfig) -> list[tuple[str, Any, Any]]:
    """``(key, the cache's value, the config's)`` of :func:`changed_data_settings`."""
    excluded = KEY_EXCLUDES + (SPM_TRAINING_KEYS if data.spm_model else ())
    saved = {**BEFORE_THE_KEY, **saved}
    return [(key, saved[key], value) for key, value in dataclasses.asdict(data).items()
            if key not in excluded and key in saved and saved[key] != value]


#: What a cache made before a data key existed was made with (compared as if recorded).
BEFORE_THE_KEY = {"spm_normalization": "nmt_nfkc"}


def changed_corpora(recorded: list[dict[str, Any]], data: DataConfig) -> list[str]:
    """For a cache of several corpora, what ``data.sources`` now gives otherwise than the cache's
    ``recorded`` corpora, in order (each corpus's direction, tag and hub config: what its pairs
    are and what they start with; where it is read from and its weight are not compared), as
    ``data.sources[i].key=old (the config: new)``."""
    if not data.sources:
        return []
    changed = []
    for i, (old, now) in enumerate(zip(recorded, data.corpora(), strict=False)):
        was = {"langs": old.get("langs"), "tag": old.get("tag"), "hub_config": (old.get("source") or {}).get("hub_config")}
        for key, value in (("langs", list(now.langs or ())), ("tag", now.tag), ("hub_config", now.hub_config)):
            if was[key] != value:
                changed.append(f"data.sources[{i}].{key}={was[key]!r} (the config: {value!r})")
    return changed


def changed_tokenizer(recorded: dict[str, Any], data: DataConfig) -> list[str]:
    """``data.spm_model`` when the cache was encoded with another tokenizer: a given model whose
    content is not the one recorded, one given where the cache trained its own, or none given
    where the cache was encoded with one."""
    try:
        given = given_spm_model(data)
    except DataError:  # gone since the cache copied it (as a corpus, it may outlive it): else a mistake
        was = Path(recorded.get("given") or "/").resolve()
        if data.spm_model and Path(data.spm_model).expanduser().resolve() in (was, was.parent):
            return []
        raise
    if given is None:
        return [f"data.spm_model={recorded['given']!r} (the config: None)"] if recorded.get("given") else []
    if not recorded.get("given"):
        return [f"data.spm_model=None, a model trained on the corpus (the config: {data.spm_model!r})"]
    if recorded.get("sha256") and recorded["sha256"] != sha256_file(given):
        return [f"data.spm_model: another tokenizer than the one at {recorded['given']} then (the config: "
                f"{data.spm_model!r})"]
    return []


def changed_inputs(data: DataConfig, saved: dict[str, Any], known: dict[str, Any] | None) -> list[str]:
    """The input files of ``data``'s corpora whose content is not what a cache recorded
    (``saved``: its manifest's ``inputs``; ``known``: its ``input_files``). Only corpora read
    here without a download (local directories, named corpora present) are compared, and none
    when one of them is gone or unreadable: a cache may outlive its inputs."""
    if not saved or not all(_here(c.source) for c in data.corpora()):
        return []
    try:
        now = plan_corpora(data).fingerprint(FileHasher(known, by_path=True))
    except DataError:
        return []
    old, new = _digests(saved), _digests(now)
    return sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))


def _here(source: str) -> bool:
    """Whether a corpus can be read here without a download: a local directory, or a corpus
    mtcli knows by name whose copy is here (a hub id is not compared)."""
    return Path(source).expanduser().is_dir() or (source in CORPORA and located(source) is not None)


def _digests(fingerprint: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A fingerprint's file digests by name (``corpora[i]/name`` for several corpora)."""
    if "corpora" in fingerprint:
        return {name: digest for i, part in enumerate(fingerprint["corpora"])
                for name, digest in _digests(part, f"corpora[{i}]/").items()}
    return {prefix + name: digest for name, digest in (fingerprint.get("files") or {}).items()}
