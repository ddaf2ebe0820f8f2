"""Export to Hugging Face Transformers: a run as a ``MarianMTModel`` with its ``MarianTokenizer``.

``mtcli export RUN OUT --format hf`` writes what ``MarianMTModel.from_pretrained(OUT)`` and
``transformers.pipeline("translation", model=OUT)`` load. The architectures match one to one:
post-norm layers, ReLU (or swish, ``model.activation``) feed-forward networks, embeddings scaled
by ``sqrt(d_model)``, sinusoidal positions, the output projection tied to the embeddings (or not,
as the run has it) and the output bias (``model.output_bias``) as ``final_logits_bias``. What
differs, and what the export does about it:

* **positions**: ours interleave ``sin`` and ``cos`` (``PE(pos, 2i)``, ``PE(pos, 2i+1)``); Marian
  keeps all the sines, then all the cosines. The export applies that permutation of the model
  dimension to every weight that reads or writes it (embeddings, layer norms, the attention and
  feed-forward projections' model-side axes), which changes no output;
* **the first decoder token**: Marian models start from pad; ours from ``<s>``:
  ``decoder_start_token_id`` is set to ``<s>``'s id;
* **tokens search never emits** (pad and ``<s>``): the generation config forbids them
  (``bad_words_ids``), as our search does;
* **the target-side output vocabulary** (``model.output_vocab: target``): the projection covers the
  joint vocabulary, and ``final_logits_bias`` is -1e9 outside the run's output pieces;
* **the tokenizer**: the run's joint SentencePiece model serves as both ``source.spm`` and
  ``target.spm``, with ``vocab.json`` mapping its pieces to their ids (a run imported by
  ``mtcli import-hf`` with separate models exports those two and its ``vocab.json``).

:func:`weight_table` is the one mapping of our weights to Marian's names; the import
(:mod:`mtcli.infer.hf_import`) reads through it too.

Needs the ``hf`` extra. A pre-norm run (``model.pre_norm``) is
refused: Marian has no pre-norm layers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mtcli.builddir import atomic_dir
from mtcli.data.vocabmap import VocabTokenizer
from mtcli.errors import ConfigError, MtcliError, failed_to_allocate, install_advice, one_line
from mtcli.fileio import default_file_mode, sha256_file
from mtcli.infer.export import EXPORT_RECORD, check_export_dir
from mtcli.infer.loading import load_for_inference
from mtcli.model import Transformer


def require_transformers(purpose: str = "--format hf") -> Any:
    """The ``transformers`` module, or an :class:`MtcliError` saying ``purpose`` needs it and how
    to install it."""
    try:
        import transformers
    except ImportError:
        raise MtcliError(f"{purpose} needs Hugging Face Transformers: {install_advice('hf')}") from None
    return transformers


def model_permutation(d_model: int) -> torch.Tensor:
    """The order of our model dimensions in Marian's: the even ones (sines), then the odd ones."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _marian_config(model: Transformer, vocab_size: int, beam: int) -> Any:
    from transformers import MarianConfig

    cfg = model.cfg
    return MarianConfig(
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, d_model=cfg.d_model,
        encoder_layers=cfg.encoder_layers, decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, activation_function=cfg.activation,
        max_position_embeddings=cfg.max_positions, scale_embedding=True, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, eos_token_id=3,
        decoder_start_token_id=2, forced_eos_token_id=3, num_beams=beam,
        share_encoder_decoder_embeddings=cfg.tie_embeddings,
        tie_word_embeddings=model.output_projection is None,
    )


#: One weight under Marian's name: ``(name, ours, reads, writes)``, ``ours`` our tensor (or a
#: view of part of it, which an import copies into), ``reads``: its last axis is the model
#: dimension, ``writes``: its first axis is (a layer norm's weight and bias, an output bias).
WeightEntry = tuple[str, torch.Tensor, bool, bool]


def weight_table(model: Transformer) -> list[WeightEntry]:
    """Every parameter of ``model`` under its Marian name (the one mapping both directions use:
    :func:`export_hf` and :mod:`mtcli.infer.hf_import`): embeddings, every layer's projections
    and norms, and ``lm_head.weight``. Not here: positions (a formula on both sides) and
    ``final_logits_bias``/``model.shared.weight`` (each direction writes or reads them itself)."""
    d = model.cfg.d_model
    table: list[WeightEntry] = []

    def linear(name: str, weight: torch.Tensor, bias: torch.Tensor, reads: bool, writes: bool) -> None:
        table.append((f"{name}.weight", weight, reads, writes))
        table.append((f"{name}.bias", bias, False, writes))

    def norm(name: str, module: torch.nn.LayerNorm) -> None:
        table.append((f"{name}.weight", module.weight, False, True))
        table.append((f"{name}.bias", module.bias, False, True))

    def self_attention_and_ffn(prefix: str, layer: Any) -> None:
        qkv = layer.self_attn.qkv_proj
        for k, part in enumerate("qkv"):
            linear(f"{prefix}.self_attn.{part}_proj", qkv.weight[k * d:(k + 1) * d], qkv.bias[k * d:(k + 1) * d],
                   True, False)
        linear(f"{prefix}.self_attn.out_proj", layer.self_attn.out_proj.weight, layer.self_attn.out_proj.bias,
               False, True)
        norm(f"{prefix}.self_attn_layer_norm", layer.sublayer[0].norm)
        linear(f"{prefix}.fc1", layer.feed_forward.w_1.weight, layer.feed_forward.w_1.bias, True, False)
        linear(f"{prefix}.fc2", layer.feed_forward.w_2.weight, layer.feed_forward.w_2.bias, False, True)
        norm(f"{prefix}.final_layer_norm", layer.sublayer[-1].norm)

    for stack, name in ((model.encoder, "encoder"), (model.decoder, "decoder")):
        table.append((f"model.{name}.embed_tokens.weight", stack.embed.weight, True, False))
    for i, layer in enumerate(model.encoder.layers):
        self_attention_and_ffn(f"model.encoder.layers.{i}", layer)
    for i, layer in enumerate(model.decoder.layers):
        prefix = f"model.decoder.layers.{i}"
        self_attention_and_ffn(prefix, layer)
        cross = layer.cross_attn
        linear(f"{prefix}.encoder_attn.q_proj", cross.q_proj.weight, cross.q_proj.bias, True, False)
        for k, part in enumerate("kv"):
            linear(f"{prefix}.encoder_attn.{part}_proj", cross.kv_proj.weight[k * d:(k + 1) * d],
                   cross.kv_proj.bias[k * d:(k + 1) * d], True, False)
        linear(f"{prefix}.encoder_attn.out_proj", cross.out_proj.weight, cross.out_proj.bias, False, True)
        norm(f"{prefix}.encoder_attn_layer_norm", layer.sublayer[1].norm)
    table.append(("lm_head.weight", model.output_weight(), True, False))
    return table


def to_marian(tensor: torch.Tensor, reads: bool, writes: bool, p: torch.Tensor) -> torch.Tensor:
    """Our tensor in Marian's layout: the model-dimension axes ``reads``/``writes`` permuted by
    ``p`` (:func:`model_permutation`)."""
    out = tensor[..., p] if reads else tensor
    return out[p] if writes else out


def from_marian(tensor: torch.Tensor, reads: bool, writes: bool, p: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_marian`: Marian's tensor in our layout."""
    return to_marian(tensor, reads, writes, torch.argsort(p))


def _weights(model: Transformer) -> dict[str, torch.Tensor]:
    """Our weights under Marian's names, the model dimension permuted (module docstring)."""
    p = model_permutation(model.cfg.d_model)
    out = {name: to_marian(ours, reads, writes, p) for name, ours, reads, writes in weight_table(model)}
    for name in ("encoder", "decoder"):
        out[f"model.{name}.embed_positions.weight"] = model.positions.pe[: model.cfg.max_positions, p]
    if model.cfg.tie_embeddings:
        out["model.shared.weight"] = out["model.encoder.embed_tokens.weight"]
    bias = torch.zeros(1, model.vocab_size)
    if model.output_bias is not None:
        bias[0] = model.output_bias.float()
    if model.output_ids is not None:
        bias[0] += model.widen(torch.zeros(model.output_size))
    out["final_logits_bias"] = bias.clamp(min=-1e9)
    return {k: v.detach().float().contiguous() for k, v in out.items()}


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' logging (its load report), progress bars and warnings off for the block
    (library code never prints; what goes wrong becomes our one-line error)."""
    from transformers.utils import logging as hf_logging

    logger = logging.getLogger("transformers")
    level, bars = logger.level, hf_logging.is_progress_bar_enabled()
    logger.setLevel(logging.CRITICAL + 1)
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


def export_hf(run_dir: str | Path, output: str | Path, checkpoint: str = "best") -> Path:
    """Write ``checkpoint`` of ``run_dir`` to ``output`` (atomically) as a Marian model and
    tokenizer (see the module docstring). Raises :class:`ConfigError` for a pre-norm run,
    :class:`MtcliError` without ``transformers``."""
    require_transformers()
    from transformers import GenerationConfig, MarianMTModel, MarianTokenizer

    check_export_dir(Path(output), "hf")  # before the conversion
    bundle = load_for_inference(run_dir, checkpoint, device="cpu")
    model = bundle.model.float().eval()
    if model.cfg.pre_norm:
        raise ConfigError("--format hf: this run's layers are pre-norm (model.pre_norm); Marian's are post-norm")
    tokenizer = bundle.tokenizer
    hf = MarianMTModel(_marian_config(model, tokenizer.vocab_size, bundle.config.decode.beam_size)).eval()
    missing, unexpected = hf.load_state_dict(_weights(model), strict=False)
    left = [k for k in missing if k not in ("model.shared.weight", "lm_head.weight")]
    if left or unexpected:
        raise MtcliError(f"--format hf: weights do not match Marian's ({', '.join([*left, *unexpected][:5])})")
    decode = bundle.config.decode
    hf.generation_config = GenerationConfig(
        decoder_start_token_id=2, eos_token_id=3, pad_token_id=0, forced_eos_token_id=3,
        bad_words_ids=[[0], [2]], num_beams=decode.beam_size, length_penalty=decode.length_penalty,
        max_length=generation_max_length(decode, model.cfg.max_positions))
    output = Path(output)
    with atomic_dir(output, mark=EXPORT_RECORD) as tmp, quiet_transformers():
        try:
            hf.save_pretrained(tmp)
        except OSError:
            raise  # atomic_dir names the output
        except Exception as exc:  # safetensors' own error for a full disk, among others
            if failed_to_allocate(exc):
                raise MemoryError(f"{output}: writing the export ({one_line(exc)})") from None
            raise MtcliError(f"{output}: cannot write the export ({one_line(exc)})") from None
        for written in tmp.iterdir():  # safetensors writes 0600: an export served by another account could not read it
            if written.is_file():
                os.chmod(written, default_file_mode())
        vocab = {tokenizer.id_to_piece(i): i for i in range(tokenizer.vocab_size)}
        (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        split = isinstance(tokenizer, VocabTokenizer)
        spm_files = (tokenizer.source_path, tokenizer.target_path) if split else (tokenizer.model_path,) * 2
        for name, path in zip(("source.spm", "target.spm"), spm_files, strict=True):
            (tmp / name).write_bytes(Path(path).read_bytes())
        data = bundle.config.data
        MarianTokenizer(str(tmp / "source.spm"), str(tmp / "target.spm"), str(tmp / "vocab.json"),
                        source_lang=data.src_lang, target_lang=data.tgt_lang,
                        # room for the tag a multilingual run's sources start with, put before them
                        model_max_length=model.cfg.max_positions - (1 if bundle.target_tags else 0),
                        unk_token="<unk>", eos_token="</s>", pad_token="<pad>").save_pretrained(tmp)
        record = {"format": "hf", "run_dir": str(Path(run_dir).resolve()), "checkpoint": bundle.name,
                  "model": bundle.config.to_dict()["model"], "decode": bundle.config.to_dict()["decode"],
                  # what the export wrote: an import takes an edited generation config's beam and limit
                  "generation_config_sha256": sha256_file(tmp / "generation_config.json")}
        if bundle.target_tags:  # a multilingual run: its sources start with a tag, which MarianTokenizer cannot write
            record["target_tags"] = {lang: {"piece": tokenizer.id_to_piece(i), "id": i}
                                     for lang, i in bundle.target_tags.items()}
            record["usage"] = ("put target_tags[target language]['id'] before each source's input_ids (the "
                               "tokenizer's model_max_length leaves room for it: truncation=True)")
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")  # import-hf reads it
    return output


def generation_max_length(decode: Any, max_positions: int) -> int:
    """``generate``'s ``max_length`` for the run's output limit: a fixed limit (``max_len_a: 0``,
    as an import sets it) exactly, ``decode.max_len_b`` tokens and ``</s>`` after the start token;
    else the model's positions (transformers has no limit relative to the source)."""
    if decode.max_len_a == 0:
        return min(int(decode.max_len_b) + 2, max_positions)
    return max_positions


__all__ = ["export_hf", "from_marian", "generation_max_length", "model_permutation", "require_transformers", "to_marian", "weight_table"]
