"""Tests of mtcli.data.tokenizer: joint SentencePiece training, fixed special ids, round trips."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from mtcli.data.textio import read_lines
from mtcli.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from mtcli.errors import DataError

TOY_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "toy"

SENTENCES = [
    "Ein Mann fährt mit dem Fahrrad über die Brücke.",
    "Two young children are playing in the garden, laughing.",
    "Die Frau liest ein Buch im Park.",
    "A dog runs after the red ball!",
    "Kinder spielen Fußball auf der Straße.",
    "The woman is reading a book in the park.",
]


def _corpus() -> list[str]:
    toy = list(read_lines(TOY_DIR / "train.src")) + list(read_lines(TOY_DIR / "train.tgt"))
    return toy + SENTENCES * 20


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prefix = tmp_path_factory.mktemp("spm") / "spm"
    return Tokenizer.train(_corpus(), prefix, vocab_size=120, model_type="unigram",
                           character_coverage=1.0, max_sentences=1_000_000)


def test_train_writes_model_with_fixed_special_ids(model: Path) -> None:
    assert model.name == "spm.model" and model.is_file()
    assert (model.parent / "spm.vocab").is_file()
    tok = Tokenizer(model)
    assert tok.vocab_size == 120
    assert [tok.id_to_piece(i) for i in (PAD_ID, UNK_ID, BOS_ID, EOS_ID)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)


def test_round_trip_on_normal_sentences(model: Path) -> None:
    tok = Tokenizer(model)
    for text in SENTENCES + list(read_lines(TOY_DIR / "test.src"))[:10]:
        ids = tok.encode(text)
        assert ids and all(4 <= i < tok.vocab_size for i in ids), text
        assert tok.decode(ids) == text


def test_encode_batch_matches_encode_and_decode_skips_specials(model: Path) -> None:
    tok = Tokenizer(model)
    batch = tok.encode_batch(SENTENCES)
    assert batch == [tok.encode(s) for s in SENTENCES]
    assert tok.encode_batch([]) == []
    ids = tok.encode(SENTENCES[0])
    assert tok.decode([BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]) == SENTENCES[0]
    assert "".join(tok.pieces(SENTENCES[3])).replace("\u2581", " ").strip() == SENTENCES[3]


def test_unknown_character_maps_to_unk(model: Path) -> None:
    tok = Tokenizer(model)
    assert UNK_ID in tok.encode("日本")


def test_tokenizer_pickles_by_path(model: Path) -> None:
    tok = pickle.loads(pickle.dumps(Tokenizer(model)))
    assert tok.decode(tok.encode(SENTENCES[1])) == SENTENCES[1]


def test_id_to_piece_out_of_range(model: Path) -> None:
    with pytest.raises(IndexError):
        Tokenizer(model).id_to_piece(10_000)


def test_training_is_deterministic(tmp_path: Path, model: Path) -> None:
    again = Tokenizer.train(_corpus(), tmp_path / "elsewhere" / "again", 120, "unigram", 1.0, 1_000_000)
    # byte-identical although written to another directory under another name: the model
    # must not record its output path (checkpoints compare the model's sha256)
    assert again.read_bytes() == model.read_bytes()
    assert again.with_suffix(".vocab").read_text() == model.with_suffix(".vocab").read_text()
    assert not list(tmp_path.glob("**/*.tmp*")), "no temporary files left behind"


@pytest.mark.parametrize("model_type", ["bpe", "char", "word"])
def test_other_model_types_round_trip(tmp_path: Path, model_type: str) -> None:
    corpus = _corpus()
    size = {"bpe": 100, "char": 40, "word": 60}[model_type]
    path = Tokenizer.train(corpus, tmp_path / model_type, size, model_type, 1.0, 1_000_000)
    tok = Tokenizer(path)
    assert tok.vocab_size == size
    text = "ein hund spielt"
    assert tok.decode(tok.encode(text)) == text


def test_vocab_too_large_is_one_line_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        Tokenizer.train(["a b c", "c b a"] * 5, tmp_path / "m", 5000, "unigram", 1.0, 1_000_000)
    message = str(info.value)
    assert "data.vocab_size=5000" in message and "at most" in message and "\n" not in message


def test_vocab_smaller_than_alphabet_is_one_line_data_error(tmp_path: Path) -> None:
    """It said to lower data.character_coverage, which adds 256 byte pieces to what is needed."""
    with pytest.raises(DataError, match=r"data.vocab_size=10 is too small.*at least \d+ pieces \(special ids "
                                        r"included\); raise data.vocab_size$"):
        Tokenizer.train(["abcdefghijklmnop"] * 5, tmp_path / "m", 10, "unigram", 1.0, 1_000_000)
    with pytest.raises(DataError, match=r"at least \d+ pieces \(special ids, and the 256 byte pieces a "
                                        r"data.character_coverage below 1 adds, included\); raise data.vocab_size$"):
        Tokenizer.train(["abcdefghijklmnop"] * 5, tmp_path / "m", 10, "unigram", 0.99, 1_000_000, byte_fallback=True)


def test_a_char_model_of_the_wrong_size_is_one_line_data_error(tmp_path: Path) -> None:
    """A char model is the text's characters: asked for more, SentencePiece built fewer pieces
    than asked without a word; asked for fewer than its byte pieces, it failed an internal check."""
    with pytest.raises(DataError, match=r"data.vocab_size=100 is too large .*\(char\) can build at most 21 pieces"):
        Tokenizer.train(["abcdefghijklmnop"] * 5, tmp_path / "m", 100, "char", 1.0, 1_000_000)
    with pytest.raises(DataError, match=r"data.vocab_size=40 is too small for a char model"):
        Tokenizer.train(["abcdefghijklmnop"] * 5, tmp_path / "m", 40, "char", 1.0, 1_000_000, byte_fallback=True)


def test_decoded_text_is_one_line_whatever_byte_pieces_spell(tmp_path: Path) -> None:
    """A byte-fallback model can write a line break as byte pieces; a hypothesis with one would
    split its output file's line in two, out of line with its source. Decoding makes it a space."""
    path = Tokenizer.train(_corpus(), tmp_path / "b", 300, "unigram", 1.0, 1_000_000, byte_fallback=True)
    tok = Tokenizer(path)
    ids = tok.encode("ein hund") + [tok.piece_to_id("<0x0A>"), tok.piece_to_id("<0x0D>")] + tok.encode("spielt")
    text = tok.decode(ids)
    assert "\n" not in text and "\r" not in text and text.split() == ["ein", "hund", "spielt"]


def test_sampling_cap_reads_everything_but_trains_on_a_sample(tmp_path: Path) -> None:
    corpus = _corpus()
    path = Tokenizer.train(iter(corpus), tmp_path / "s", 60, "unigram", 1.0, max_sentences=200)
    tok = Tokenizer(path)
    assert tok.vocab_size == 60
    assert tok.decode(tok.encode("ein hund")) == "ein hund"


def test_empty_training_text_is_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError):
        Tokenizer.train([], tmp_path / "e", 50, "unigram", 1.0, 1000)


def test_unreadable_model_is_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        Tokenizer(tmp_path / "missing.model")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(DataError, match="bad.model"):
        Tokenizer(bad)


# Lines whose words SentencePiece's normaliser changes or joins: extra, leading and trailing
# spaces, tabs, no-break and ideographic spaces, combining marks after a space, compatibility
# forms (NFKC), unknown characters.
TRICKY = ["", " ", "  ", "a  b", " lead", "trail ", "a\tb c", "x\u00a0y", "\u00a0", "a \u00a0 b",
          "a \u0301b", "e\u0301 x", "\ufb01ne \uff21\uff22\uff23", "\u3000z", "zz\u200b y", "\u00a8 a",
          "x \u00b4", "\u2603 snow \u2603\u2603", "Kinder\u00a0spielen  Fußball ."]


@pytest.mark.parametrize("model_type", ["unigram", "bpe", "word"])
@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_word_cache_gives_the_ids_of_whole_sentences(tmp_path: Path, model_type: str, dtype: str) -> None:
    """A word model's neighbouring unknown words are one <unk> in a sentence: encoded a word at
    a time, they were one each, so training read other ids than translate gives."""
    import numpy as np

    from mtcli.data.tokenizer import WordCache

    model = Tokenizer.train(_corpus(), tmp_path / "spm", vocab_size=60 if model_type == "word" else 120,
                            model_type=model_type, character_coverage=1.0, max_sentences=1_000_000)
    tok = Tokenizer(model)
    assert tok.words_encode_alone() == (model_type != "word")
    lines = TRICKY + SENTENCES + list(read_lines(TOY_DIR / "test.src"))
    for max_words in (500_000, 3):  # a cache with room for everything, and one that fills at once
        cache = WordCache(tok, np.dtype(dtype), max_words=max_words)
        for start in range(0, len(lines), 7):  # in chunks, so later chunks hit the cache
            chunk = lines[start:start + 7]
            expected = tok.encode_batch(chunk)
            as_text = "".join(line + "\n" for line in chunk).encode()  # as prepare's text files hold it
            for ids, lengths in (cache.encode(chunk), cache.encode_text(as_text)):
                assert lengths.tolist() == [len(e) for e in expected]
                assert ids.tolist() == [i for e in expected for i in e]
                assert ids.dtype == np.dtype(dtype)
        held = len(cache._words or {})
        assert 0 < held <= max_words or model_type == "word"  # the cache never grows past its size
    assert [a.tolist() for a in cache.encode([])] == [[], []]
    assert [a.tolist() for a in cache.encode_text(b"")] == [[], []]
    unended = [a.tolist() for a in cache.encode_text(b"Kinder spielen\n\nim Park")]
    assert unended == [a.tolist() for a in cache.encode(["Kinder spielen", "", "im Park"])]


@pytest.mark.parametrize("normalization", ["identity", "nmt_nfkc"])
def test_word_cache_gives_a_literal_word_start_mark_its_ids_in_the_sentence(tmp_path: Path, normalization: str) -> None:
    """SentencePiece reads a literal ▁ as a space: the word "▁" alone gives no ids, and two in
    its sentence, so under identity (the default for a zh/ja target) the cache's ids were not
    the ones translate gives."""
    import numpy as np

    from mtcli.data.tokenizer import WordCache

    model = Tokenizer.train(_corpus(), tmp_path / "spm", vocab_size=120, model_type="unigram", character_coverage=1.0,
                            max_sentences=1_000_000, normalization=normalization)
    tok = Tokenizer(model)
    lines = ["Kinder \u2581 spielen", "a b", "\u2581", "x\u2581y z", "", "ein \u2581\u2581 Park ."]
    expected = tok.encode_batch(lines)
    ids, lengths = WordCache(tok, np.dtype("int32")).encode(lines)
    assert lengths.tolist() == [len(e) for e in expected]
    assert ids.tolist() == [i for e in expected for i in e]


def test_word_cache_encodes_whole_sentences_for_a_model_whose_pieces_cross_words(tmp_path: Path) -> None:
    import numpy as np
    import sentencepiece as spm

    from mtcli.data.tokenizer import WordCache

    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()), model_prefix=str(tmp_path / "x"),
                                   vocab_size=150, split_by_whitespace=False, pad_id=0, unk_id=1,
                                   bos_id=2, eos_id=3, minloglevel=2)
    tok = Tokenizer(tmp_path / "x.model")
    assert not tok.words_encode_alone()  # pieces may hold a word boundary
    lines = SENTENCES + TRICKY
    cache = WordCache(tok, np.dtype(np.int32))
    expected = tok.encode_batch(lines)
    for ids, lengths in (cache.encode(lines), cache.encode_text("".join(x + "\n" for x in lines).encode()),
                         cache.encode_text("\n".join(lines).encode())):  # the last line unended
        assert lengths.tolist() == [len(e) for e in expected]
        assert ids.tolist() == [i for e in expected for i in e]


def test_decode_drops_the_spaces_of_lone_word_starts_at_either_end(model: Path) -> None:
    # a search can end (or begin) on the bare word-start piece "▁": its space is no part of the text
    tok = Tokenizer(model)
    space = tok.piece_to_id("\u2581")
    assert tok.id_to_piece(space) == "\u2581"
    ids = tok.encode(SENTENCES[2])
    assert tok.decode([*ids, space]) == SENTENCES[2]
    assert tok.decode([space, space, *ids, space, space]) == SENTENCES[2]
    assert tok.decode([*tok.encode("Die"), space, *tok.encode("Frau")]) == "Die  Frau"  # inner ones stay


def test_a_protobuf_that_cannot_read_models_is_one_line(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """sentencepiece's model reader needs a protobuf of its own major version (undeclared by it):
    with another, prepare was a traceback from a worker."""
    import sys

    import sentencepiece

    from mtcli.data.tokenizer import _model_proto

    monkeypatch.delattr(sentencepiece, "sentencepiece_model_pb2", raising=False)  # (imported before: forgotten)
    monkeypatch.setitem(sys.modules, "sentencepiece.sentencepiece_model_pb2", None)  # (its import fails)
    with pytest.raises(DataError, match=r"^sentencepiece's model reader cannot load with this protobuf \(.*\): "
                                        r"pip install 'protobuf>=7.36.1,<8'$"):
        _model_proto(model)


def test_a_model_of_other_special_ids_is_refused_by_name(tmp_path: Path) -> None:
    """SentencePiece's own defaults (unk 0, bos 1, eos 2, no pad): every id would be misread."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()), model_prefix=str(tmp_path / "plain"),
                                   vocab_size=60, minloglevel=2)
    with pytest.raises(DataError, match=r"plain.model: special ids pad/unk/bos/eos are \(-1, 0, 1, 2\), expected "
                                        r"\(0, 1, 2, 3\) \(not a model trained by mtcli\)$"):
        Tokenizer(tmp_path / "plain.model")


def test_a_model_with_bos_and_eos_swapped_is_refused(tmp_path: Path) -> None:
    """pad and unk where mtcli puts them, bos and eos not: every sentence would end in a bos."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()), model_prefix=str(tmp_path / "swapped"),
                                   vocab_size=60, pad_id=0, unk_id=1, bos_id=3, eos_id=2, minloglevel=2)
    with pytest.raises(DataError, match=r"swapped.model: special ids pad/unk/bos/eos are \(0, 1, 3, 2\)"):
        Tokenizer(tmp_path / "swapped.model")
