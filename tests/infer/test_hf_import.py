"""Import from Hugging Face Transformers (mtcli.infer.hf_import, ``mtcli import-hf``): a tiny random
OPUS-MT style MarianMTModel (swish, a final logits bias, separate source and target
SentencePiece models mapped through one vocab.json) becomes a run whose greedy output is
transformers' own; an mtcli run exported to hf comes back as the same run."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from conftest import TOY_DIR

from mtcli.errors import ConfigError, DataError, MtcliError
from mtcli.infer.loading import load_for_inference
from mtcli.infer.translator import Translator

transformers = pytest.importorskip("transformers", reason="import-hf needs the hf extra (pip install -e '.[hf]')")

from mtcli.infer.hf import export_hf  # noqa: E402
from mtcli.infer.hf_import import import_hf  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")

LINES = [line for line in (TOY_DIR / "test.src").read_text(encoding="utf-8").splitlines() if line][:10]
LINES += ["ein hund, der läuft: springt!", ">>en<< ein ball"]  # pieces outside vocab.json; a language code
MAX_NEW = 12
EOS_MARGIN = 6.0  # one line ends early on </s>, the others run to the limit


def _spm(lines: list[str], vocab_size: int) -> bytes:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                   hard_vocab_limit=False, num_threads=1, minloglevel=2)
    return model.getvalue()


def write_marian_dir(path: Path, seed: int = 0) -> Path:
    """An OPUS-MT style directory: Marian's ids (</s> 0, <unk> 1, pieces, <pad> last = decoder
    start), swish, a random final_logits_bias, separate source and target SentencePiece models
    whose pieces vocab.json merges (a few source pieces left out: they become unk)."""
    files = path / "files"
    files.mkdir(parents=True)
    pieces: list[str] = []
    for name, side in (("source.spm", "src"), ("target.spm", "tgt")):
        (files / name).write_bytes(_spm((TOY_DIR / f"train.{side}").read_text(encoding="utf-8").splitlines(), 48))
        processor = spm.SentencePieceProcessor(model_file=str(files / name))
        pieces += [processor.id_to_piece(i) for i in range(processor.get_piece_size())
                   if not (processor.is_control(i) or processor.is_unknown(i))]
    pieces = list(dict.fromkeys(pieces))[:-3] + [">>en<<"]
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(pieces)}}
    vocab["<pad>"] = len(vocab)
    (files / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    pad = vocab["<pad>"]
    config = transformers.MarianConfig(
        vocab_size=len(vocab), d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, activation_function="swish",
        max_position_embeddings=64, scale_embedding=True, pad_token_id=pad, eos_token_id=0,
        decoder_start_token_id=pad, forced_eos_token_id=0, share_encoder_decoder_embeddings=True,
        dropout=0.1, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():  # weights that make the outputs differ; eos likely enough to end some early
        for name, tensor in model.named_parameters():
            if "norm" not in name and "positions" not in name:
                tensor.normal_(0.0, 1.0)
        model.final_logits_bias.normal_(0.0, 1.0)
        model.final_logits_bias[0, 0] = model.final_logits_bias[0, 1:].max() + EOS_MARGIN
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=pad, eos_token_id=0, pad_token_id=pad, forced_eos_token_id=0,
        bad_words_ids=[[pad]], num_beams=1, max_length=MAX_NEW + 1)
    out = path / "opus-mt-de-en"
    model.save_pretrained(out)
    transformers.MarianTokenizer(str(files / "source.spm"), str(files / "target.spm"), str(files / "vocab.json"),
                                 source_lang="de", target_lang="en").save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_marian_dir(tmp_path_factory.mktemp("marian"))


@pytest.fixture(scope="module")
def imported(marian_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "opus"
    import_hf(marian_dir, run)
    return run


def transformers_greedy(model_dir: Path, lines: list[str], **limit: int) -> tuple[list[list[int]], list[str]]:
    """transformers' greedy output ids (without the decoder start) and texts, one line at a time
    (``limit``: ``max_length=N`` instead of the generation config's)."""
    tokenizer = transformers.MarianTokenizer.from_pretrained(model_dir)
    model = transformers.MarianMTModel.from_pretrained(model_dir).eval()
    ids, texts = [], []
    with torch.inference_mode():
        for line in lines:
            out = model.generate(**tokenizer([line], return_tensors="pt"), num_beams=1, do_sample=False, **limit)
            ids.append(out[0, 1:].tolist())
            texts.append(tokenizer.decode(out[0], skip_special_tokens=True))
    return ids, texts


def test_the_imported_run_computes_marians_logits(marian_dir: Path, imported: Path) -> None:
    bundle = load_for_inference(imported, device="cpu")
    theirs_tok = transformers.MarianTokenizer.from_pretrained(marian_dir)
    theirs = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
    vocab = json.loads((imported / "vocab.json").read_text(encoding="utf-8"))
    to_ours = {theirs_tok.encoder[piece]: i for piece, i in vocab.items()}
    src = theirs_tok([LINES[0]], return_tensors="pt")["input_ids"]
    tgt = torch.tensor([[theirs.config.decoder_start_token_id] + src[0, :-1].tolist()[::-1]])
    for line in LINES:  # source pieces through vocab.json; unk for what it lacks; >>en<< one piece
        assert [to_ours[i] for i in theirs_tok(line)["input_ids"]] == bundle.tokenizer.encode(line) + [3]
    with torch.inference_mode():
        expected = theirs(input_ids=src, decoder_input_ids=tgt).logits[0]
        got = bundle.model(torch.tensor([[to_ours[int(i)] for i in src[0]]]),
                           torch.tensor([[to_ours[int(i)] for i in tgt[0]]]))[0]
    columns = sorted(to_ours)
    torch.testing.assert_close(got[:, [to_ours[c] for c in columns]], expected[:, columns], atol=1e-4, rtol=1e-4)
    assert bundle.model.cfg.activation == "swish" and bundle.model.output_bias is not None
    assert got[:, 0].max() < -1e8  # the pad row mtcli adds has no probability


def test_greedy_output_equals_transformers(marian_dir: Path, imported: Path) -> None:
    ids, texts = transformers_greedy(marian_dir, LINES)
    ours = Translator.from_run(imported, device="cpu", beam=1)
    vocab = json.loads((imported / "vocab.json").read_text(encoding="utf-8"))
    marian_vocab = json.loads((marian_dir / "vocab.json").read_text(encoding="utf-8"))
    to_ours = {marian_vocab[piece]: i for piece, i in vocab.items()}
    nbest = ours.nbest(LINES, 1)
    assert [[to_ours[i] for i in row] for row in ids] == [n[0].tokens + [3] for n in nbest]
    assert ours.translate(LINES) == texts
    # the comparison means something: the outputs differ from line to line, one ends on </s>,
    # others run to the length limit (transformers' max_length, which the import carried over)
    lengths = {len(row) for row in ids}
    assert len(set(texts)) > 3 and MAX_NEW in lengths and any(1 < n < MAX_NEW for n in lengths)


@pytest.mark.parametrize("limit", [{"max_new_tokens": 5}, {"max_length": 9, "forced_eos_token_id": None}])
def test_greedy_output_keeps_transformers_length_limit(marian_dir: Path, tmp_path: Path, limit: dict) -> None:
    """max_new_tokens was ignored (the model's positions bounded the output instead), and the
    limit assumed an end token forced at max_length."""
    model_dir = _broken(marian_dir, tmp_path)
    path = model_dir / "generation_config.json"
    generation = {k: v for k, v in json.loads(path.read_text()).items() if k != "max_length"}
    path.write_text(json.dumps({**generation, **limit}), encoding="utf-8")
    import_hf(model_dir, tmp_path / "run")
    ids, texts = transformers_greedy(model_dir, LINES)
    assert Translator.from_run(tmp_path / "run", device="cpu", beam=1).translate(LINES) == texts
    assert max(map(len, ids)) == (limit.get("max_new_tokens") or limit.get("max_length", 0) - 1)  # some were cut


def test_scores_are_transformers_log_probabilities(marian_dir: Path, imported: Path) -> None:
    tokenizer = transformers.MarianTokenizer.from_pretrained(marian_dir)
    model = transformers.MarianMTModel.from_pretrained(marian_dir).eval()
    sources, targets = LINES[:3], ["a dog runs", "the red ball", "ein mann"]
    batch = tokenizer(sources, text_target=targets, return_tensors="pt", padding=True)
    with torch.inference_mode():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       labels=batch["labels"]).logits
    labels = batch["labels"]
    picked = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    expected = picked.masked_fill(labels.eq(model.config.pad_token_id) | labels.lt(0), 0.0).sum(-1)
    got = Translator.from_run(imported, device="cpu").score(sources, targets)
    torch.testing.assert_close(torch.tensor(got), expected, atol=1e-3, rtol=1e-4)


def test_the_translate_command_gives_the_same_output(marian_dir: Path, imported: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mtcli.cli import app

    source = tmp_path / "in.txt"
    source.write_text("\n".join(LINES[:4]) + "\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["translate", str(imported), str(source), "--beam", "1"])
    assert result.exit_code == 0, result.output
    expected = transformers_greedy(marian_dir, LINES[:4])[1]
    assert result.stdout.splitlines() == expected
    from mtcli.evaluate import evaluate

    reference = tmp_path / "ref.txt"
    reference.write_text("\n".join(expected) + "\n", encoding="utf-8")
    report = evaluate(imported, src_file=source, ref_file=reference, output_dir=tmp_path / "eval", beam=1)
    assert report["bleu"] == pytest.approx(100.0)


def _untied(tiny_run_dir: Path, run: Path) -> Path:
    """A copy of the tiny run with separate encoder, decoder and output embeddings, drawn at random."""
    from mtcli.checkpoint import load_checkpoint, save_checkpoint
    from mtcli.config import load_config, save_config
    from mtcli.model import Transformer

    shutil.copytree(tiny_run_dir, run)
    config = load_config(run / "config.yaml", ["model.tie_embeddings=false"])
    save_config(config, run / "config.yaml")
    path = run / "checkpoints" / "checkpoint_best.pt"
    state = load_checkpoint(path)
    torch.manual_seed(3)
    state["model"] = {k: v + 0.3 * torch.randn_like(v) for k, v in
                      Transformer(config.model, state["vocab"]["size"]).state_dict().items()}
    state["config"] = config.to_dict()
    save_checkpoint(path, state)
    return run


@pytest.mark.parametrize("tied", [True, False])
def test_a_round_trip_through_hf_gives_the_same_run(tiny_run_dir: Path, tmp_path: Path, tied: bool) -> None:
    """An untied run's export (share_encoder_decoder_embeddings: false, one vocabulary) was
    refused on import as "separate source and target vocabularies"."""
    if not tied:
        tiny_run_dir = _untied(tiny_run_dir, tmp_path / "untied")
    exported = export_hf(tiny_run_dir, tmp_path / "hf")
    report = import_hf(exported, tmp_path / "back")  # the languages from its tokenizer_config.json
    assert report.tokenizer == "joint spm.model"  # an ordinary run: train --init-from takes it
    lines = LINES[:6]
    before, after = (Translator.from_run(run, device="cpu") for run in (tiny_run_dir, tmp_path / "back"))
    assert (after.bundle.config.data.src_lang, after.bundle.config.data.tgt_lang) == (
        before.bundle.config.data.src_lang, before.bundle.config.data.tgt_lang)
    assert after.decode == before.decode  # the run's decode settings (a 1,022-piece limit each before)
    assert after.bundle.model.cfg.tie_embeddings is before.bundle.model.cfg.tie_embeddings is tied
    assert after.translate(lines) == before.translate(lines)
    assert (tmp_path / "back" / "spm.model").read_bytes() == (tiny_run_dir / "spm.model").read_bytes()


def test_an_exports_generation_config_edited_since_is_what_its_import_decodes_with(
        tiny_run_dir: Path, tmp_path: Path) -> None:
    """The export's own record of the run's decode settings overrode num_beams and max_length
    edited in generation_config.json, unsaid."""
    exported = export_hf(tiny_run_dir, tmp_path / "hf")
    path = exported / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_beams": 3, "max_length": 6}), encoding="utf-8")
    decode = Translator.from_run(import_hf(exported, tmp_path / "back").run_dir, device="cpu").decode
    forced = json.loads(path.read_text()).get("forced_eos_token_id") is not None
    assert (decode.beam_size, decode.max_len_a, decode.max_len_b) == (3, 0.0, 6 - 1 - int(forced))
    path.unlink()  # none: transformers' defaults (20 tokens) are not an edit
    again = Translator.from_run(import_hf(exported, tmp_path / "again").run_dir, device="cpu").decode
    assert again == Translator.from_run(tiny_run_dir, device="cpu").decode


def test_an_import_leaves_out_the_decode_settings_that_need_the_training_corpus(
        tiny_run_dir: Path, tmp_path: Path) -> None:
    """A run decoding over a shortlist, exported and imported: the import has no corpus to build
    the shortlist's table from, so it decodes without (every translate and request failed)."""
    import yaml

    run = tmp_path / "run"
    shutil.copytree(tiny_run_dir, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["decode"]["shortlist"] = 20
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    back = import_hf(export_hf(run, tmp_path / "hf"), tmp_path / "back").run_dir
    translator = Translator.from_run(back, device="cpu", beam=1)
    assert translator.decode.shortlist == 0 and len(translator.translate(LINES[:2])) == 2


def test_init_from_takes_a_joint_import(tiny_run_dir: Path, tmp_path: Path) -> None:
    from mtcli.config import load_config
    from mtcli.fileio import sha256_file
    from mtcli.model import Transformer
    from mtcli.train.parent import load_parent, start_from

    back = import_hf(export_hf(tiny_run_dir, tmp_path / "hf"), tmp_path / "back", src_lang="de", tgt_lang="en").run_dir
    config, parent = load_config(back / "config.yaml"), load_for_inference(tiny_run_dir).model
    child = Transformer(config.model, parent.vocab_size)
    start_from(child, load_parent(str(back)), config, sha256_file(back / "spm.model"))
    assert all(torch.equal(a, b) for a, b in zip(child.state_dict().values(), parent.state_dict().values(), strict=True))


def test_an_opus_mt_import_is_fine_tuned_on_a_corpus_it_encodes(imported: Path, tmp_path: Path) -> None:
    """prepare with data.spm_model: RUN encodes sources with source.spm and targets with
    target.spm through vocab.json; train --init-from RUN starts from its exact weights."""
    from conftest import TOY_CONFIG

    from mtcli.config import load_config
    from mtcli.data.cache import PreparedCorpus
    from mtcli.data.prepare import prepare
    from mtcli.data.vocabmap import VocabTokenizer
    from mtcli.fileio import sha256_file
    from mtcli.model import Transformer
    from mtcli.train import train
    from mtcli.train.parent import load_parent, start_from

    shape = load_config(imported / "config.yaml", lenient=True).model
    overrides = [f"data.source={TOY_DIR}", f"data.prepared_dir={tmp_path / 'prep'}", f"data.spm_model={imported}",
                 f"train.init_from={imported}", f"train.run_dir={tmp_path / 'child'}", "train.max_steps=4",
                 "train.valid_every=4", "train.valid_bleu=false", "train.warmup_steps=2",
                 *[f"model.{k}={v}" for k, v in vars(shape).items() if k not in ("dropout",)]]
    config = load_config(TOY_CONFIG, overrides)
    prepare(config)
    corpus = PreparedCorpus.open(tmp_path / "prep")
    tokenizer = corpus.tokenizer()
    assert isinstance(tokenizer, VocabTokenizer)
    first_src = corpus.text_path("train", "src").read_text(encoding="utf-8").split("\n")[0]
    first_tgt = corpus.text_path("train", "tgt").read_text(encoding="utf-8").split("\n")[0]
    assert corpus.array("train", "src")[0].tolist() == tokenizer.encode(first_src)
    assert corpus.array("train", "tgt")[0].tolist() == tokenizer.encode_target_batch([first_tgt])[0]
    child = Transformer(config.model, tokenizer.vocab_size)
    start_from(child, load_parent(str(imported)), config, sha256_file(corpus.spm_path))
    theirs = load_for_inference(imported).model.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in child.state_dict().items())
    summary = train(config)
    assert summary.steps == 4
    run = tmp_path / "child"
    assert {p.name for p in run.iterdir()} >= {"vocab.json", "source.spm", "target.spm"}
    assert len(Translator.from_run(run, beam=1).translate(LINES[:3])) == 3


def test_an_imported_run_exports_back_to_the_same_marian_model(
        marian_dir: Path, imported: Path, tmp_path: Path) -> None:
    from mtcli.infer.export import export_model

    again = export_hf(imported, tmp_path / "again")
    limit = {"max_length": MAX_NEW + 1}
    assert transformers_greedy(again, LINES, **limit)[1] == transformers_greedy(marian_dir, LINES, **limit)[1]
    generation = [json.loads((d / "generation_config.json").read_text()) for d in (marian_dir, again)]
    assert generation[1]["max_length"] == generation[0]["max_length"]  # the import's fixed limit, not 512
    with pytest.raises(ConfigError, match="separate source and target SentencePiece models"):
        export_model(imported, tmp_path / "ct2")  # CTranslate2 takes one joint SentencePiece model


def _broken(marian_dir: Path, tmp_path: Path) -> Path:
    broken = tmp_path / "opus-mt-de-en"
    shutil.copytree(marian_dir, broken)
    return broken


@pytest.mark.parametrize(("damage", "error", "message"), [
    (lambda d: (d / "vocab.json").unlink(), DataError, "vocab.json: not found"),
    (lambda d: (d / "source.spm").unlink(), DataError, "source.spm: not found"),
    (lambda d: _set(d, normalize_before=True), ConfigError, "normalize_before: True is not supported"),
    (lambda d: _set(d, activation_function="gelu"), ConfigError, "activation_function: 'gelu'"),
    (lambda d: _set(d, decoder_vocab_size=7), ConfigError, "decoder_vocab_size: 7"),
    # two vocabularies of one size: the decoder's ids would be read as vocab.json's pieces
    (lambda d: (d / "tokenizer_config.json").write_text('{"separate_vocabs": true}'), ConfigError,
     "tokenizer_config.json: separate_vocabs: true is not supported"),
    (lambda d: shutil.copy(d / "vocab.json", d / "target_vocab.json"), ConfigError,
     "target_vocab.json: a separate target vocabulary is not supported"),
    # what generate would do and mtcli's search does not: its output would differ without a word
    (lambda d: _generation(d, repetition_penalty=1.5), ConfigError,
     "generation_config.json: repetition_penalty: 1.5 is not supported"),
    (lambda d: _generation(d, no_repeat_ngram_size=2), ConfigError, "no_repeat_ngram_size: 2 is not supported"),
    (lambda d: _generation(d, min_length=10), ConfigError, "min_length: 10 is not supported"),
    # the run's config was said to be wrong, naming a file the failed import had not left
    (lambda d: _generation(d, num_beams=-3), ConfigError, r"generation_config.json: num_beams: -3 is not a beam size"),
    (lambda d: _generation(d, num_beams=0), ConfigError, r"generation_config.json: num_beams: 0 is not a beam size"),
    (lambda d: _generation(d, bad_words_ids=[[5], [6]]), ConfigError, r"bad_words_ids: \[\[5\], \[6\]\] is not"),
    # generate ends at any of several end tokens; mtcli's search at one (outputs differed silently)
    (lambda d: _generation(d, eos_token_id=[0, 5]), ConfigError,
     r"generation_config.json: eos_token_id: \[0, 5\] is not supported"),
    (lambda d: _generation(d, eos_token_id=5), ConfigError, r"generation_config.json: eos_token_id: 5 is not"),
    (lambda d: _generation(d, forced_eos_token_id=5), ConfigError, r"forced_eos_token_id: 5 is not supported"),
    # settings kept in config.json, as some snapshots have them: the message named a missing file
    (lambda d: ((d / "generation_config.json").unlink(), _set(d, no_repeat_ngram_size=3)), ConfigError,
     r"opus-mt-de-en/config.json: no_repeat_ngram_size: 3 is not supported"),
    # a damaged generation_config.json: transformers reads it as absent, its beam and length lost
    (lambda d: (d / "generation_config.json").write_text("{"), DataError,
     r"opus-mt-de-en/generation_config.json: unreadable \("),
    (lambda d: os.truncate(d / "model.safetensors", 1000), DataError,
     r"opus-mt-de-en/model.safetensors: not a readable safetensors file"),
    (lambda d: (d / "source.spm").write_bytes(b"junk\n"), DataError, "source.spm: not a readable SentencePiece model"),
    (lambda d: (d / "target.spm").write_bytes(b"junk\n"), DataError, "target.spm: not a readable SentencePiece model"),
    (lambda d: _drop_weight(d, "model.encoder.layers.0.fc1.weight"), DataError,
     "model.safetensors: lacks 1 weights .* model.encoder.layers.0.fc1.weight"),
    (lambda d: _set(d, d_model=32), ConfigError, r"config.json: does not match .*model.safetensors"),
    # transformers built the model of config.json (25 GB of positions here) before mtcli's limits ran
    (lambda d: _set(d, max_position_embeddings=100_000_000), ConfigError,
     r"config.json: max_position_embeddings: 100000000 is not a size mtcli builds \(model.max_positions: 1 to "),
    (lambda d: _set(d, encoder_layers="6"), ConfigError, r"config.json: encoder_layers: '6' is not a size mtcli"),
])
def test_what_cannot_be_imported_is_refused_in_one_line(
        marian_dir: Path, tmp_path: Path, damage, error: type, message: str) -> None:
    broken = _broken(marian_dir, tmp_path)
    damage(broken)
    with pytest.raises(error, match=message) as caught:
        import_hf(broken, tmp_path / "run")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "run").exists() and not list(tmp_path.glob(".run*"))


def test_a_weights_file_given_for_the_directory_says_so(marian_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"model.safetensors: is a file; give the Hugging Face model's directory"):
        import_hf(marian_dir / "model.safetensors", tmp_path / "run")  # was "no such model directory"


def _set(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}), encoding="utf-8")


def _generation(model_dir: Path, **changes) -> None:
    path = model_dir / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}), encoding="utf-8")


def _drop_weight(model_dir: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(path)
    del weights[name]
    save_file(weights, path, metadata={"format": "pt"})


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_config_that_does_not_fit_the_weights_is_one_line_without_transformers_report(
        marian_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    broken = _broken(marian_dir, tmp_path)
    _set(broken, d_model=32)
    records = _Records()  # transformers' loggers do not propagate: listen on its own
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(records)
    level = hf_logger.level
    try:
        with pytest.raises(ConfigError, match=r"config.json: does not match .*model.safetensors") as caught:
            import_hf(broken, tmp_path / "run")
    finally:
        hf_logger.removeHandler(records)
    assert "\n" not in str(caught.value) and "report" not in str(caught.value)
    assert [r.getMessage()[:80] for r in records.records] == []  # no MISMATCH load report
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err and "MISMATCH" not in out + err
    assert hf_logger.level == level and transformers.utils.logging.is_progress_bar_enabled()


def test_force_replaces_a_run_but_never_a_directory_of_other_files(marian_dir: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mtcli.cli import app

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work\n", encoding="utf-8")
    for force in (True, False):
        with pytest.raises(FileExistsError, match="a directory of other files .*mtcli replaces only what it wrote"):
            import_hf(marian_dir, precious, force=force)
    result = CliRunner().invoke(app, ["import-hf", str(marian_dir), str(precious), "--src-lang", "en",
                                      "--tgt-lang", "fr", "--force"])
    assert result.exit_code == 1 and "a directory of other files" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["precious"]  # no temporary directory left
    assert [p.name for p in precious.iterdir()] == ["thesis.tex"]
    assert (precious / "thesis.tex").read_text(encoding="utf-8") == "years of work\n"
    trained = tmp_path / "trained"  # what a training writes: hours of work, never replaced by an import
    (trained / "checkpoints").mkdir(parents=True)
    (trained / "config.yaml").write_text("data: {}\n", encoding="utf-8")
    with pytest.raises(FileExistsError, match="a directory of other files"):
        import_hf(marian_dir, trained, force=True)
    imported = tmp_path / "imported"
    import_hf(marian_dir, imported)
    with pytest.raises(MtcliError, match="exists; give a new run directory"):
        import_hf(marian_dir, imported)
    import_hf(marian_dir, imported, force=True)  # an import is replaced
    assert (imported / "import.json").is_file() and (imported / "checkpoints" / "checkpoint_best.pt").is_file()
    # ... with the CTranslate2 conversion decoding made in it (refused as "mtcli did not write there")
    (imported / "ctranslate2" / "0123456789abcdef").mkdir(parents=True)
    import_hf(marian_dir, imported, force=True)
    assert not (imported / "ctranslate2").exists()
    (imported / "eval").mkdir()  # scores are kept: moved away first
    with pytest.raises(FileExistsError, match=r"holds files besides those mtcli wrote there \(eval\); .*move them"):
        import_hf(marian_dir, imported, force=True)


def test_a_failed_forced_import_leaves_the_old_run(marian_dir: Path, imported: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(imported, run)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    broken = _broken(marian_dir, tmp_path)
    os.truncate(broken / "model.safetensors", 1000)
    with pytest.raises(DataError, match=f"^{broken / 'model.safetensors'}: "):
        import_hf(broken, run, force=True)
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["opus-mt-de-en", "run"]


def test_the_languages_must_differ(marian_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--src-lang and --tgt-lang are both 'en': .* must differ") as caught:
        import_hf(marian_dir, tmp_path / "run", src_lang="en", tgt_lang="en")
    assert "cannot tell" not in str(caught.value)
    with pytest.raises(ConfigError, match="would both be 'en' .*must differ"):  # en from tokenizer_config.json
        import_hf(marian_dir, tmp_path / "run", src_lang="en")
    # an empty one was the model's; one that cannot name a file or a tag, accepted
    with pytest.raises(ConfigError, match="--src-lang is empty: give a language code"):
        import_hf(marian_dir, tmp_path / "run", src_lang=" ")
    with pytest.raises(ConfigError, match=r"--tgt-lang 'e n': not a language code"):
        import_hf(marian_dir, tmp_path / "run", tgt_lang="e n")
    assert not (tmp_path / "run").exists()


def test_the_command_imports_and_refuses_in_one_line(marian_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from typer.testing import CliRunner

    from mtcli.cli import app

    runner = CliRunner()
    assert runner.invoke(app, ["import-hf", "--help"]).exit_code == 0
    result = runner.invoke(app, ["import-hf", str(marian_dir), str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run" / "checkpoints" / "checkpoint_best.pt").is_file()
    again = runner.invoke(app, ["import-hf", str(marian_dir), str(tmp_path / "run")])
    assert again.exit_code != 0 and "exists" in again.output and len(again.output.strip().splitlines()) == 1
    broken = _broken(marian_dir, tmp_path)
    _set(broken, scale_embedding=False)
    result = runner.invoke(app, ["import-hf", str(broken), str(tmp_path / "other")])
    assert result.exit_code != 0 and "scale_embedding" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "other").exists()
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MtcliError, match=r"pip install 'transformers>="):
        import_hf(marian_dir, tmp_path / "third")


def test_a_sentencepiece_model_of_another_vocabulary_is_warned_of(
        marian_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Most of its pieces read as <unk> (as transformers reads them): the import was silent."""
    import_hf(marian_dir, tmp_path / "fine")
    assert "pieces are not in vocab.json" not in caplog.text
    other = _broken(marian_dir, tmp_path)
    lines = (TOY_DIR / "train.src").read_text(encoding="utf-8").splitlines()
    (other / "source.spm").write_bytes(_spm([line[::-1].upper() for line in lines], 48))
    import_hf(other, tmp_path / "run")
    assert f"{other / 'source.spm'}: " in caplog.text and "pieces are not in vocab.json and read as <unk>" in caplog.text
    assert "target.spm: " not in caplog.text


def test_ctranslate2_refuses_an_import_of_two_sentencepiece_models_before_saying_it_converts(
        imported: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("ctranslate2")
    caplog.set_level("INFO")
    with pytest.raises(ConfigError, match="CTranslate2 conversion needs a joint spm.model"):
        Translator.from_run(imported, device="cpu", engine="ctranslate2")
    assert "converting" not in caplog.text  # it said it converted, then refused
    assert not (imported / "ctranslate2").exists() or not any((imported / "ctranslate2").iterdir())
