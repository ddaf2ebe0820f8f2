"""The four sections of a config (``data``, ``model``, ``train``, ``decode``) as dataclasses, with
their defaults: what a key means and takes. :mod:`mtcli.config` reads them from YAML and
``--set``, and checks their values.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


@dataclass
class CorpusConfig:
    """One corpus of ``data.sources``: where it comes from, how often its pairs are drawn, the
    tag its sources carry, and its direction (default ``[data.src_lang, data.tgt_lang]``)."""

    source: str
    weight: float = 1.0  # each pair is drawn this many times an epoch on average (0.5: half of them)
    tag: str | None = None  # e.g. "<bt>": an atomic symbol put before each of its sources
    langs: list[str] | None = None  # [source language, target language]
    hub_config: str | None = None


#: The largest ``train.seed`` (and ``--seeds``): numpy's and torch's generators take it as it is.
MAX_SEED = 2**32 - 1


def _home(path: str | None) -> str | None:
    """A path key's value with a leading ``~`` expanded, as a shell does (a YAML file or a
    quoted ``--set`` leaves it to mtcli: ``./~/run`` was made instead)."""
    return os.path.expanduser(path) if isinstance(path, str) and path.startswith("~") else path


def usable_cores(limit: int = 16) -> int:
    """The cores this process may run on, at most ``limit``: ``data.num_workers`` when a config
    leaves it out (``prepare`` gives the same cache with any number)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(limit, cores))


@dataclass
class DataConfig:
    """Where the corpus comes from, how it is cleaned, and the joint SentencePiece model."""

    name: str
    src_lang: str
    tgt_lang: str
    source: str = ""  # one corpus; or data.sources, several
    sources: list[CorpusConfig] = field(default_factory=list)
    hub_config: str | None = None
    train_split: str = "train"
    valid_split: str = "val"
    test_splits: list[str] = field(default_factory=lambda: ["test"])
    prepared_dir: str | None = None
    max_length: int = 250
    max_length_ratio: float = 3.0
    dedup: bool = False
    vocab_size: int = 8000
    spm_model_type: Literal["unigram", "bpe", "char", "word"] = "unigram"
    character_coverage: float = 1.0  # a config without it: 0.9995 when a language is Chinese or Japanese
    # (below 1.0 the rest are spelled in byte pieces: mtcli.data.prepare.spells_in_bytes)
    spm_normalization: Literal["nmt_nfkc", "nfkc", "nmt_nfkc_cf", "nfkc_cf", "identity"] = "nmt_nfkc"  # a config
    # without it: identity for a target language of mtcli.languages.AS_WRITTEN_LANGUAGES (zh, ja, th, ko...)
    spm_max_sentences: int = 2_000_000
    spm_model: str | None = None  # encode with this model (run dir, cache or spm.model), not a new one
    num_workers: int = field(default_factory=usable_cores)  # prepare's processes

    def __post_init__(self) -> None:
        self.prepared_dir, self.spm_model = map(_home, (self.prepared_dir, self.spm_model))

    def prepared_path(self) -> Path:
        """Directory of the binarised cache (default ``data/prepared/<name>``)."""
        return Path(self.prepared_dir) if self.prepared_dir else Path("data/prepared") / self.name

    def corpora(self) -> list[CorpusConfig]:
        """The corpora to read, each with its direction filled in: ``data.sources``, or the one
        ``data.source`` names."""
        listed = self.sources or [CorpusConfig(source=self.source, hub_config=self.hub_config)]
        return [dataclasses.replace(c, langs=c.langs or [self.src_lang, self.tgt_lang]) for c in listed]

    def target_langs(self) -> list[str]:
        """The languages the corpora translate into, in the order they first come."""
        return list(dict.fromkeys(c.langs[1] for c in self.corpora() if c.langs))


@dataclass
class ModelConfig:
    """Shape of the encoder-decoder Transformer (defaults: the paper's base model, with dropout
    0.1 on the attention weights as well, as tensor2tensor's ``transformer_base`` has it; the
    WMT14 recipes set ``attention_dropout: 0.0``, the paper's)."""

    d_model: int = 512
    n_heads: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    attention_dropout: float = 0.1
    activation_dropout: float = 0.0
    pre_norm: bool = False
    tie_embeddings: bool = True
    max_positions: int = 1024
    output_vocab: Literal["joint", "target"] = "joint"
    activation: Literal["relu", "swish"] = "relu"  # the feed-forward's (swish = SiLU, as OPUS-MT's)
    output_bias: bool = False  # a fixed bias on the logits (Marian's final_logits_bias; mtcli import-hf)


@dataclass
class TrainConfig:
    """The training loop: batching, optimisation, validation, checkpoints."""

    run_dir: str | None = None
    seed: int = 1
    device: str = "auto"
    num_threads: int = 0
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "fp32"  # autocast dtype (fp16: with a gradient scaler)
    compile: bool = False  # torch.compile the forward and loss (a GPU pays back the minute it takes)
    max_tokens: int = 4096
    pack_length: int = 0  # > 0: pack pairs end to end in rows of this many slots (one batch shape)
    update_freq: int = 1
    max_source_length: int = 256
    max_target_length: int = 256
    max_steps: int = 100_000
    max_epochs: int = 0
    max_minutes: float = 0.0
    cooldown_steps: int = 0
    patience: int = 0
    init_from: str | None = None  # start from this run directory's (or checkpoint's) weights
    init_average: int = 1  # ... averaged over the run's last K step checkpoints
    lr_schedule: Literal["noam", "inverse_sqrt", "constant"] = "noam"
    lr: float = 0.0  # the peak rate of inverse_sqrt/constant (Noam's comes from lr_factor)
    lr_factor: float = 1.0
    warmup_steps: int = 4000
    label_smoothing: float = 0.1
    rdrop_alpha: float = 0.0  # R-Drop: > 0 runs each batch twice and adds alpha * symmetric KL
    subword_alpha: float = 0.0
    subword_nbest: int = 32
    subword_sides: Literal["both", "source"] = "both"
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    clip_norm: float = 0.0
    valid_every: int = 1000
    valid_bleu: bool = True  # decode the validation split greedily and score it (BLEU, chrF)
    valid_metric: Literal["bleu", "chrf", "loss"] = "bleu"  # picks checkpoint_best, counts for patience
    valid_max_sentences: int = 0
    keep_last: int = 5
    keep_best: int = 0
    log_every: int = 100
    max_nonfinite: int = 5
    progress: bool = True

    def __post_init__(self) -> None:
        self.run_dir, self.init_from = map(_home, (self.run_dir, self.init_from))


#: The closed ranges of the numeric decode settings (the server's request fields and the command
#: line's options take the same).
DECODE_RANGES: dict[str, tuple[float, float]] = {
    "length_penalty": (-5, 5), "max_len_a": (0, 10), "max_len_b": (0, 10_000), "temperature": (0.01, 100)}


@dataclass
class DecodeConfig:
    """Search settings used by ``evaluate``, ``translate`` and validation BLEU."""

    beam_size: int = 5
    length_penalty: float = 1.0
    max_len_a: float = 1.2
    max_len_b: int = 10
    max_tokens: int = 4096
    nbest: int = 1
    bf16: bool = False
    int8: bool = False
    workers: int = 1
    ensemble_mode: Literal["linear", "log_linear"] = "linear"  # how --ensemble members are combined
    shortlist: int = 0  # > 0: decode over a lexical shortlist, this many target pieces per source piece
    shortlist_frequent: int = 100  # ... plus this many most frequent target pieces
    sampling: Literal["none", "topk", "topp"] = "none"  # draw decode.nbest translations instead of searching
    topk: int = 10  # sampling: topk draws from this many most probable tokens
    topp: float = 0.9  # sampling: topp draws from the smallest set of tokens with this much probability
    temperature: float = 1.0  # sampling draws from softmax(log p / temperature)
    seed: int = 1  # sampling: the same seed, input and model give the same samples
    tgt_lang: str | None = None  # a model of several target languages: translate into this one (default data.tgt_lang)


@dataclass
class Config:
    """A whole recipe: the four sections, plus the file it came from (for messages)."""

    data: DataConfig
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    path: str = field(default="<config>", compare=False)
    # the --set given with it, and the data changes made since as --set (None: made otherwise)
    overrides: tuple[str, ...] | None = field(default=(), compare=False)

    def prepare_command(self) -> str:
        """The ``mtcli prepare`` command line that builds this config's cache: its file and
        the ``--set`` of its data section given with it (``CONFIG`` where no command line can
        say what its data section is)."""
        if self.overrides is None or self.path == "<config>":
            return "mtcli prepare CONFIG"
        sets = "".join(f" --set {shlex.quote(text)}" for text in self.overrides
                       if text.strip().startswith("data."))
        return f"mtcli prepare {shlex.quote(self.path)}{sets}"

    def source_of(self, key: str) -> str:
        """Where ``key``'s value (``"train.device"``) came from, for an error about it: the
        config's file, and the ``--set`` of it when one was given."""
        given = [text for text in self.overrides or () if text.split("=", 1)[0].strip() == key]
        return f"{self.path} with --set {' '.join(given)}" if given else self.path

    def run_path(self) -> Path:
        """Run directory (default ``data/runs/<config file stem>``; for a run's own
        ``config.yaml``, that run: ``mtcli train RUN/config.yaml`` resumes it)."""
        if self.train.run_dir:
            return Path(self.train.run_dir)
        if Path(self.path).name == "config.yaml" and (Path(self.path).parent / "checkpoints").is_dir():
            return Path(self.path).parent
        stem = Path(self.path).stem if self.path != "<config>" else self.data.name
        return Path("data/runs") / stem

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of the four sections (what is written to ``config.yaml``)."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


SECTIONS: dict[str, type] = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig, "decode": DecodeConfig}
