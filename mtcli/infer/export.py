"""Export a trained run to CTranslate2 (``mtcli export RUN_DIR OUT --format ctranslate2``).

The model is rebuilt with CTranslate2's Python specification API
(``ctranslate2.specs.TransformerSpec``), weight by weight from our state dict, so nothing
depends on another toolkit's checkpoint format. What has to line up with :mod:`mtcli.model`:

* **embeddings** are multiplied by ``sqrt(d_model)`` (section 3.4): ``scale_embeddings = True``;
* **positions** are our sinusoid table (``PE(pos, 2i) = sin``, ``PE(pos, 2i+1) = cos``), written
  explicitly as ``position_encodings.encodings`` (CTranslate2's built-in table interleaves
  differently), starting at position 0 for the first token;
* **norms**: post-norm (``LayerNorm(x + Sublayer(x))``, the paper) or pre-norm with a final
  LayerNorm per stack, epsilon ``1e-5``;
* **attention**: our fused ``[W^Q; W^K; W^V]`` self-attention projection and fused
  ``[W^K; W^V]`` cross-attention projection are exactly CTranslate2's fused layouts;
* **tied embeddings**: the joint embedding is written as the encoder and decoder embeddings and
  as the output projection (no bias);
* **vocabulary**: one joint list of SentencePiece pieces in id order (``pad=0`` named
  ``<blank>`` as CTranslate2 expects, ``<unk>=1``, ``<s>=2``, ``</s>=3``), the decoder starts
  from ``<s>``, and ``</s>`` is appended to the source automatically (``add_source_eos``), so a
  caller passes the SentencePiece pieces of a sentence as they are.

``spm.model`` is copied beside the model (``<OUT>/spm.model``). Usage from Python::

    import ctranslate2, sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file="OUT/spm.model")
    tr = ctranslate2.Translator("OUT")
    out = tr.translate_batch([sp.encode("Ein Hund läuft.", out_type=str)], beam_size=5)
    print(sp.decode(out[0].hypotheses[0]))

CTranslate2 is an optional dependency (the ``ctranslate2`` extra).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import torch

from mtcli.builddir import atomic_dir, check_replaceable
from mtcli.checkpoint import sha256_of_loaded
from mtcli.data.tokenizer import Tokenizer
from mtcli.errors import CheckpointError, ConfigError, MtcliError, install_advice
from mtcli.fileio import copy_file, sha256_file
from mtcli.infer.loading import InferenceModel, load_for_inference, resolve_checkpoint
from mtcli.logs import get_logger
from mtcli.model import LAYER_NORM_EPS, Transformer
from mtcli.rundir import EXPORT_RECORD

FORMATS = ("ctranslate2",)  # what export_model writes; `mtcli export --format hf` is mtcli.infer.hf's
#: every format `mtcli export` knows, as its error lists them
EXPORT_FORMATS = (*FORMATS, "hf")
#: Loads of a checkpoint a training run keeps replacing (best, last) before an export gives up:
#: the record names the file the weights came from, which must hold them still once they are read.
LOAD_ATTEMPTS = 3
#: Where ``--engine ctranslate2`` keeps a run's conversion (:mod:`mtcli.infer.ct2`)
CT2_DIR = "ctranslate2"


def require_ctranslate2(purpose: str = "export to ctranslate2") -> Any:
    """Import and return ``ctranslate2``, or raise a one-line :class:`MtcliError` saying that
    ``purpose`` needs it and how to get it."""
    try:
        import ctranslate2
        import ctranslate2.specs  # noqa: F401
    except ImportError:
        raise MtcliError(
            f"{purpose} needs the optional 'ctranslate2' package: {install_advice('ctranslate2')}"
        ) from None
    return ctranslate2


def _np(t: torch.Tensor) -> Any:
    return t.detach().to(torch.float32).cpu().contiguous().numpy()


def _linear(spec: Any, module: torch.nn.Linear) -> None:
    spec.weight = _np(module.weight)
    if module.bias is not None:
        spec.bias = _np(module.bias)


def _norm(spec: Any, module: torch.nn.LayerNorm) -> None:
    spec.gamma = _np(module.weight)
    spec.beta = _np(module.bias)


def _self_attention_and_ffn(layer_spec: Any, layer: Any) -> None:
    """Copy the sublayers encoder and decoder layers share: self-attention (first) and FFN (last)."""
    _linear(layer_spec.self_attention.linear[0], layer.self_attn.qkv_proj)
    _linear(layer_spec.self_attention.linear[1], layer.self_attn.out_proj)
    _norm(layer_spec.self_attention.layer_norm, layer.sublayer[0].norm)
    _linear(layer_spec.ffn.linear_0, layer.feed_forward.w_1)
    _linear(layer_spec.ffn.linear_1, layer.feed_forward.w_2)
    _norm(layer_spec.ffn.layer_norm, layer.sublayer[-1].norm)


def build_spec(model: Transformer, vocabulary: list[str]) -> Any:
    """A ``ctranslate2.specs.TransformerSpec`` holding ``model``'s weights and ``vocabulary``.

    ``model`` is a :class:`mtcli.model.Transformer`; ``vocabulary`` the pieces of ids
    ``0..V-1``. mtcli's feed-forward activations (ReLU, swish) and absolute sinusoidal positions
    are CTranslate2's too, and an output bias is its projection's bias, so the mapping is one to
    one (see the module docstring).
    """
    require_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    activation = {"relu": common_spec.Activation.RELU, "swish": common_spec.Activation.SWISH}[cfg.activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers),
        cfg.n_heads,
        pre_norm=cfg.pre_norm,
        activation=activation,
    )
    pe = _np(model.positions.pe)
    enc, dec = spec.encoder, spec.decoder
    for stack_spec, stack in ((enc, model.encoder), (dec, model.decoder)):
        stack_spec.scale_embeddings = True
        stack_spec.position_encodings.encodings = pe
        if cfg.pre_norm:
            _norm(stack_spec.layer_norm, stack.norm)
    enc.embeddings[0].weight = _np(model.encoder.embed.weight)
    dec.embeddings.weight = _np(model.decoder.embed.weight)
    if model.output_projection is None:
        dec.projection.weight = _np(model.decoder.embed.weight)
    else:
        _linear(dec.projection, model.output_projection)
    bias = None if model.output_bias is None else model.output_bias.detach().float()  # model.output_bias
    if model.output_ids is not None:
        # the output vocabulary (model.output_vocab: target) as a projection bias: 0 on the
        # list, a finite -1e9 elsewhere (exp underflows to 0 as with our -inf)
        outside = model.widen(torch.zeros(model.output_size))
        bias = outside if bias is None else bias + outside
    if bias is not None:
        dec.projection.bias = _np(bias.clamp(min=-1e9))

    for layer_spec, layer in zip(enc.layer, model.encoder.layers, strict=True):
        _self_attention_and_ffn(layer_spec, layer)
    for layer_spec, layer in zip(dec.layer, model.decoder.layers, strict=True):
        _self_attention_and_ffn(layer_spec, layer)
        _linear(layer_spec.attention.linear[0], layer.cross_attn.q_proj)
        _linear(layer_spec.attention.linear[1], layer.cross_attn.kv_proj)
        _linear(layer_spec.attention.linear[2], layer.cross_attn.out_proj)
        _norm(layer_spec.attention.layer_norm, layer.sublayer[1].norm)

    spec.config.layer_norm_epsilon = LAYER_NORM_EPS
    spec.config.unk_token = "<unk>"
    spec.config.bos_token = "<s>"
    spec.config.eos_token = "</s>"
    spec.config.decoder_start_token = "<s>"
    spec.config.add_source_eos = True
    spec.register_source_vocabulary(vocabulary)
    spec.register_target_vocabulary(vocabulary)
    return spec


def check_convertible(bundle: InferenceModel, run_dir: Path) -> None:
    """Refuse a model CTranslate2 conversion cannot take: one of two SentencePiece models."""
    if not isinstance(bundle.tokenizer, Tokenizer):
        raise ConfigError(f"{run_dir}: CTranslate2 conversion needs a joint spm.model; this run has separate "
                          "source and target SentencePiece models (mtcli import-hf): use --format hf or --engine torch")


def save_ctranslate2(bundle: InferenceModel, output: Path, run_dir: Path, **record: Any) -> None:
    """Write ``bundle``'s model (on the CPU, float32) as CTranslate2 into ``output`` (atomically),
    with ``spm.model`` and :data:`EXPORT_RECORD` (``record`` adds to it). The weights written are
    the ones in hand, named by ``checkpoint_payload_sha256``, not the checkpoint file read again."""
    check_convertible(bundle, run_dir)
    spec = build_spec(bundle.model.eval(), vocabulary_of(bundle.tokenizer))
    spec.validate()
    spec.optimize(quantization=None)
    with atomic_dir(output, mark=EXPORT_RECORD) as tmp:
        spec.save(str(tmp))
        copy_file(bundle.tokenizer.model_path, tmp / "spm.model")
        info = {
            "format": "ctranslate2",
            "run_dir": str(Path(run_dir).resolve()),  # (advice that names it holds from any directory)
            "checkpoint": bundle.name,
            "checkpoint_payload_sha256": bundle.payload_sha256,  # the weights converted (the file's header)
            "weights_sha256": bundle.weights_sha256,  # the same, of the tensors (an average has only this)
            "model_bin_sha256": sha256_file(tmp / "model.bin"),  # a reader can tell a damaged copy
            **record,
            "model": bundle.config.to_dict()["model"],
            "decode": bundle.config.to_dict()["decode"],  # the run's beam, length penalty and limits
            "vocab_size": bundle.tokenizer.vocab_size,
            "usage": "ctranslate2.Translator(dir).translate_batch([spm pieces], suppress_sequences=[['<blank>'], "
                     "['<s>']], min_decoding_length=0) as mtcli decodes it (docs/decoding.md); source </s> is added",
        }
        if bundle.target_tags:  # a multilingual run: a source starts with its target language's tag
            info["target_tags"] = {lang: bundle.tokenizer.id_to_piece(i) for lang, i in bundle.target_tags.items()}
            info["usage"] += ("; each source's pieces start with target_tags[target language], the tag "
                              "counted in the max_positions - 1 pieces a source is cut to")
        (tmp / EXPORT_RECORD).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def vocabulary_of(tokenizer: Tokenizer) -> list[str]:
    """Pieces of ids ``0..V-1`` with the pad piece renamed ``<blank>`` (CTranslate2's pad name)."""
    pieces = [tokenizer.id_to_piece(i) for i in range(tokenizer.vocab_size)]
    pieces[0] = "<blank>"
    return pieces


def check_export_dir(output: Path, fmt: str) -> None:
    """Raise, before a conversion, unless ``output`` may take a ``fmt`` export: a new or empty
    directory, or one of mtcli's exports of that format (:func:`check_replaceable`); an export
    of the other format is kept (exports of a run in two formats go in two directories)."""
    check_replaceable(output, EXPORT_RECORD)
    try:
        held = json.loads((output / EXPORT_RECORD).read_text(encoding="utf-8")).get("format")
    except (OSError, ValueError, AttributeError):  # none there (or not a record: check_replaceable's)
        return
    if held in EXPORT_FORMATS and held != fmt:
        raise FileExistsError(errno.EEXIST, f"holds a --format {held} export, which this --format {fmt} export "
                              "would replace; give another directory (or remove this one first)", str(output))


def export_model(
    run_dir: str | Path, output: str | Path, fmt: str = "ctranslate2", checkpoint: str = "best"
) -> Path:
    """Export ``checkpoint`` of ``run_dir`` to the directory ``output`` (written atomically).

    ``output`` gets CTranslate2's ``model.bin``, ``config.json`` and vocabulary files, the run's
    ``spm.model`` and ``mtcli_export.json`` (source checkpoint and model shape). Raises
    :class:`ConfigError` for an unknown format, :class:`MtcliError` when ``ctranslate2`` is not
    installed, :class:`mtcli.errors.CheckpointError` for a bad run directory or checkpoint.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: unknown export format (known here: {', '.join(FORMATS)}; hf is "
                          "mtcli.infer.hf.export_hf's)" if fmt in EXPORT_FORMATS else
                          f"--format {fmt!r}: unknown export format (known: {', '.join(EXPORT_FORMATS)})")
    require_ctranslate2()
    output = Path(output)
    check_export_dir(output, fmt)  # before the conversion
    for attempt in range(LOAD_ATTEMPTS):  # a training run may save a new best or last between the two reads
        bundle = load_for_inference(run_dir, checkpoint, device="cpu")
        try:
            file_sha256 = sha256_of_loaded(resolve_checkpoint(Path(run_dir), checkpoint), bundle.payload_sha256)
            break
        except CheckpointError:
            if attempt == LOAD_ATTEMPTS - 1:
                raise
    save_ctranslate2(bundle, output, Path(run_dir), checkpoint_sha256=file_sha256)
    get_logger().info("exported %s to %s (%s)", bundle.name, output, fmt)
    return output
