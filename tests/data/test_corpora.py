"""Several corpora in one cache (data.sources): per-corpus cleaning and counts, tags as atomic
SentencePiece symbols before the sources, evaluation splits per language, and weighted batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import TOY_CONFIG, TOY_DIR, make_trilingual, multi_overrides

from mtcli.config import config_from_dict, load_config, with_changes
from mtcli.data.batching import BatchStream, CorpusMix
from mtcli.data.cache import PreparedCorpus
from mtcli.data.corpora import plan_corpora
from mtcli.data.freshness import open_prepared
from mtcli.data.prepare import prepare
from mtcli.data.sampling import subword_resegmenter
from mtcli.data.tokenizer import Tokenizer
from mtcli.errors import ConfigError, DataError
from mtcli.evaluate import evaluate
from mtcli.train.run import train


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(corpus root, prepared cache) of the trilingual toy, prepared once for the module."""
    root = make_trilingual(tmp_path_factory.mktemp("multi"))
    prepared = root / "prepared"
    prepare(load_config(TOY_CONFIG, multi_overrides(root, prepared)))
    return root, prepared


def test_each_corpus_is_cleaned_and_counted_on_its_own(multi: tuple[Path, Path]) -> None:
    _, prepared = multi
    corpus = PreparedCorpus.open(prepared)
    records = corpus.corpora
    assert [r["split"] for r in records] == ["train.0", "train.1", "train.2", "train.3"]
    assert [r["langs"] for r in records] == [["src", "tgt"], ["tgt", "src"], ["src", "xx"], ["src", "tgt"]]
    assert records[3]["counts"]["read"] == 110 and records[3]["counts"]["dropped"]["duplicate"] == 10
    assert records[0]["counts"]["dropped"]["duplicate"] == records[1]["counts"]["dropped"]["duplicate"]
    assert corpus.split_langs["val"] == ["src", "tgt", "xx"]
    assert corpus.corpus_sizes() == [records[k]["counts"]["kept"] for k in range(4)]


def test_the_vocabulary_learns_each_text_once(multi: tuple[Path, Path]) -> None:
    """One corpus read in several directions gives the joint SentencePiece model its text once
    (counted six times, Multi30k's English would outweigh each other language threefold, and
    sentencepiece 0.2.2's unigram trainer stalls on text that repeats)."""
    root, prepared = multi
    plan = plan_corpora(load_config(TOY_CONFIG, multi_overrides(root, prepared)).data)
    texts = [(corpus.train_name, lang) for corpus, lang in plan.spm_texts()]
    assert texts == [("train.0", "src"), ("train.0", "tgt"), ("train.2", "xx"), ("train.3", "src"), ("train.3", "tgt")]


def test_the_vocabulary_learns_each_pair_of_one_directory_of_tsv_files(multi: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """train.en-de.tsv and train.en-fr.tsv in one directory hold other English: the second
    pair's was taken for the first's and never learned (its words spelled in single letters)."""
    root, _ = multi
    pairs = tmp_path / "pairs"
    pairs.mkdir()
    for split in ("train", "val", "test"):
        src, tgt = ((root / "tri" / f"{split}.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("src", "tgt"))
        for other, lines in (("tgt", tgt), ("xx", [line.upper() for line in src])):
            (pairs / f"{split}.src-{other}.tsv").write_text(
                "".join(f"{a if other == 'tgt' else a[::-1]}\t{b}\n" for a, b in zip(src, lines, strict=True)),
                encoding="utf-8")
    overrides = multi_overrides(root, tmp_path / "p")
    overrides[1] = f"data.sources=[{{source: {pairs}, langs: [src, tgt]}}, {{source: {pairs}, langs: [src, xx]}}]"
    plan = plan_corpora(load_config(TOY_CONFIG, overrides).data)
    texts = [(corpus.train_name, lang) for corpus, lang in plan.spm_texts()]
    assert texts == [("train.0", "src"), ("train.0", "tgt"), ("train.1", "src"), ("train.1", "xx")]
    # a cache whose vocabulary learned other texts (as before this was mended) is prepared again
    from mtcli.data.corpora import Plan

    learned = Plan.spm_texts
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(Plan, "spm_texts", lambda self: [text for text in learned(self) if text[0].index == 0 or
                                                         text[1] == "xx"])
        assert not prepare(load_config(TOY_CONFIG, overrides)).skipped
        assert prepare(load_config(TOY_CONFIG, overrides)).skipped
    assert not prepare(load_config(TOY_CONFIG, overrides)).skipped


def test_tags_are_atomic_symbols_before_the_sources_only(multi: tuple[Path, Path]) -> None:
    _, prepared = multi
    corpus = PreparedCorpus.open(prepared)
    tokenizer = Tokenizer(corpus.spm_path)
    tags = corpus.tags
    assert set(tags) == {"<2src>", "<2tgt>", "<2xx>", "<bt>"}
    assert corpus.target_tags == {"tgt": "<2tgt>", "src": "<2src>", "xx": "<2xx>"}
    for tag, i in tags.items():
        assert tokenizer.id_to_piece(i) == tag
        assert i not in tokenizer.encode(f"{tag} hund")  # text never encodes to a tag
        assert tokenizer.decode([i, *tokenizer.encode("hund")]) == "hund"  # decoding never writes one
    first = {k: corpus.array(f"train.{k}", lang)[0].tolist() for k, lang in enumerate(["src", "tgt", "src", "src"])}
    assert first[0][0] == tags["<2tgt>"] and first[1][0] == tags["<2src>"] and first[2][0] == tags["<2xx>"]
    assert first[3][:2] == [tags["<2tgt>"], tags["<bt>"]]
    untagged = tokenizer.encode(corpus.text_path("train.0", "src").read_text().split("\n")[0])
    assert first[0][1:] == untagged
    for split in ("val", "test"):
        for lang in ("src", "tgt", "xx"):
            assert not set(tags.values()) & set(np.concatenate([corpus.array(split, lang)[i] for i in range(3)]))
    src, tgt = corpus.train_pairs()
    assert len(src) == len(tgt) == sum(corpus.corpus_sizes())


def test_rebuilt_only_when_the_content_changes(multi: tuple[Path, Path]) -> None:
    root, prepared = multi
    again = prepare(load_config(TOY_CONFIG, multi_overrides(root, prepared, extra_weight=3.0)))
    assert again.skipped  # a weight changes which pairs an epoch draws, not the cache


def test_config_rules_name_the_key() -> None:
    base = {"name": "x", "src_lang": "en", "tgt_lang": "de"}
    cases = {
        "data.sources[1].weight must be > 0": [{"source": "a"}, {"source": "b", "weight": 0}],
        "data.sources[0].langs must be two different languages": [{"source": "a", "langs": ["en", "en"]}],
        "unknown key 'data.sources[0].wieght'": [{"source": "a", "wieght": 2}],
        "no corpus of data.sources goes en->de": [{"source": "a", "langs": ["de", "en"]}],
        "data.sources[0].tag must be one symbol": [{"source": "a", "tag": "two words"}],
    }
    for message, sources in cases.items():
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            config_from_dict({"data": dict(base, sources=sources)}, "r.yaml")
    with pytest.raises(ConfigError, match="not both"):
        config_from_dict({"data": dict(base, source="a", sources=[{"source": "b"}])}, "r.yaml")


def test_a_missing_split_is_a_one_line_error(multi: tuple[Path, Path], tmp_path: Path) -> None:
    root, _ = multi
    config = load_config(TOY_CONFIG, [*multi_overrides(root, tmp_path / "p"), "data.test_splits=[nope]"])
    with pytest.raises(DataError, match="no corpus holds split 'nope' in src and tgt"):
        prepare(config)
    assert not (tmp_path / "p").exists()


def _own_test_sets(root: Path, out: Path, shorter: bool) -> Path:
    """A src-xx corpus of the trilingual toy's training pairs whose validation and test splits
    are other sentences (the lines in reverse order; with ``shorter``, one fewer)."""
    out.mkdir()
    for split in ("train", "val", "test"):
        for lang in ("src", "xx"):
            lines = (root / "tri" / f"{split}.{lang}").read_text().splitlines(keepends=True)
            if split != "train":
                lines = lines[::-1][: len(lines) - shorter]
            (out / f"{split}.{lang}").write_text("".join(lines))
    return out


@pytest.mark.parametrize("shorter", [False, True], ids=["same-length", "shorter"])
def test_a_corpus_with_its_own_test_sets_keeps_them_apart(multi: tuple[Path, Path], tmp_path: Path,
                                                          shorter: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A src-tgt corpus and a src-xx corpus whose test sets are other sentences: the second's
    src lines beside the first's would pair unrelated sentences (same length, no error before),
    so its splits are stored as its own, ``val.src-xx``, which validation and scoring read."""
    root, _ = multi
    own = _own_test_sets(root, tmp_path / "own", shorter)
    overrides = multi_overrides(root, tmp_path / "p")
    overrides[1] = f"data.sources=[{{source: {root}/tri, langs: [src, tgt]}}, {{source: {own}, langs: [src, xx]}}]"
    with caplog.at_level("INFO", logger="mtcli"):
        prepare(load_config(TOY_CONFIG, [*overrides, "data.tgt_lang=xx"]))  # the direction of the second corpus
    assert f"val.src-xx is the split 'val' of {own}, kept apart: its text in a language an earlier corpus gives " \
        "differs" in caplog.text
    corpus = PreparedCorpus.open(tmp_path / "p")
    assert corpus.split_langs["val"] == ["src", "tgt"] and corpus.split_langs["val.src-xx"] == ["src", "xx"]
    for split in ("val", "test"):
        name = corpus.eval_split(split, "src", "xx")
        assert name == f"{split}.src-xx" == corpus.eval_split(split, "xx", "src")
        for lang in ("src", "xx"):
            assert corpus.text_path(name, lang).read_text() == (own / f"{split}.{lang}").read_text()
        assert corpus.eval_split(split, "src", "tgt") == split
        assert corpus.eval_copies(split) == [split, f"{split}.src-xx"]
    config = load_config(TOY_CONFIG, [*overrides, "data.tgt_lang=xx", f"train.run_dir={tmp_path / 'run'}",
                                      "train.max_steps=2", "train.valid_every=2"])
    train(config)  # validation reads val.src-xx
    text = tmp_path / "run" / "text"
    assert (text / "test.src-xx.xx").read_text() == (own / "test.xx").read_text()
    assert (text / "test.src").read_text() == (root / "tri" / "test.src").read_text()
    report = evaluate(tmp_path / "run", split="test", src_lang="src", beam=1)
    assert Path(report["reference"]) == text / "test.src-xx.xx"


def test_a_corpus_sharing_no_language_keeps_its_splits_apart(multi: tuple[Path, Path], tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """A src-tgt corpus and an aa-bb one: nothing shows their test sets are the same sentences,
    so aa-bb's are its own (they joined the split, and src->aa was then scored on unrelated
    lines; or, of another length, prepare refused the config)."""
    import shutil

    root, _ = multi
    other = tmp_path / "other"
    other.mkdir()
    for split in ("train", "val", "test"):
        shutil.copy(root / "tri" / f"{split}.src", other / f"{split}.aa")
        shutil.copy(root / "tri" / f"{split}.xx", other / f"{split}.bb")
    overrides = multi_overrides(root, tmp_path / "p")
    overrides[1] = f"data.sources=[{{source: {root}/tri, langs: [src, tgt]}}, {{source: {other}, langs: [aa, bb]}}]"
    data = load_config(TOY_CONFIG, overrides).data
    plan = plan_corpora(data)
    assert plan.read_as == {"val": "val", "test": "test", "val.aa-bb": "val", "test.aa-bb": "test"}
    assert plan.split_langs()["val"] == ["src", "tgt"] and plan.split_langs()["val.aa-bb"] == ["aa", "bb"]
    from mtcli.data.corpora import write_eval

    (tmp_path / "written").mkdir()
    with caplog.at_level("INFO", logger="mtcli"):
        write_eval(plan, data, tmp_path / "written")
    assert f"val.aa-bb is the split 'val' of {other}, kept apart: it has no language of an earlier corpus's" \
        in caplog.text  # (it said their texts differ in a language: they have none in common)


def test_a_test_split_of_another_direction_alone_says_how_to_score_it(multi: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """A split only a src-xx corpus holds cannot be a test split of a src->tgt recipe; the
    error said so, not how to score it anyway."""
    import shutil

    root, _ = multi
    other = tmp_path / "other"
    other.mkdir()
    for split, lang in (("train", "src"), ("train", "xx"), ("test", "src"), ("test", "xx")):
        shutil.copy(root / "tri" / f"{split}.{lang}", other / f"{'news' if split == 'test' else split}.{lang}")
    overrides = multi_overrides(root, tmp_path / "p")
    overrides[1] = f"data.sources=[{{source: {root}/tri, langs: [src, tgt]}}, {{source: {other}, langs: [src, xx]}}]"
    with pytest.raises(DataError, match=r"no corpus holds split 'news' in src and tgt \(the direction data.src_lang "
                                        r"-> data.tgt_lang\); it is src->xx's: leave it out of data.test_splits and "
                                        r"score it with `mtcli evaluate RUN --src FILE --ref FILE"):
        plan_corpora(load_config(TOY_CONFIG, [*overrides, "data.test_splits=[test, news]"]).data)


def test_a_corpus_adding_no_language_to_a_split_is_not_read_for_it(multi: tuple[Path, Path], tmp_path: Path) -> None:
    """A corpus whose two languages a split already holds from corpora before it adds nothing
    to it, whatever its text: the first corpus's pairs are scored."""
    root, _ = multi
    own = _own_test_sets(root, tmp_path / "own", shorter=False)
    (own / "test.xx").write_text("not read\n")  # would not even pair with its own test.src
    overrides = multi_overrides(root, tmp_path / "p")
    overrides[1] = (f"data.sources=[{{source: {root}/tri, langs: [src, xx]}}, {{source: {own}, langs: [src, xx]}}, "
                    f"{{source: {root}/tri, langs: [src, tgt]}}]")
    plan = plan_corpora(load_config(TOY_CONFIG, overrides).data)
    assert plan.read_as == {"val": "val", "test": "test"}
    assert plan.corpora[1].provides == []


def test_a_cache_of_other_corpora_is_refused(multi: tuple[Path, Path]) -> None:
    _, prepared = multi
    config = load_config(TOY_CONFIG, [f"data.source={TOY_DIR}", f"data.prepared_dir={prepared}"])
    with pytest.raises(DataError, match="prepared from 4 corpora, the config lists one"):
        open_prepared(config)


def test_weights_draw_each_corpus_that_often() -> None:
    indices = np.arange(300)  # corpus 0: 0..99, corpus 1: 100..299
    same = CorpusMix([100, 200], [1.0, 1.0], seed=1)
    assert same.epoch_indices(indices, 0) is indices
    mix = CorpusMix([100, 200], [2.0, 0.25], seed=1)
    first = mix.epoch_indices(indices, 0)
    counts = np.bincount(first, minlength=300)
    assert (counts[:100] == 2).all()
    assert int((counts[100:] == 1).sum()) == 50 and counts[100:].max() == 1
    assert np.array_equal(first, CorpusMix([100, 200], [2.0, 0.25], seed=1).epoch_indices(indices, 0))
    assert not np.array_equal(first, mix.epoch_indices(indices, 1))  # another quarter each epoch
    assert mix.shares(indices) == pytest.approx([200 / 250, 50 / 250])
    with pytest.raises(DataError, match="lists 3 corpora but the prepared cache holds 2"):
        CorpusMix([100, 200], [1.0, 1.0, 1.0], seed=1)
    # weight x pairs on average, not rounded each epoch: 0.0002 of 2,000 pairs was 0 pairs, ever
    rare = CorpusMix([5, 2000], [0.5, 0.0002], seed=1)
    drawn = [rare.epoch_indices(np.arange(2005), epoch) for epoch in range(400)]
    assert sum(int((d < 5).sum()) for d in drawn) == pytest.approx(400 * 2.5, rel=0.15)
    assert sum(int((d >= 5).sum()) for d in drawn) == pytest.approx(400 * 0.4, rel=0.3)


@pytest.mark.parametrize("pack_length", [0, 32], ids=["token-batches", "packed"])
def test_weighted_stream_resumes_exactly(multi: tuple[Path, Path], pack_length: int) -> None:
    _, prepared = multi
    corpus = PreparedCorpus.open(prepared)

    def stream() -> BatchStream:
        return BatchStream(*corpus.train_pairs(), max_tokens=300, max_source_length=100, max_target_length=100,
                           seed=3, mix=CorpusMix(corpus.corpus_sizes(), [1.0, 0.5, 0.5, 2.0], seed=3),
                           pack_length=pack_length)

    whole = stream()
    groups = [whole.next_group().batches for _ in range(40)]  # several epochs
    resumed = stream()
    for _ in range(17):
        resumed.next_group()
    state = json.loads(json.dumps(resumed.state_dict()))
    fresh = stream()
    fresh.load_state_dict(state)
    rest = [fresh.next_group().batches for _ in range(23)]
    def plain(batches: list) -> list:  # a token batch is an index array, a packed one a list of rows
        return [[np.asarray(row).tolist() for row in b] if isinstance(b, list) else b.tolist() for b in batches]

    assert [plain(a) for a in groups[17:]] == [plain(b) for b in rest]


def test_subword_sampling_keeps_each_corpus_and_its_tags(multi: tuple[Path, Path], tmp_path: Path) -> None:
    root, prepared = multi
    config = load_config(TOY_CONFIG, [*multi_overrides(root, prepared), "train.subword_alpha=0.1",
                                      f"train.run_dir={tmp_path / 'run'}"])
    corpus = PreparedCorpus.open(prepared)
    tokenizer = Tokenizer(corpus.spm_path)
    resegment = subword_resegmenter(corpus, config)
    cached = corpus.train_pairs()
    epoch0, again, epoch1 = resegment(0), resegment(0), resegment(1)
    tags = set(corpus.tags.values())
    for side in (0, 1):
        assert len(epoch0[side]) == len(cached[side]) == sum(corpus.corpus_sizes())
        resampled = 0
        for i in range(len(cached[side])):
            best, drawn = cached[side][i].tolist(), epoch0[side][i].tolist()
            n = len([t for t in best if t in tags])  # the tags in front, on sources only
            assert drawn[:n] == best[:n] and not tags & set(drawn[n:]), (side, i)
            assert tokenizer.decode(drawn[n:]) == tokenizer.decode(best[n:])
            assert drawn == again[side][i].tolist()  # an epoch's draw is a function of the epoch
            resampled += drawn != best
        assert resampled > len(cached[side]) // 4, side
        assert any(epoch0[side][i].tolist() != epoch1[side][i].tolist() for i in range(len(cached[side])))
    # src->tgt and src->xx read the same source text: each corpus draws its own segmentation of it
    sizes = corpus.corpus_sizes()
    first, third = range(sizes[0]), range(sizes[0] + sizes[1], sum(sizes[:3]))
    same = [(i, j) for i, j in zip(first, third, strict=False) if cached[0][i].tolist()[1:] == cached[0][j].tolist()[1:]]
    assert len(same) > len(first) // 2
    assert any(epoch0[0][i].tolist()[1:] != epoch0[0][j].tolist()[1:] for i, j in same)
    # and the trainer reads them: a couple of steps over every corpus
    summary = train(with_changes(config, "train", max_steps=2, valid_every=100000, valid_bleu=False))
    assert summary.steps == 2
    assert "subword regularisation" in (tmp_path / "run" / "train.log").read_text(encoding="utf-8")


def test_unchanged_inputs_of_several_directories_are_not_read_again(tmp_path: Path, monkeypatch) -> None:
    """tri/train.src and extra/train.src share a name: each keeps its own record of its digest."""
    import os
    import time

    from mtcli import fileio

    root = make_trilingual(tmp_path)
    hour_ago = time.time_ns() - 3600 * 10**9
    inputs = sorted((root / "tri").iterdir()) + sorted((root / "extra").iterdir())
    for path in inputs:
        os.utime(path, ns=(hour_ago, hour_ago))
    config = load_config(TOY_CONFIG, multi_overrides(root, root / "prepared"))
    prepare(config)
    read: list[Path] = []
    hash_file = fileio.sha256_file
    monkeypatch.setattr(fileio, "sha256_file", lambda path: read.append(Path(path)) or hash_file(path))
    assert prepare(config).skipped
    open_prepared(config)
    assert [path for path in read if path in inputs] == []


def test_a_corpus_directory_whose_files_were_replaced_by_others_is_changed_input(tmp_path: Path) -> None:
    """Its text files swapped for tables of other pairs: the cache's files are gone, new ones are
    read; every one of them is named (not only the names both fingerprints share)."""
    import shutil

    from mtcli.data.freshness import changed_inputs
    from mtcli.fileio import FileHasher

    root = tmp_path / "corpus"
    shutil.copytree(TOY_DIR, root)
    data = load_config(TOY_CONFIG, [f"data.source={root}"]).data
    saved = plan_corpora(data).fingerprint(FileHasher(by_path=True))
    assert changed_inputs(data, saved, None) == []
    for split in ("train", "val", "test"):
        src, tgt = ((root / f"{split}.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("src", "tgt"))
        (root / f"{split}.src-tgt.tsv").write_text("".join(f"{t}\t{s}\n" for s, t in zip(src, tgt, strict=True)),
                                                   encoding="utf-8")
        (root / f"{split}.src").unlink()
        (root / f"{split}.tgt").unlink()
    assert changed_inputs(data, saved, None) == sorted(
        f"{split}.{name}" for split in ("train", "val", "test") for name in ("src", "tgt", "src-tgt.tsv"))


def test_a_later_corpus_whose_own_test_set_is_not_read_is_named(tmp_path: Path, caplog) -> None:
    """Two corpora of one language pair, each with its own test set: the first's is read, and
    prepare says the second's is not (the same corpus listed again, in reverse, says nothing);
    once, not again at each train start."""
    root = make_trilingual(tmp_path)
    other = root / "other"
    other.mkdir()
    for split in ("train", "val", "test"):
        for lang in ("src", "tgt"):
            lines = (TOY_DIR / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()
            lines = lines if split != "test" else [f"{line} x" for line in lines]
            (other / f"{split}.{lang}").write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    sources = f"[{{source: {root}/tri, langs: [src, tgt]}}, {{source: {root}/tri, langs: [tgt, src]}}, {{source: {other}}}]"
    config = load_config(TOY_CONFIG, ["data.source=", f"data.sources={sources}", f"data.prepared_dir={tmp_path / 'p'}"])
    note = (f"data.sources[2] ({other}): its split 'test' is not read: data.sources[0] ({root}/tri) gives it in src "
            "and tgt with other sentences, and validation and evaluate read that")
    assert plan_corpora(config.data).notes == [note] and "is not read" not in caplog.text  # said by prepare
    prepare(config)
    assert [r.getMessage() for r in caplog.records if "is not read" in r.getMessage()] == [note]


def test_an_empty_validation_split_is_refused_only_where_validation_reads_it(
        multi: tuple[Path, Path], tmp_path: Path, caplog) -> None:
    root, _ = multi
    own = _own_test_sets(root, tmp_path / "own", shorter=False)
    for lang in ("src", "xx"):
        (own / f"val.{lang}").write_text("")
    overrides = multi_overrides(root, tmp_path / "p")
    overrides[1] = f"data.sources=[{{source: {root}/tri, langs: [src, tgt]}}, {{source: {own}, langs: [src, xx]}}]"
    prepare(load_config(TOY_CONFIG, overrides))  # validation reads src->tgt's val, from tri
    assert f"{own}: split 'val' (data.valid_split; kept apart as val.src-xx) has no pairs; validation reads val " in caplog.text
    with pytest.raises(DataError, match=r"split 'val' \(data.valid_split\) has no pairs; validation needs at least one pair"):
        prepare(load_config(TOY_CONFIG, [*overrides, "data.tgt_lang=xx", f"data.prepared_dir={tmp_path / 'q'}"]))


def test_a_corpus_listed_twice_is_warned_about() -> None:
    """Listed again (a copy-paste), a corpus is drawn twice as often: a weight said twice."""
    sources = (f"[{{source: {TOY_DIR}}}, {{source: {TOY_DIR}, langs: [tgt, src]}}, {{source: {TOY_DIR}/./, weight: 2}}]")
    plan = plan_corpora(load_config(TOY_CONFIG, ["data.source=", f"data.sources={sources}"]).data)
    assert len(plan.spm_texts()) == 2  # (another spelling of the same directory: its text learned once)
    assert plan.notes == [f"data.sources[2] repeats data.sources[0] ({TOY_DIR}/./, src->tgt): its pairs are drawn with "
                        "both weights together; list it once with the weight it should have"]


def test_corpora_of_one_target_language_get_no_target_tag() -> None:
    """A tag asks for a language: with one target there is none to ask for, and no source starts
    with one."""
    sources = f"[{{source: {TOY_DIR}}}, {{source: {TOY_DIR}/./, weight: 2}}]"
    plan = plan_corpora(load_config(TOY_CONFIG, ["data.source=", f"data.sources={sources}"]).data)
    assert plan.target_tags == {} and [corpus.prefix for corpus in plan.corpora] == [[], []]
    assert plan.symbols() == []


def test_one_target_language_spelled_two_ways_is_warned_of(multi: tuple[Path, Path], tmp_path: Path) -> None:
    """de and de_DE became two target languages with two tags, each on part of the German data."""
    import shutil

    from mtcli.data.corpora import one_language_twice

    root, _ = multi
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(root / "tri" / "train.src", other / "train.src")
    shutil.copy(root / "tri" / "train.tgt", other / "train.tgt_XY")
    overrides = multi_overrides(root, tmp_path / "p")
    overrides[1] = f"data.sources=[{{source: {root}/tri, langs: [src, tgt]}}, {{source: {other}, langs: [src, tgt_XY]}}]"
    notes = plan_corpora(load_config(TOY_CONFIG, overrides).data).notes
    assert notes == ["target languages tgt and tgt_XY look like one language spelled two ways: each gets its own tag "
                     "(<2tgt>, <2tgt_XY>) and the data of its corpora only; spell them alike if they are one",
                     # (a corpus of train files alone: said at prepare, not first by evaluate after the training)
                     "src->tgt_XY: no test split holds it in both languages (data.test_splits: test); evaluate scores "
                     "it only on files given (--src, --ref)"]
    assert one_language_twice(["pt_BR", "pt-PT", "zh-Hans", "zh-Hant", "de"]) == []  # variants, told apart
    assert len(one_language_twice(["pt_BR", "pt-br"])) == 1
