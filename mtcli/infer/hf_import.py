"""Import from Hugging Face Transformers: ``mtcli import-hf DIR RUN`` makes a run of a ``MarianMTModel``.

``DIR`` is an OPUS-MT style model directory (``config.json``, ``model.safetensors`` or
``pytorch_model.bin``, ``source.spm``, ``target.spm``, ``vocab.json``, optionally
``generation_config.json`` and ``tokenizer_config.json``), as ``hf download
Helsinki-NLP/opus-mt-de-en --local-dir DIR`` leaves it. ``RUN`` becomes a run directory that
``translate``, ``evaluate``, ``serve`` and :class:`mtcli.Translator` decode, with the same greedy
output as ``MarianMTModel.generate(num_beams=1)``. The weights go through the mapping the export
uses (:func:`mtcli.infer.hf.weight_table`), the model dimension permuted back from Marian's split
sinusoids to our interleaved ones. What else the import carries over:

* **the feed-forward activation**: ``activation_function`` ``swish``/``silu`` (OPUS-MT's) or
  ``relu`` -> ``model.activation``;
* **final_logits_bias** -> ``model.output_bias`` (a fixed bias on the logits);
* **the ids**: the vocabulary is renumbered to mtcli's fixed special ids. Marian starts decoding
  from its pad token, mtcli from ``<s>``: Marian's pad row becomes our ``<s>`` (id 2), and a
  pad row is added (id 0, logit bias -1e9: no probability) where the two were one token;
  ``<unk>`` becomes 1, ``</s>`` 3, every other piece keeps its order from 4 on;
* **the tokenizer**: ``source.spm`` and ``target.spm`` mapped through ``vocab.json`` (renumbered)
  (:class:`~mtcli.data.vocabmap.VocabTokenizer`), unless both are one SentencePiece model whose
  own ids already are the renumbered ones (a model ``mtcli export --format hf`` wrote): then it is
  the run's joint ``spm.model``, and the run is like any other;
* **decoding**: ``num_beams`` -> ``decode.beam_size``; ``max_length`` or ``max_new_tokens`` -> a
  fixed output limit (``max_len_a: 0``, ``max_len_b``: :func:`output_limit`), as transformers
  bounds it.

Refused with one line naming the key of ``config.json``: anything mtcli cannot compute exactly
(pre-norm or embedding layer norms, unscaled embeddings, learned positions, a separate decoder
vocabulary, another activation, unequal encoder and decoder widths); and of
``generation_config.json``, what mtcli's search does not do (a repetition penalty, n-gram
blocking, a minimum length, banned words other than the pad token, more than one end token). The import checks itself: the
logits of both models on a probe must agree. Needs the ``hf`` extra.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch

from mtcli.builddir import atomic_dir, check_replaceable
from mtcli.checkpoint import save_checkpoint
from mtcli.config import (
    MODEL_LIMITS,
    Config,
    DataConfig,
    DecodeConfig,
    ModelConfig,
    TrainConfig,
    check_language_code,
    save_config,
    validate,
)
from mtcli.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_PIECE, Tokenizer
from mtcli.data.vocabmap import load_spm, read_vocab
from mtcli.errors import ConfigError, DataError, MtcliError, one_line, shown
from mtcli.fileio import copy_file, sha256_file
from mtcli.infer.export import CT2_DIR, EXPORT_RECORD
from mtcli.infer.hf import (
    from_marian,
    generation_max_length,
    model_permutation,
    quiet_transformers,
    require_transformers,
    weight_table,
)
from mtcli.logs import get_logger
from mtcli.model import Transformer
from mtcli.rundir import (
    BEST_NAME,
    CONFIG_NAME,
    LAST_NAME,
    SOURCE_SPM_NAME,
    SPM_NAME,
    TARGET_SPM_NAME,
    VOCAB_NAME,
    checkpoint_dir,
    step_checkpoint_name,
    update_index,
)

IMPORT_NAME = "import.json"
#: config.json keys whose value mtcli cannot compute otherwise: key -> (the values allowed, why)
_REQUIRED: dict[str, tuple[tuple[Any, ...], str]] = {
    "model_type": (("marian",), "only MarianMTModel directories are imported"),
    "normalize_before": ((False, None), "mtcli imports post-norm layers only"),
    "add_final_layer_norm": ((False, None), "a final layer norm is not carried over"),
    "normalize_embedding": ((False, None), "an embedding layer norm is not carried over"),
    "layernorm_embedding": ((False, None), "an embedding layer norm is not carried over"),
    "scale_embedding": ((True,), "mtcli scales embeddings by sqrt(d_model)"),
    "static_position_embeddings": ((True, None), "mtcli's positions are sinusoids"),
    "add_bias_logits": ((False, None), "a logits projection bias is not carried over"),
    "activation_function": (("relu", "swish", "silu"), "mtcli's feed-forward activations are relu and swish"),
}
_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
#: what decoding an imported run adds to it and an import --force replaces: the CTranslate2 conversion
DERIVED = (CT2_DIR,)


@dataclasses.dataclass
class ImportReport:
    """What :func:`import_hf` made."""

    run_dir: Path
    src_lang: str
    tgt_lang: str
    vocab_size: int
    tokenizer: str  # "joint spm.model" or "source.spm + target.spm + vocab.json"
    parameters: int
    max_logit_difference: float


def _read_json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path}: not found (not a Hugging Face model directory?)") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: unreadable ({one_line(exc, 200)})") from None
    if not isinstance(raw, dict):
        raise DataError(f"{path}: expected a JSON object")
    return raw


def weights_file(model_dir: Path) -> Path:
    """The weights file transformers loads from ``model_dir`` (``model.safetensors`` first);
    :class:`DataError` when there is none."""
    for name in _WEIGHTS:
        if (model_dir / name).is_file():
            return model_dir / name
    raise DataError(f"{model_dir}: no weights ({' or '.join(_WEIGHTS)})")


def _check_weights(path: Path) -> None:
    """:class:`DataError` naming ``path`` when it is a safetensors file whose header is broken or
    does not cover the file (a truncated download); a ``.bin`` is checked as transformers loads it."""
    if path.suffix != ".safetensors":
        return
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except (OSError, SafetensorError) as exc:
        raise DataError(f"{path}: not a readable safetensors file, truncated? ({one_line(exc, 200)})") from None


#: config.json's sizes, and the model key of mtcli whose limit each has (:data:`MODEL_LIMITS`).
_SIZES = {"d_model": "d_model", "encoder_ffn_dim": "d_ff", "decoder_ffn_dim": "d_ff", "encoder_layers": "encoder_layers",
          "decoder_layers": "decoder_layers", "encoder_attention_heads": "n_heads",
          "decoder_attention_heads": "n_heads", "max_position_embeddings": "max_positions"}


def check_model_dir(model_dir: Path) -> dict[str, Any]:
    """``config.json`` of ``model_dir`` after checking the directory holds every file an import
    reads and the config only what mtcli computes exactly; one-line :class:`MtcliError` naming
    the file or the key otherwise."""
    if model_dir.is_file():
        raise DataError(f"{model_dir}: is a file; give the Hugging Face model's directory (config.json, weights, "
                        f"{SOURCE_SPM_NAME}, {TARGET_SPM_NAME}, {VOCAB_NAME})")
    if not model_dir.is_dir():
        raise DataError(f"{model_dir}: no such model directory")
    where = model_dir / "config.json"
    raw = _read_json(where)
    for name in (VOCAB_NAME, SOURCE_SPM_NAME, TARGET_SPM_NAME):
        if not (model_dir / name).is_file():
            raise DataError(f"{model_dir / name}: not found (an OPUS-MT style Marian directory has "
                            f"{VOCAB_NAME}, {SOURCE_SPM_NAME} and {TARGET_SPM_NAME})")
    vocab_pieces = read_vocab(model_dir / VOCAB_NAME)
    for name in (SOURCE_SPM_NAME, TARGET_SPM_NAME):
        _warn_uncovered(model_dir / name, load_spm(model_dir / name), vocab_pieces)  # a junk model: said now
    _check_weights(weights_file(model_dir))
    for key, ours in _SIZES.items():  # before transformers builds it: a size past any model is refused
        value = raw.get(key)
        if value is not None and not (isinstance(value, int) and 1 <= value <= MODEL_LIMITS[ours]):
            raise ConfigError(f"{where}: {key}: {shown(value)} is not a size mtcli builds (model.{ours}: 1 to "
                              f"{MODEL_LIMITS[ours]:,})")
    for key, (allowed, why) in _REQUIRED.items():
        value = raw.get(key)
        if value not in allowed:
            raise ConfigError(f"{where}: {key}: {value!r} is not supported ({why})")
    vocab = raw.get("vocab_size")
    pairs = (("decoder_vocab_size", vocab, "a separate decoder vocabulary is not supported"),
             ("decoder_attention_heads", raw.get("encoder_attention_heads"), "must equal encoder_attention_heads"),
             ("decoder_ffn_dim", raw.get("encoder_ffn_dim"), "must equal encoder_ffn_dim"))
    for key, expected, why in pairs:
        if raw.get(key) not in (None, expected):
            raise ConfigError(f"{where}: {key}: {raw.get(key)!r} is not supported ({why})")
    _check_one_vocabulary(model_dir)
    return raw


def _warn_uncovered(path: Path, processor: Any, vocab: dict[str, int]) -> None:
    """A warning when over a tenth of the pieces of the SentencePiece model at ``path`` are not
    in ``vocab.json``: they read as ``<unk>`` (as transformers reads them), so it is most likely
    another model's file, whose translations would be poor without a word."""
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())
              if not (processor.is_control(i) or processor.is_unknown(i))]
    missing = sum(piece not in vocab for piece in pieces)
    if missing > 0.1 * len(pieces):
        get_logger().warning("%s: %d of its %d pieces are not in %s and read as %s (a SentencePiece model of "
                             "another vocabulary?)", path, missing, len(pieces), VOCAB_NAME, UNK_PIECE)


def _check_one_vocabulary(model_dir: Path) -> None:
    """:class:`ConfigError` for a model of two vocabularies (``separate_vocabs``): its decoder's
    ids index ``target_vocab.json``, not ``vocab.json``, whatever the two sizes; read through
    the one vocabulary every output would be other pieces. (``share_encoder_decoder_embeddings:
    false`` alone is two embedding tables over one vocabulary, as mtcli's untied models have.)"""
    tokenizer_config = model_dir / "tokenizer_config.json"
    if tokenizer_config.is_file() and _read_json(tokenizer_config).get("separate_vocabs"):
        raise ConfigError(f"{tokenizer_config}: separate_vocabs: true is not supported (separate source and target "
                          "vocabularies)")
    if (model_dir / "target_vocab.json").is_file():
        raise ConfigError(f"{model_dir / 'target_vocab.json'}: a separate target vocabulary is not supported")


def languages(model_dir: Path, src_lang: str | None, tgt_lang: str | None) -> tuple[str, str]:
    """The languages given, else ``tokenizer_config.json``'s ``source_lang``/``target_lang``,
    else the directory's name (``opus-mt-de-en``); :class:`ConfigError` when none says."""
    for option, given in (("--src-lang", src_lang), ("--tgt-lang", tgt_lang)):
        if given is not None and not given.strip():
            raise ConfigError(f"{option} is empty: give a language code, or leave it out to read the model's")
        if given is not None:
            check_language_code(option, given)
    if src_lang and src_lang == tgt_lang:
        raise ConfigError(f"--src-lang and --tgt-lang are both {src_lang!r}: the source and target languages must differ")
    found = [src_lang, tgt_lang]
    path = model_dir / "tokenizer_config.json"
    settings = _read_json(path) if path.is_file() else {}
    match = re.search(r"([A-Za-z_]+)-([A-Za-z_]+)$", model_dir.resolve().name)
    for i, key in enumerate(("source_lang", "target_lang")):
        if not found[i] and isinstance(settings.get(key), str):
            found[i] = settings[key]
        if not found[i] and match:
            found[i] = match.group(i + 1)
    if not found[0] or not found[1]:
        raise ConfigError(f"{model_dir}: cannot tell the source and target languages: give --src-lang and --tgt-lang")
    if found[0] == found[1]:
        raise ConfigError(f"{model_dir}: the source and target languages would both be {found[0]!r} (they must "
                          "differ): give --src-lang and --tgt-lang")
    return str(found[0]), str(found[1])


def id_order(raw: dict[str, Any], vocab: dict[str, int], where: Path) -> list[int]:
    """Marian's id of each of our ids (-1: the pad row mtcli adds; see the module docstring)."""
    size = int(raw.get("vocab_size") or 0)
    if sorted(vocab.values()) != list(range(size)):
        raise ConfigError(f"{where}: the ids of {VOCAB_NAME} must be 0..{size - 1} (config.json vocab_size)")
    pad, eos = raw.get("pad_token_id"), raw.get("eos_token_id")
    start = raw.get("decoder_start_token_id", pad)
    unk = vocab.get(UNK_PIECE)
    ids = (pad, eos, start, unk)
    if not all(isinstance(i, int) and 0 <= i < size for i in ids) or len({pad, eos, unk}) < 3 \
            or len({start, eos, unk}) < 3:
        raise ConfigError(f"{where}: pad_token_id, eos_token_id, decoder_start_token_id and {UNK_PIECE} "
                          f"must be distinct ids (decoder start may be pad), got {ids}")
    head = [-1 if start == pad else pad, unk, start, eos]
    return head + [i for i in range(size) if i not in head]


def _marian_weights(hf: Any, order: list[int]) -> dict[str, torch.Tensor]:
    """Marian's state dict with every vocabulary axis in our id order (a zero row for -1)."""
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    index = torch.tensor([max(i, 0) for i in order])
    added = torch.tensor([i < 0 for i in order])
    for name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][index].masked_fill(added[:, None], 0.0)
    bias = state["final_logits_bias"].reshape(-1)[index]
    state["final_logits_bias"] = bias.masked_fill(added, -1e9)
    return state


def build_model(hf: Any, order: list[int]) -> Transformer:
    """Our Transformer holding the Marian model's weights (see the module docstring)."""
    cfg = hf.config
    state = _marian_weights(hf, order)
    tied = bool(cfg.share_encoder_decoder_embeddings and cfg.tie_word_embeddings)
    model_cfg = ModelConfig(
        d_model=cfg.d_model, n_heads=cfg.encoder_attention_heads, encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers, d_ff=cfg.encoder_ffn_dim, dropout=float(cfg.dropout),
        attention_dropout=float(cfg.attention_dropout), activation_dropout=float(cfg.activation_dropout),
        pre_norm=False, tie_embeddings=tied, max_positions=cfg.max_position_embeddings,
        activation="relu" if cfg.activation_function == "relu" else "swish",
        output_bias=bool(state["final_logits_bias"].ne(0).any()))
    model = Transformer(model_cfg, len(order), PAD_ID).eval()
    p = model_permutation(cfg.d_model)
    with torch.no_grad():
        for name, ours, reads, writes in weight_table(model):
            ours.copy_(from_marian(state[name], reads, writes, p))
        if model.output_bias is not None:
            model.output_bias.copy_(state["final_logits_bias"])
        positions = state.get("model.encoder.embed_positions.weight")
        if positions is not None and not torch.allclose(
                from_marian(positions, True, False, p), model.positions.pe[: positions.size(0)], atol=1e-4):
            where = Path(str(getattr(cfg, "_name_or_path", ""))) / "config.json"
            raise ConfigError(f"{where}: static_position_embeddings: the positions are not Marian's sinusoids")
    return model


def probe(hf: Any, model: Transformer, order: list[int]) -> float:
    """The largest difference of the two models' logits on a probe (a few pieces of the
    vocabulary, our columns against Marian's); :class:`MtcliError` when they disagree."""
    ours_of = {m: i for i, m in enumerate(order) if m >= 0}
    pieces = [i for i in range(4, len(order))][:: max(1, (len(order) - 4) // 7)][:7]
    marian_src = torch.tensor([[order[i] for i in pieces] + [order[EOS_ID]]])
    marian_tgt = torch.tensor([[order[BOS_ID]] + [order[i] for i in pieces[::-1][:5]]])
    with torch.inference_mode():
        theirs = hf(input_ids=marian_src, decoder_input_ids=marian_tgt).logits[0].float()
        ours = model(torch.tensor([[ours_of[int(m)] for m in marian_src[0]]]),
                     torch.tensor([[ours_of[int(m)] for m in marian_tgt[0]]]))[0]
    columns = [i for i, m in enumerate(order) if m >= 0]
    theirs = theirs[:, [order[i] for i in columns]]
    ours = ours[:, columns]
    difference = float((theirs - ours).abs().max())
    if not difference <= 1e-3 * max(1.0, float(theirs.abs().max())):
        raise MtcliError(f"import-hf: mtcli's logits differ from transformers' by {difference:.3g} on a probe "
                         "(this model uses something the import does not carry over)")
    return difference


def _joint_spm(model_dir: Path, vocab: dict[str, int], order: list[int]) -> Tokenizer | None:
    """``source.spm`` as the run's joint model when it serves both sides and its ids already
    are ours; else None."""
    source, target = model_dir / SOURCE_SPM_NAME, model_dir / TARGET_SPM_NAME
    if source.read_bytes() != target.read_bytes():
        return None
    try:
        tokenizer = Tokenizer(source)
    except DataError:
        return None
    pieces = {i: p for p, i in vocab.items()}
    if tokenizer.vocab_size != len(order) or any(
            tokenizer.id_to_piece(ours) != pieces[m] for ours, m in enumerate(order) if ours > EOS_ID):
        return None
    return tokenizer


def _write_tokenizer(tmp: Path, model_dir: Path, vocab: dict[str, int], order: list[int]) -> Path:
    """The run's tokenizer files; returns the file checkpoints identify the vocabulary by."""
    if _joint_spm(model_dir, vocab, order) is not None:
        copy_file(model_dir / SOURCE_SPM_NAME, tmp / SPM_NAME)
        return tmp / SPM_NAME
    ours = {m: i for i, m in enumerate(order) if m >= 0}
    renumbered = {piece: ours[m] for piece, m in sorted(vocab.items(), key=lambda item: ours[item[1]])}
    for name in (SOURCE_SPM_NAME, TARGET_SPM_NAME):
        copy_file(model_dir / name, tmp / name)
    (tmp / VOCAB_NAME).write_text(json.dumps(renumbered, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    return tmp / VOCAB_NAME


#: generation settings mtcli's search does not have, with the values that leave the output as
#: plain search gives it: another value would change transformers' output, not ours
_PLAIN_GENERATION = {
    "repetition_penalty": (None, 1.0), "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0),
    "min_length": (None, 0), "min_new_tokens": (None, 0), "num_beam_groups": (None, 1),
    "diversity_penalty": (None, 0.0), "do_sample": (None, False), "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []), "exponential_decay_length_penalty": (None,),
    "forced_bos_token_id": (None,), "sequence_bias": (None,), "guidance_scale": (None, 1.0),
}


#: A target-language tag as mtcli writes one (:func:`mtcli.data.corpora.target_tag`): ``<2de>``.
_TARGET_TAG = re.compile(r"<2[A-Za-z][A-Za-z0-9_-]*>")


def check_one_direction(model_dir: Path) -> None:
    """:class:`ConfigError` for ``mtcli export --format hf`` of a multilingual run: its sources
    start with a target-language tag, and a run made of it (of one direction) would translate
    without one, into whichever language the model then favours."""
    record = _read_json(model_dir / EXPORT_RECORD) if (model_dir / EXPORT_RECORD).is_file() else None
    if record is None:  # the HF files shared without mtcli's record: its vocabulary says
        tags = sorted(piece for piece in read_vocab(model_dir / VOCAB_NAME) if _TARGET_TAG.fullmatch(piece))
        if tags:
            raise ConfigError(f"{model_dir / VOCAB_NAME}: holds target-language tags ({', '.join(tags)}): a "
                              "multilingual model, which import-hf does not import (a run of one direction would "
                              "translate without its tag)")
    elif record.get("target_tags"):
        raise ConfigError(f"{model_dir / EXPORT_RECORD}: the export of a multilingual run (target tags "
                          f"{', '.join(record['target_tags'])}) is not imported (a run of one direction would translate "
                          f"without its tag); translate with the run it came from: {record.get('run_dir')}")


def _id_set(ids: Any) -> set[Any]:
    """A generation setting's token ids (one id, or a list of them) as a set."""
    return set(ids if isinstance(ids, list | tuple) else [ids])


def check_generation(hf: Any, model_dir: Path) -> None:
    """:class:`ConfigError` naming the key of ``generation_config.json`` that asks transformers
    for something mtcli's search does not do (a repetition penalty, a minimum length, banned
    words other than the pad and start tokens, which mtcli never produces): the import would
    decode otherwise than the model's own ``generate``, without a word."""
    generation = getattr(hf, "generation_config", None)
    if generation is None:
        return
    where = model_dir / "generation_config.json"
    if not where.is_file():  # transformers reads the generation settings from config.json then
        where = model_dir / "config.json"
    beams = getattr(generation, "num_beams", None)
    if beams is not None and (not isinstance(beams, int) or isinstance(beams, bool) or beams < 1):
        raise ConfigError(f"{where}: num_beams: {beams!r} is not a beam size (an integer >= 1; 1: greedy search)")
    end = hf.config.eos_token_id  # the id import renumbers as mtcli's </s>
    ends = generation.eos_token_id
    if ends is not None and _id_set(ends) != {end}:
        raise ConfigError(f"{where}: eos_token_id: {ends!r} is not supported (mtcli's search ends at one token, "
                          f"config.json's eos_token_id {end})")
    forced = getattr(generation, "forced_eos_token_id", None)
    if forced is not None and _id_set(forced) != {end}:
        raise ConfigError(f"{where}: forced_eos_token_id: {forced!r} is not supported (mtcli ends an output cut "
                          f"at its length limit with the end token, {end})")
    for key, plain in _PLAIN_GENERATION.items():
        value = getattr(generation, key, None)
        if value not in plain:
            raise ConfigError(f"{where}: {key}: {value!r} is not supported (mtcli's search has no such setting; "
                              "without it in the file, the model decodes by plain search)")
    never = {hf.config.pad_token_id, hf.config.decoder_start_token_id}  # mtcli's pad and <s>: never produced
    banned = getattr(generation, "bad_words_ids", None) or []
    if any(len(ids) != 1 or ids[0] not in never for ids in banned):
        raise ConfigError(f"{where}: bad_words_ids: {banned!r} is not supported (only the pad and start tokens, "
                          f"{sorted(never)}, which mtcli never produces)")


def output_limit(generation: Any, positions: int) -> int:
    """The most tokens before the end that ``generate`` gives: ``max_new_tokens`` new tokens, else
    ``max_length`` counting the decoder's start (no limit: the model's positions), the last of
    them the end token when ``forced_eos_token_id`` forces it there, as OPUS-MT's do."""
    new = getattr(generation, "max_new_tokens", None)
    length = new + 1 if new else getattr(generation, "max_length", None) or positions
    forced = getattr(generation, "forced_eos_token_id", None) is not None
    return max(1, min(int(length), positions) - 1 - int(forced))


def _as_edited(decode: DecodeConfig, generation: Any, positions: int, model_dir: Path) -> DecodeConfig:
    """An mtcli export's ``decode`` settings, with the beam and the length limit of its
    ``generation_config.json`` (edited since the export) where they differ from them."""
    if generation is None:
        return decode
    edits: dict[str, Any] = {}
    beams = int(getattr(generation, "num_beams", None) or 1)
    if beams != decode.beam_size:
        edits["beam_size"] = beams
    if getattr(generation, "max_new_tokens", None) or \
            getattr(generation, "max_length", None) != generation_max_length(decode, positions):
        edits.update(max_len_a=0.0, max_len_b=output_limit(generation, positions))
    if edits:
        get_logger().info("%s: generation_config.json was edited since the export: %s taken from it", model_dir,
                          ", ".join(f"decode.{key} {value:g}" for key, value in edits.items()))
    return dataclasses.replace(decode, **edits)


def _run_config(hf: Any, model: Transformer, model_dir: Path, run_dir: Path, langs: tuple[str, str]) -> Config:
    generation = getattr(hf, "generation_config", None)
    beams = int(getattr(generation, "num_beams", None) or 1)
    decode = DecodeConfig(beam_size=beams, max_len_a=0.0, max_len_b=output_limit(generation, model.cfg.max_positions))
    exported = _read_json(model_dir / EXPORT_RECORD) if (model_dir / EXPORT_RECORD).is_file() else {}
    if isinstance(exported.get("decode"), dict):  # mtcli's own export: the run's decode settings back,
        # less what needs the training corpus (a shortlist's table), which an import does not have
        keys = {f.name for f in dataclasses.fields(DecodeConfig)} - {"tgt_lang", "shortlist"}
        decode = DecodeConfig(**{k: v for k, v in exported["decode"].items() if k in keys})
        written, path = exported.get("generation_config_sha256"), model_dir / "generation_config.json"
        if written and path.is_file() and sha256_file(path) != written:
            decode = _as_edited(decode, generation, model.cfg.max_positions, model_dir)
    config = Config(
        data=DataConfig(name=run_dir.name, source=str(model_dir.resolve()), src_lang=langs[0], tgt_lang=langs[1],
                        vocab_size=model.vocab_size),
        model=model.cfg, train=TrainConfig(run_dir=str(run_dir)),
        decode=decode, path=str(run_dir / CONFIG_NAME))
    validate(config)
    return config


def _load_marian(model_dir: Path) -> Any:
    """The MarianMTModel of ``model_dir``; one-line :class:`MtcliError` naming the file when its
    weights do not load or do not fit ``config.json`` (nothing of transformers' own report shown)."""
    from transformers import MarianMTModel

    weights, config = weights_file(model_dir), model_dir / "config.json"
    try:
        with quiet_transformers():
            hf, info = MarianMTModel.from_pretrained(str(model_dir), output_loading_info=True,
                                                     ignore_mismatched_sizes=True)
    except MemoryError:
        raise
    except Exception as exc:  # transformers and safetensors raise many kinds (SafetensorError is a bare Exception)
        raise MtcliError(f"{model_dir}: transformers cannot load the model from config.json and {weights.name} "
                         f"({one_line(exc, 200)})") from None
    mismatched = list(info.get("mismatched_keys") or [])
    if mismatched:
        key, theirs, ours = mismatched[0]
        raise ConfigError(f"{config}: does not match {weights}: {len(mismatched)} weights have other shapes, "
                          f"e.g. {key} is {list(theirs)} there but {list(ours)} by config.json")
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise DataError(f"{weights}: lacks {len(missing)} weights the model of config.json has, e.g. {missing[0]}")
    return hf.float().eval()


def check_run_dir(run_dir: Path, force: bool) -> None:
    """Refuse (one line) a ``run_dir`` the import may not write: a file, a directory of other
    files (even with ``force``: mtcli replaces only an import it wrote, one with ``import.json``;
    never a trained run), an earlier import without ``force``."""
    check_replaceable(run_dir, IMPORT_NAME, DERIVED)
    if run_dir.is_dir() and any(run_dir.iterdir()) and not force:
        raise MtcliError(f"{run_dir}: exists; give a new run directory (or --force to replace it)")


def import_hf(model_dir: str | Path, run_dir: str | Path, src_lang: str | None = None,
              tgt_lang: str | None = None, force: bool = False) -> ImportReport:
    """Write ``run_dir`` (atomically) from the Marian model directory ``model_dir`` (see the
    module docstring). An earlier import is replaced only with ``force``; any other directory
    of files never (see :func:`check_run_dir`). Raises
    :class:`ConfigError`/:class:`DataError` (one line, naming the file or key) for what cannot
    be imported exactly, :class:`MtcliError` without ``transformers``."""
    require_transformers("mtcli import-hf")
    model_dir, run_dir = Path(model_dir), Path(run_dir)
    check_run_dir(run_dir, force)
    raw = check_model_dir(model_dir)
    check_one_direction(model_dir)
    langs = languages(model_dir, src_lang, tgt_lang)
    vocab = read_vocab(model_dir / VOCAB_NAME)
    order = id_order(raw, vocab, model_dir / "config.json")
    if (model_dir / "generation_config.json").exists():  # (transformers reads a damaged one as absent)
        _read_json(model_dir / "generation_config.json")
    hf = _load_marian(model_dir)
    check_generation(hf, model_dir)
    model = build_model(hf, order)
    difference = probe(hf, model, order)
    config = _run_config(hf, model, model_dir, run_dir, langs)
    check_run_dir(run_dir, force)  # again: the work took a while
    with atomic_dir(run_dir, mark=IMPORT_NAME, derived=DERIVED) as tmp:
        vocab_file = _write_tokenizer(tmp, model_dir, vocab, order)
        save_config(config, tmp / CONFIG_NAME)
        state = {"format": 1, "step": 0, "epoch": 0, "model": model.state_dict(), "config": config.to_dict(),
                 "vocab": {"size": model.vocab_size, "spm_sha256": sha256_file(vocab_file)},
                 "imported_from": str(model_dir.resolve())}
        directory = checkpoint_dir(tmp)
        directory.mkdir()
        save_checkpoint(directory / step_checkpoint_name(0), state,
                        also=(directory / LAST_NAME, directory / BEST_NAME))
        update_index(tmp, 0, {})
        record = {"from": str(model_dir.resolve()), "transformers": require_transformers().__version__,
                  "files": {p.name: sha256_file(p) for p in sorted(model_dir.iterdir()) if p.is_file()},
                  "max_logit_difference": difference}
        (tmp / IMPORT_NAME).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    kind = "joint spm.model" if vocab_file.name == SPM_NAME else "source.spm + target.spm + vocab.json"
    get_logger().info("imported %s into %s (%s -> %s, %s)", model_dir, run_dir, *langs, kind)
    return ImportReport(run_dir, langs[0], langs[1], model.vocab_size, kind,
                        sum(p.numel() for p in model.parameters()), difference)


__all__ = ["IMPORT_NAME", "ImportReport", "check_model_dir", "check_run_dir", "import_hf", "languages",
           "weights_file"]
