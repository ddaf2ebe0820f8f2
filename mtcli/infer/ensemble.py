"""Ensembles at decode time: several trained models decoded together (``--ensemble``).

An :class:`Ensemble` of M members gives the next token the mean of their probabilities (the
mixture of the members),

    p(y_t | y_<t, x) = 1/M * sum_m p_m(y_t | y_<t, x),

each member with its own encoder output and key/value cache; the search
(:func:`mtcli.infer.search.generate`) scores, ranks and length-normalises the mixture exactly as
it does one model's distribution (``decode.ensemble_mode: log_linear`` uses the renormalised mean
of their log-probabilities instead). The members must share the tokenizer and the output
vocabulary. Each member is an ordinary run directory (train them as separate runs, for example
with different ``train.seed``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from mtcli.checkpoint import directions_text, other_directions
from mtcli.errors import CheckpointError, ConfigError
from mtcli.fileio import sha256_file
from mtcli.infer.loading import InferenceModel, load_for_inference
from mtcli.model import Transformer
from mtcli.rundir import CONFIG_NAME


class Ensemble(nn.Module):
    """Transformers decoded together: the next-token distribution is the mean of the members'
    probabilities, ``p(y_t | y_<t, x) = 1/M * sum_m p_m(y_t | y_<t, x)``.

    Only :func:`mtcli.infer.search.generate` uses it (each member encodes the source and keeps its own
    key/value cache); attention pictures show the first member's cross-attention.
    """

    def __init__(self, members: Sequence[Transformer], labels: Sequence[str] | None = None) -> None:
        super().__init__()
        if not members:
            raise ConfigError("an ensemble needs at least one model")
        labels = labels or [f"ensemble member {i}" for i in range(1, len(members) + 1)]  # how errors name them
        first = members[0]
        for label, other in zip(labels[1:], members[1:], strict=True):
            a, b = first.output_ids, other.output_ids
            same_ids = (a is None) == (b is None) and (a is None or torch.equal(a.cpu(), b.cpu()))
            if other.vocab_size != first.vocab_size:
                raise CheckpointError(f"{label} has another vocabulary than {labels[0]}: members must come from the "
                                      "same prepared data")
            if not same_ids:
                said = [f"{name} {'joint' if ids is None else 'target'}" for name, ids in ((labels[0], a), (label, b))]
                raise CheckpointError(f"{label} has another output vocabulary than {labels[0]} (model.output_vocab: "
                                      f"{', '.join(said)}): members must decode over the same pieces")
        self.members = nn.ModuleList(members)
        self.train(first.training)  # a mode of its own would be set on the members by train()

    @property
    def max_positions(self) -> int:
        """The longest sequence every member accepts."""
        return min(m.cfg.max_positions for m in self.members)

    @property
    def output_size(self) -> int:
        """Size of the (shared) output vocabulary."""
        return self.members[0].output_size


def decoding_members(model: nn.Module) -> list[Transformer]:
    """The Transformers a search runs: an :class:`Ensemble`'s members, or the model itself."""
    return list(model.members) if isinstance(model, Ensemble) else [model]  # type: ignore[list-item]


def _member_location(spec: str | Path, first_run: Path | None) -> tuple[Path, str, bool]:
    """``(run_dir, checkpoint)`` of an ``--ensemble`` argument: a run directory (its best
    checkpoint), a checkpoint file in a run directory's ``checkpoints/``, or another checkpoint
    file (``mtcli average -o avg.pt``), read with ``first_run``, the first member's run (whose
    SentencePiece model it must have been trained with: its vocabulary is checked); and whether
    it is such a file."""
    path = Path(spec)
    if path.is_dir():
        return path, "best", False
    if path.is_file() and path.parent.name == "checkpoints" and (path.parent.parent / CONFIG_NAME).is_file():
        return path.parent.parent, str(path), False
    if path.is_file() and first_run is not None:
        return first_run, str(path), True
    raise CheckpointError(f"{spec}: not a run directory nor a checkpoint file (--ensemble takes either)")


def add_members(bundle: InferenceModel, others: Sequence[str | Path], run_dir: str | Path | None = None
                ) -> InferenceModel:
    """``bundle`` (of the run ``run_dir``) with its model replaced by the :class:`Ensemble` of it
    and ``others`` (each a run directory or a checkpoint file, see :func:`_member_location`),
    which must use the same SentencePiece model. Returns ``bundle`` itself when ``others`` is
    empty."""
    if not others:
        return bundle
    models, names, digests = [bundle.model], [bundle.name], [bundle.weights_sha256]
    spm = sha256_file(bundle.tokenizer.model_path)
    for spec in others:
        member_run, checkpoint, loose = _member_location(spec, None if run_dir is None else Path(run_dir))
        member = load_for_inference(member_run, checkpoint)
        if sha256_file(member.tokenizer.model_path) != spm:
            raise CheckpointError(f"{spec}: its spm.model differs from the first member's "
                                  "(ensemble members must share the SentencePiece model)")
        differ = other_directions(member.config.to_dict()["data"], bundle.config.to_dict()["data"])
        if differ:
            raise CheckpointError(f"{spec}: trained for {directions_text(differ[0])}, the first member for "
                                  f"{directions_text(differ[1])} (ensemble members must translate the same "
                                  "directions)")
        models.append(member.model)
        names.append(member.name if loose else f"{member_run.name}/checkpoints/{member.name}")
        digests.append(member.weights_sha256)
    labels = ["the first member", *map(str, others)]
    return dataclasses.replace(bundle, model=Ensemble(models, labels), name=" + ".join(names),
                               weights_sha256=ensemble_sha256(digests))


def ensemble_sha256(member_digests: Sequence[str | None]) -> str | None:
    """The sha256 that names an ensemble: of its members' weights' sha256s, in order (a model
    alone or in an ensemble, or two ensembles of other members, are told apart)."""
    if any(digest is None for digest in member_digests):
        return None
    return hashlib.sha256(("ensemble:" + ",".join(member_digests)).encode()).hexdigest()  # type: ignore[arg-type]
