"""Tests of mtcli.config: typed YAML recipes, one-line errors with exit code 2, --set overrides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO
from typer.testing import CliRunner

from mtcli.cli import app
from mtcli.config import (
    Config,
    config_from_dict,
    load_config,
    parse_override,
    save_config,
    with_changes,
)
from mtcli.errors import ConfigError

MINIMAL = {"data": {"name": "x", "source": "somewhere", "src_lang": "de", "tgt_lang": "en"}}


def write(tmp_path: Path, raw: object, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


def cli_error(path: Path, *extra: str) -> str:
    """Run `mtcli prepare` on a bad config: exit code 2, one line on stderr, no traceback."""
    result = CliRunner().invoke(app, ["prepare", str(path), *extra])
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("mtcli: error: ")
    return lines[0]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    config = load_config(path)
    assert isinstance(config, Config)
    assert config.path == str(path)
    assert config.data.name and config.data.src_lang != config.data.tgt_lang


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    raw = {**MINIMAL, "train": {"max_step": 10}}
    message = cli_error(write(tmp_path, raw))
    assert "recipe.yaml" in message and "train.max_step" in message and "max_steps" in message


def test_unknown_section(tmp_path: Path) -> None:
    message = cli_error(write(tmp_path, {**MINIMAL, "optim": {}}))
    assert "recipe.yaml" in message and "optim" in message


def test_a_key_given_twice_is_refused_at_its_line(tmp_path: Path) -> None:
    """PyYAML lets the second of two equal keys win without a word: a recipe's garbled header
    made ``data:`` twice, and a user's second ``train:`` section would drop the first."""
    path = tmp_path / "recipe.yaml"
    path.write_text("data:\n  source: corpus\n  src_lang: de\n  tgt_lang: en\ntrain:\n  max_steps: 5\n"
                    "train:\n  max_steps: 6\n", encoding="utf-8")
    assert cli_error(path) == f"mtcli: error: {path}: line 7: key 'train' is given twice"
    path.write_text("data: {source: corpus, src_lang: de, tgt_lang: en, src_lang: fr}\n", encoding="utf-8")
    assert cli_error(path) == f"mtcli: error: {path}: line 1: key 'src_lang' is given twice"


def test_wrong_type_names_file_key_and_type(tmp_path: Path) -> None:
    raw = {**MINIMAL, "train": {"max_steps": "many"}}
    message = cli_error(write(tmp_path, raw))
    assert "recipe.yaml" in message and "train.max_steps" in message and "int" in message
    raw = {**MINIMAL, "model": {"pre_norm": 1}}
    assert "model.pre_norm" in cli_error(write(tmp_path, raw))
    raw = {"data": {**MINIMAL["data"], "spm_model_type": "wordpiece"}}
    assert "data.spm_model_type" in cli_error(write(tmp_path, raw))


def test_missing_required_key_names_file_and_key(tmp_path: Path) -> None:
    data = dict(MINIMAL["data"])
    del data["tgt_lang"]
    message = cli_error(write(tmp_path, {"data": data}))
    assert "recipe.yaml" in message and "data.tgt_lang" in message
    message = cli_error(write(tmp_path, {"model": {}}, "nodata.yaml"))
    assert "nodata.yaml" in message and "data" in message


def test_an_empty_data_section_says_it_is_empty(tmp_path: Path) -> None:
    message = cli_error(write(tmp_path, "data:\nmodel:\n  d_model: 64\n"))
    assert message.endswith("recipe.yaml: data: is empty; it needs at least data.source, data.src_lang "
                            "and data.tgt_lang"), message


@pytest.mark.parametrize("name", ["../../evil", "a/b", "a\\b", "..", ".", ""])
def test_data_name_must_be_a_plain_name(tmp_path: Path, name: str) -> None:
    """data.name names data/prepared/<name>: a path there would write the cache elsewhere."""
    message = cli_error(write(tmp_path, {"data": {**MINIMAL["data"], "name": name}}))
    assert "recipe.yaml: data.name must be a plain name" in message and repr(name) in message
    assert "--set data.name=../x: data.name must be" in cli_error(write(tmp_path, MINIMAL), "--set", "data.name=../x")
    assert config_from_dict(MINIMAL, overrides=["data.name=multi30k_de-en.v2"]).data.name == "multi30k_de-en.v2"


def test_data_name_left_out_is_the_config_files_name(tmp_path: Path) -> None:
    """As ``train.run_dir`` defaults to ``data/runs/<file stem>``, the cache is named after the
    file: a config of a source and two languages is enough. A dict with no file still needs it."""
    data = dict(MINIMAL["data"])
    del data["name"]
    config = load_config(write(tmp_path, {"data": data}, "en_fr.yaml"))
    assert config.data.name == "en_fr" and config.data.prepared_path() == Path("data/prepared/en_fr")
    with pytest.raises(ConfigError, match=r"missing required key 'data.name'"):
        config_from_dict({"data": data})


def test_invalid_yaml_and_missing_file(tmp_path: Path) -> None:
    message = cli_error(write(tmp_path, "data: [unclosed\n"))
    assert "recipe.yaml" in message
    assert "not found" in cli_error(tmp_path / "absent.yaml")


def test_set_overrides_parse_each_type(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    config = load_config(
        path,
        [
            "train.max_steps=100",
            "train.adam_eps=1e-8",
            "train.lr_factor=2",
            "model.pre_norm=true",
            "data.test_splits=[a, b]",
            "data.hub_config=de-en",
            "data.src_lang=fr",
            "train.adam_betas=[0.9, 0.99]",
        ],
    )
    assert config.train.max_steps == 100 and isinstance(config.train.max_steps, int)
    assert config.train.adam_eps == pytest.approx(1e-8)
    assert config.train.lr_factor == 2.0 and isinstance(config.train.lr_factor, float)
    assert config.model.pre_norm is True
    assert config.data.test_splits == ["a", "b"]
    assert config.data.hub_config == "de-en" and config.data.src_lang == "fr"
    assert config.train.adam_betas == [0.9, 0.99]


def test_set_wrong_type_or_unknown_key_is_exit_2(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    # each names the --set, not the file, which does not hold the key
    assert cli_error(path, "--set", "train.max_steps=lots").endswith(
        "--set 'train.max_steps=lots': key 'train.max_steps' must be int, got 'lots'")
    assert "--set 'train.adam_eps=small': key 'train.adam_eps'" in cli_error(path, "--set", "train.adam_eps=small")
    assert "--set 'train.nope=1': unknown key 'train.nope' (known keys: run_dir," in cli_error(
        path, "--set", "train.nope=1")
    assert "bogus" in cli_error(path, "--set", "bogus.key=1")
    assert str(path) not in cli_error(path, "--set", "train.nope=1")
    assert cli_error(path, "--set", "data.sources=[{source: a, weight: x}]").endswith(
        "--set 'data.sources=[{source: a, weight: x}]': key 'data.sources[0].weight' must be float, got 'x'")


@pytest.mark.parametrize("bad", ["train.max_steps", "max_steps=3", "train.max.steps=3", ".x=1"])
def test_bad_set_syntax(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override(bad)
    assert "section.key=value" in cli_error(write(tmp_path, MINIMAL), "--set", bad)


def test_cross_field_validation(tmp_path: Path) -> None:
    raw = {**MINIMAL, "model": {"d_model": 30, "n_heads": 4}}
    assert "model.d_model" in cli_error(write(tmp_path, raw))
    with pytest.raises(ConfigError, match="src_lang"):
        config_from_dict(MINIMAL, overrides=["data.tgt_lang=de"])


@pytest.mark.parametrize(("change", "says"), [
    ("train.log_every=0", "train.log_every must be >= 1"),  # was a ZeroDivisionError mid-training
    ("train.max_steps=0", "train.max_steps must be >= 1"),
    ("train.max_minutes=-1", "train.max_minutes must be 0 (no limit) or > 0"),
    ("train.num_threads=-2", "train.num_threads must be 0 (PyTorch's choice) or > 0"),
    ("train.clip_norm=-1", "train.clip_norm must be 0 (off) or > 0"),
    ("train.adam_eps=0", "train.adam_eps must be > 0"),
    ("train.adam_betas=[1.5,0.9]", "train.adam_betas must be two values in [0, 1)"),  # was Adam's traceback
    ("model.d_ff=0", "model.d_ff must be >= 1"),  # was oneDNN's traceback
    ("model.n_heads=0", "model.n_heads must be >= 1"),  # was a ZeroDivisionError
    ("model.n_heads=-2", "model.n_heads must be >= 1"),  # was a shape error in the first step, a run made
    ("model.max_positions=1", "model.max_positions must be >= 2"),
    ("model.attention_dropout=1", "model.attention_dropout and model.activation_dropout must be in [0, 1)"),
    ("data.num_workers=0", "data.num_workers must be >= 1"),  # was taken as 1 without a word
    ("train.seed=-1", "train.seed must be between 0 and 4294967295"),  # numpy's traceback after prepare
    ("train.seed=99999999999999999999", "train.seed must be between 0 and 4294967295"),  # torch's overflow
    ("data.character_coverage=0.5", "data.character_coverage must be in [0.98, 1]"),  # SentencePiece's own error
    ("decode.max_len_b=-50", "decode.max_len_a and decode.max_len_b must be >= 0 and not both 0"),
    ("decode.max_len_a=0", "decode.max_len_a and decode.max_len_b must be >= 0 and not both 0"),
    ("data.spm_max_sentences=-5", "data.spm_max_sentences must be 0 (all of them) or > 0"),  # taken as 0
    ("data.valid_split=", "data.train_split, data.valid_split and data.test_splits must name splits (none empty)"),
    ("data.test_splits=['']", "data.train_split, data.valid_split and data.test_splits must name splits"),
    ("data.test_splits=[test,test]", "data.test_splits names a split twice: ['test', 'test']"),
    ("train.subword_nbest=1", "train.subword_nbest must be >= 2 with train.subword_alpha > 0 (1 is the best "
                              "segmentation alone: nothing is sampled)"),  # said it sampled, and sampled nothing
])
def test_a_value_out_of_range_is_refused_with_its_key(change: str, says: str) -> None:
    overrides = {"decode.max_len_a=0": [change, "decode.max_len_b=0"],
                 "train.subword_nbest=1": [change, "train.subword_alpha=0.1", "data.spm_model_type=unigram"],
                 }.get(change, [change])
    with pytest.raises(ConfigError) as exc:
        config_from_dict(MINIMAL, overrides=overrides)
    assert says in str(exc.value)


@pytest.mark.parametrize(("edge", "past", "says"), [
    ("train.keep_best=0", "train.keep_best=-1", "train.keep_best must be >= 0"),
    ("data.character_coverage=0.98", "data.character_coverage=0.979", "data.character_coverage must be in [0.98, 1]"),
    ("data.vocab_size=16777216", "data.vocab_size=16777217", "data.vocab_size must be between 8 and 16,777,216"),
    ("train.seed=4294967295", "train.seed=4294967296", "train.seed must be between 0 and 4294967295"),
    ("train.pack_length=2", "train.pack_length=1", "train.pack_length must be 0 (token batches) or a row of 2"),
    ("data.num_workers=1024", "data.num_workers=1025", "data.num_workers must be at most 1024"),
    ("train.num_threads=1024", "train.num_threads=1025", "train.num_threads must be at most 1024"),
    ("data.max_length_ratio=1.0", "data.max_length_ratio=0.99", "data.max_length_ratio >= 1"),
    ("train.update_freq=1", "train.update_freq=0", "train.update_freq must be >= 1"),
    ("data.spm_max_sentences=0", "data.spm_max_sentences=-1", "data.spm_max_sentences must be 0 (all of them)"),
])
def test_a_range_s_edge_is_accepted_and_one_step_past_it_refused(edge: str, past: str, says: str) -> None:
    """Each range check holds its boundary value (a `>=` made `>` refused it) and refuses the
    next value out (a check left out let it through)."""
    config_from_dict(MINIMAL, overrides=[edge])
    with pytest.raises(ConfigError) as exc:
        config_from_dict(MINIMAL, overrides=[past])
    assert says in str(exc.value)


def test_a_config_that_is_not_utf8_names_its_line_and_column(tmp_path: Path) -> None:
    """It said Python's codec error, with the byte's offset in the file."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"data:\n  source: caf\xe9\n")
    assert cli_error(path) == f"mtcli: error: {path}:2: invalid UTF-8 (byte 0xe9 at column 14); save the config as UTF-8"


def test_a_bad_value_names_where_it_came_from(tmp_path: Path) -> None:
    """A value out of range names the --set or the change that gave it, not only the file."""
    path = write(tmp_path, MINIMAL)
    line = cli_error(path, "--set", "train.warmup_steps=0")
    assert f"{path} with --set train.warmup_steps=0: train.warmup_steps must be >= 1" in line
    # of several --set, the one the rule names; all of them when it names none
    line = cli_error(path, "--set", "train.max_steps=5", "--set", "train.warmup_steps=0", "--set", "train.seed=2")
    assert f"{path} with --set train.warmup_steps=0: train.warmup_steps must be >= 1" in line
    line = cli_error(path, "--set", "model.n_heads=3", "--set", "model.d_ff=64", "--set", "model.d_model=64")
    assert "with --set model.n_heads=3 model.d_model=64: model.n_heads must be >= 1 and model.d_model a positive multiple" in line
    line = cli_error(path, "--set", "data.sources=[{source: a, langs: [de, de]}]", "--set", "data.source=")
    assert "with --set data.sources=[{source: a, langs: [de, de]}]: data.sources[0].langs" in line
    bad = write(tmp_path, {**MINIMAL, "train": {"warmup_steps": 0}}, "bad.yaml")
    line = cli_error(bad)
    assert f"{bad}: train.warmup_steps" in line and "--set" not in line
    config = load_config(path)
    with pytest.raises(ConfigError, match=r"^decode.beam_size=0: decode.beam_size must be >= 1"):
        with_changes(config, "decode", beam_size=0)
    # `translate --beam 0` gives its nbest too: the error names the key it is about, not both
    with pytest.raises(ConfigError, match=r"^decode.beam_size=0: decode.beam_size must be >= 1"):
        with_changes(config, "decode", beam_size=0, nbest=1)



@pytest.mark.parametrize(("change", "says"), [
    ("decode.length_penalty=-.inf", "decode.length_penalty must be in [-5, 5], got -inf"),  # was a ZeroDivisionError
    ("decode.length_penalty=.nan", "decode.length_penalty must be in [-5, 5], got nan"),  # was nan scores
    ("decode.length_penalty=-6", "decode.length_penalty must be in [-5, 5], got -6.0"),
    ("decode.length_penalty=6", "decode.length_penalty must be in [-5, 5], got 6.0"),
    ("decode.max_len_a=1e300", "decode.max_len_a must be in [0, 10], got 1e+300"),  # was int64 overflow: empty
    ("decode.max_len_a=1e20", "decode.max_len_a must be in [0, 10], got 1e+20"),
    ("decode.max_len_a=.nan", "decode.max_len_a"),
    ("decode.max_len_b=100000000000000000000", "decode.max_len_b must be in [0, 10000], got 100000000000000000000"),
    ("decode.temperature=1e-300", "decode.temperature must be in [0.01, 100], got 1e-300"),  # was no token at all
    ("decode.temperature=1e-40", "decode.temperature must be in [0.01, 100], got 1e-40"),
    ("decode.temperature=1e308", "decode.temperature must be in [0.01, 100], got 1e+308"),
    ("decode.temperature=.inf", "decode.temperature must be in [0.01, 100], got inf"),
    ("decode.temperature=.nan", "decode.temperature must be in [0.01, 100], got nan"),
    ("decode.topp=.nan", "decode.topp in (0, 1]"),
])
def test_a_decode_setting_must_be_finite_and_in_range(tmp_path: Path, change: str, says: str) -> None:
    """From a file, a --set and the Python API (Translator.from_run's keywords go through
    with_changes) alike; the ranges' ends are accepted."""
    key, value = change.split("=")
    assert says in cli_error(write(tmp_path, {**MINIMAL, "decode": {key.split(".")[1]: yaml.safe_load(value)}}))
    with pytest.raises(ConfigError) as exc:
        config_from_dict(MINIMAL, "r.yaml", overrides=[change])
    assert str(exc.value).startswith(f"r.yaml with --set {change}: decode.") and says in str(exc.value)
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=\S+: .*{re.escape(says)}"):
        with_changes(config_from_dict(MINIMAL), "decode", **{key.split(".")[1]: yaml.safe_load(value)})
    edges = ["decode.length_penalty=-5", "decode.max_len_a=10", "decode.max_len_b=10000", "decode.temperature=0.01"]
    assert config_from_dict(MINIMAL, overrides=edges).decode.temperature == 0.01
    assert config_from_dict(MINIMAL, overrides=["decode.length_penalty=5", "decode.temperature=100"])


def sources_error(*sources: object) -> str:
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"data": {**MINIMAL["data"], "source": "", "sources": list(sources)}}, "r.yaml")
    return str(exc.value)


@pytest.mark.parametrize("weight", [float("inf"), 1e9, 1000.5, float("nan")])
def test_a_corpus_weight_must_be_finite_and_at_most_1000(weight: float) -> None:
    """inf was an OverflowError in training, 1e9 an allocation of terabytes."""
    assert sources_error({"source": "a"}, {"source": "b", "weight": weight}).startswith(
        "r.yaml: data.sources[1].weight must be > 0 and at most 1000")
    several = {**MINIMAL["data"], "source": "", "sources": [{"source": "a"}, {"source": "b", "weight": 1000}]}
    assert config_from_dict({"data": several}).data.sources[1].weight == 1000.0


@pytest.mark.parametrize("tag", ["e", "\u2581", "</s>", "<pad>", "<s>", "<unk>", "<2fr>", "<2zh_TW>", 5, "<>",
                                 "<b t>", "<bt", "<b/t>"])
def test_a_corpus_tag_is_one_symbol_that_collides_with_none_of_mtcli(tag: object) -> None:
    """'e' became a control symbol (the letter lost from every word), '\u2581' the word boundary,
    the special pieces and <2xx> target-language tags are taken, an int was taken as text."""
    message = sources_error({"source": "a", "tag": tag})
    assert message.startswith("r.yaml: data.sources[0].tag must be one symbol <name>") and "\n" not in message
    for fine in ("<bt>", "<news-2019_x>", "<2019>"):
        assert config_from_dict({"data": {**MINIMAL["data"], "source": "", "sources": [
            {"source": "a", "tag": fine}]}}).data.sources[0].tag == fine


def test_a_corpus_that_is_not_a_mapping_is_named(tmp_path: Path) -> None:
    """It said 'got ['/tmp/x', CorpusConfig(source=...)]'."""
    message = cli_error(write(tmp_path, {"data": {**MINIMAL["data"], "source": "", "sources": [
        {"source": "b"}, "/tmp/x"]}}))
    assert message.endswith("recipe.yaml: data.sources[1] must be a mapping like {source: ..., weight: ...}, "
                            "got '/tmp/x'"), message
    assert cli_error(write(tmp_path, MINIMAL), "--set", "data.source=", "--set", "data.sources=[/tmp/x]").endswith(
        "--set 'data.sources=[/tmp/x]': data.sources[0] must be a mapping like {source: ..., weight: ...}, "
        "got '/tmp/x'")

@pytest.mark.parametrize(("langs", "coverage"), [
    (("de", "en"), 1.0), (("zh", "en"), 0.9995), (("en", "ja"), 0.9995), (("zh_TW", "en"), 0.9995),
    (("ko", "en"), 1.0),
])
def test_character_coverage_left_out_follows_the_languages(langs: tuple[str, str], coverage: float) -> None:
    """SentencePiece's advice: 0.9995 for the rich character sets of Chinese and Japanese, else
    1.0; a config that sets it keeps its value."""
    data = {**MINIMAL["data"], "src_lang": langs[0], "tgt_lang": langs[1]}
    assert config_from_dict({"data": data}).data.character_coverage == coverage
    assert config_from_dict({"data": {**data, "character_coverage": 1.0}}).data.character_coverage == 1.0
    several = {**MINIMAL["data"], "source": "", "sources": [{"source": "a"}, {"source": "b", "langs": list(langs)}]}
    assert config_from_dict({"data": several}).data.character_coverage == coverage


@pytest.mark.parametrize(("langs", "rule"), [
    (("de", "en"), "nmt_nfkc"), (("en", "zh"), "identity"), (("en", "ja-JP"), "identity"), (("zh", "en"), "nmt_nfkc"),
    (("en", "th"), "identity"), (("en", "ko_KR"), "identity"), (("en", "fa"), "identity"), (("fa", "en"), "nmt_nfkc"),
    (("en", "km"), "nmt_nfkc"),
])
def test_normalization_left_out_keeps_a_chinese_or_japanese_target_as_written(langs: tuple[str, str], rule: str) -> None:
    """NFKC turns Chinese and Japanese full-width punctuation into ASCII no reference holds: a
    config without data.spm_normalization keeps such a target's text as written; another
    target, or a source in such a language, keeps SentencePiece's nmt_nfkc; a set value stays."""
    data = {**MINIMAL["data"], "src_lang": langs[0], "tgt_lang": langs[1]}
    assert config_from_dict({"data": data}).data.spm_normalization == rule
    assert config_from_dict({"data": {**data, "spm_normalization": "nfkc"}}).data.spm_normalization == "nfkc"
    several = {**MINIMAL["data"], "source": "", "sources": [{"source": "a"}, {"source": "b", "langs": list(langs)}]}
    assert config_from_dict({"data": several}).data.spm_normalization == rule


@pytest.mark.parametrize(("cores", "workers"), [(1, 1), (6, 6), (64, 16)])
def test_num_workers_left_out_is_the_usable_cores_up_to_16(monkeypatch: pytest.MonkeyPatch, cores: int,
                                                           workers: int) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert config_from_dict(MINIMAL).data.num_workers == workers
    assert config_from_dict({"data": {**MINIMAL["data"], "num_workers": 3}}).data.num_workers == 3


def test_save_then_load_round_trip(tmp_path: Path) -> None:
    config = load_config(REPO / "configs" / "multi30k_de_en.yaml", ["train.max_steps=7"])
    save_config(config, tmp_path / "resolved.yaml")
    again = load_config(tmp_path / "resolved.yaml")
    assert again.to_dict() == config.to_dict()
    assert again.train.max_steps == 7


def test_a_run_config_of_another_version_loads_for_decoding(tmp_path: Path) -> None:
    """A key this mtcli does not know is refused in a recipe, and dropped (with a warning) from a
    run directory's config read for decoding."""
    old = {**MINIMAL, "decode": {"length_penalty_limit": 1.3}}
    with pytest.raises(ConfigError, match="unknown key 'decode.length_penalty_limit'"):
        load_config(write(tmp_path, old))
    assert load_config(tmp_path / "recipe.yaml", lenient=True) == load_config(write(tmp_path, MINIMAL, "plain.yaml"))


def test_version_prints_the_package_version() -> None:
    from mtcli.version import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"mtcli {__version__}"


def test_a_current_directory_removed_meanwhile_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """There translate, evaluate and train ended in "Intel oneMKL FATAL ERROR: Cannot load
    libtorch_cpu.so" (torch's libraries), and prepare blamed the cache it could not write."""
    import os

    def removed() -> str:
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(os, "getcwd", removed)
    result = CliRunner().invoke(app, ["prepare", "any.yaml"])
    assert result.exit_code == 1 and result.stderr == (
        "mtcli: error: the current directory no longer exists (removed since the shell entered it): cd into one "
        "that does\n")


@pytest.mark.parametrize("change", ["train.rdrop_alpha: .inf", "train.lr: .nan", "train.max_minutes: -.inf"])
def test_a_float_setting_that_is_not_finite_is_refused(tmp_path: Path, change: str) -> None:
    """YAML's .inf was taken (--set refused 'inf' as 'not a float'): an infinite R-Drop weight
    trained a model of NaNs, saved as checkpoint_best, exit 0."""
    key, value = change.split(": ")
    section, name = key.split(".")
    message = cli_error(write(tmp_path, {**MINIMAL, section: {name: yaml.safe_load(value)}}))
    assert f"{key} must be a finite number, got " in message
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} must be a finite number"):
        config_from_dict(MINIMAL, "r.yaml", overrides=[f"{key}={value.lstrip('-.')}"])


def test_a_runs_own_config_trains_that_run_and_a_run_directory_is_named(tmp_path: Path) -> None:
    """``mtcli train RUN`` was "[Errno 21] Is a directory", and ``mtcli train RUN/config.yaml``
    trained a new run in data/runs/config from step 0 (a run's config.yaml has no run_dir)."""
    run = tmp_path / "toy"
    (run / "checkpoints").mkdir(parents=True)
    save_config(load_config(REPO / "configs" / "toy.yaml"), run / "config.yaml")
    assert load_config(run / "config.yaml").run_path() == run
    with pytest.raises(ConfigError, match=r"toy: is a directory \(a run directory: its config.yaml resumes it\); give"):
        load_config(run)
    with pytest.raises(ConfigError, match=r"checkpoints: is a directory; give a YAML config file"):
        load_config(run / "checkpoints")
    plain = tmp_path / "recipes" / "config.yaml"  # a config.yaml of one's own, not in a run: as before
    plain.parent.mkdir()
    plain.write_text((run / "config.yaml").read_text())
    assert load_config(plain).run_path() == Path("data/runs/config")


@pytest.mark.parametrize(("key", "lang"), [("src_lang", "a b"), ("tgt_lang", "de.x"), ("src_lang", "")])
def test_a_language_that_cannot_name_a_file_is_refused(key: str, lang: str) -> None:
    """They name files (train.<lang>) and tags (<2lang>): 'a b' or 'de.x' was accepted."""
    data = {"name": "x", "source": "x", "src_lang": "de", "tgt_lang": "en", key: lang}
    with pytest.raises(ConfigError, match=rf"data.{key} must be a language code .*got '{re.escape(lang)}'"):
        config_from_dict({"data": data})
    config_from_dict({"data": {**data, key: "pt_BR" if key == "src_lang" else "zh-Hans"}})


def test_norwegian_and_yaml11_words_are_text_and_booleans_still_take_them(tmp_path: Path) -> None:
    """`tgt_lang: no` (Norwegian) was YAML 1.1's false: "must be str, got False"."""
    path = write(tmp_path, "data:\n  name: x\n  source: s\n  src_lang: en\n  tgt_lang: no\n  dedup: yes\n"
                           "train:\n  progress: off\n")
    config = load_config(path, ["data.src_lang=on"])
    assert config.data.tgt_lang == "no" and config.data.src_lang == "on"
    assert config.data.dedup is True and config.train.progress is False
    assert load_config(path, ["data.dedup=false"]).data.dedup is False


def test_a_boolean_spelt_as_text_is_taken() -> None:
    """A Python keyword took "no" for a boolean but refused "false"; a quoted YAML "true" too."""
    data = {"name": "x", "source": "x", "src_lang": "de", "tgt_lang": "en"}
    for text, value in (("false", False), ("True", True), ("no", False), ("on", True)):
        assert config_from_dict({"data": {**data, "dedup": text}}).data.dedup is value
    with pytest.raises(ConfigError, match="dedup"):
        config_from_dict({"data": {**data, "dedup": "maybe"}})


def test_a_merge_key_reads_as_yaml_says(tmp_path: Path) -> None:
    """`<<: *common` was "could not determine a constructor for the tag merge"."""
    path = write(tmp_path, "data:\n  name: x\n  src_lang: de\n  tgt_lang: en\n  sources:\n"
                 "    - &c {source: a, weight: 2.0}\n    - {<<: *c, source: b}\n"
                 "train: {<<: {max_steps: 7, seed: 3}, seed: 4}\n")
    config = load_config(path)
    assert [(c.source, c.weight) for c in config.data.sources] == [("a", 2.0), ("b", 2.0)]
    assert (config.train.max_steps, config.train.seed) == (7, 4)  # the mapping's own key wins
    with pytest.raises(ConfigError, match="key 'seed' is given twice"):
        load_config(write(tmp_path, "data: {name: x, source: a, src_lang: de, tgt_lang: en}\n"
                                    "train: {seed: 1, seed: 2}\n", "twice.yaml"))


def test_a_home_path_is_expanded_in_every_path_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--set train.run_dir=~/run` made ./~/run; data.spm_model and --init-from were not found."""
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(write(tmp_path, MINIMAL), ["data.prepared_dir=~/prep", "data.spm_model=~/spm",
                                                    "train.run_dir=~/run"])
    assert (config.data.prepared_path(), config.run_path()) == (tmp_path / "prep", tmp_path / "run")
    assert config.data.spm_model == str(tmp_path / "spm")
    assert with_changes(config, "train", init_from="~/parent").train.init_from == str(tmp_path / "parent")


@pytest.mark.parametrize("key", ["data.prepared_dir", "data.spm_model", "train.run_dir", "train.init_from"])
def test_an_empty_path_is_refused(tmp_path: Path, key: str) -> None:
    """`--init-from "$PARENT"` with PARENT unset trained from scratch; spm_model='' made a new model."""
    with pytest.raises(ConfigError, match=rf"{key} is empty: leave it out \(or null\)"):
        load_config(write(tmp_path, MINIMAL), [f"{key}="])
    if key == "train.init_from":
        with pytest.raises(ConfigError, match=rf"{key} is empty"):
            with_changes(load_config(write(tmp_path, MINIMAL)), "train", init_from="")


def test_an_empty_path_in_a_runs_own_config_is_read_as_none(tmp_path: Path) -> None:
    """A run saved with init_from: '' (before empty paths were refused) could no longer be
    translated or evaluated (resuming it, a config read in full, says to mend the key); a path
    of spaces is empty too."""
    path = write(tmp_path, {**MINIMAL, "train": {"init_from": "", "run_dir": "  "}})
    assert load_config(path, lenient=True).train.init_from is None
    with pytest.raises(ConfigError, match="train.run_dir is empty"):
        load_config(path)
    with pytest.raises(ConfigError, match="train.init_from is empty"):
        load_config(path, ["train.run_dir=null"])


def test_a_set_into_a_section_that_is_no_mapping_is_refused(tmp_path: Path) -> None:
    """`model: d_model=64` with `--set model.dropout=0.2` trained the default base model."""
    path = write(tmp_path, {**MINIMAL, "model": "d_model=64 n_heads=2"})
    with pytest.raises(ConfigError, match=r"section 'model' must be a mapping, got 'd_model=64 n_heads=2'"):
        load_config(path, ["model.dropout=0.2"])
    assert load_config(write(tmp_path, {**MINIMAL, "model": None}), ["model.dropout=0.2"]).model.dropout == 0.2


def test_a_config_from_a_pipe_needs_a_name(tmp_path: Path) -> None:
    """`mtcli train <(sed ...)` named its cache and run '63', and the next such call resumed it."""
    raw = {"data": {k: v for k, v in MINIMAL["data"].items() if k != "name"}}
    with pytest.raises(ConfigError, match=r"^/dev/fd/63: a config read from a pipe has no file name"):
        config_from_dict(raw, "/dev/fd/63")
    named = config_from_dict({"data": dict(raw["data"], name="mine")}, "/dev/fd/63")
    assert named.run_path() == Path("data/runs/mine") and named.data.prepared_path() == Path("data/prepared/mine")


def test_an_error_of_the_file_itself_names_no_set(tmp_path: Path) -> None:
    """`d_model: 63` in the file, `--set train.max_steps=10`: the error blamed the --set."""
    path = write(tmp_path, {**MINIMAL, "model": {"d_model": 63, "n_heads": 1}})
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: model.d_model must be even"):
        load_config(path, ["train.max_steps=10"])
    fixed = write(tmp_path, {"data": {k: v for k, v in MINIMAL["data"].items() if k != "src_lang"},
                             "model": {"d_model": 500, "n_heads": 3}}, "fixed.yaml")  # (the --set mends the file)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(fixed))} with --set data.src_lang=de: model.n_heads"):
        load_config(fixed, ["data.src_lang=de"])
    good = write(tmp_path, MINIMAL, "ok.yaml")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(good))} with --set model.d_model=63: model.d_model must"):
        load_config(good, ["model.d_model=63", "model.n_heads=1"])


@pytest.mark.parametrize(("text", "value"), [("train.run_dir=my run #2", "my run #2"),
                                              ("data.source=#1", "#1"), ("train.max_steps=10 # ten", 10),
                                              ("train.run_dir='my run #2'", "my run #2")])
def test_a_hash_in_a_set_value_is_text_not_a_comment(text: str, value: object) -> None:
    """`--set "train.run_dir=my run #2"` made the run 'my run'."""
    assert parse_override(text)[2] == value


@pytest.mark.parametrize("setting", ["model.encoder_layers=99999999999999999999999", "model.d_model=200000",
                                     "model.max_positions=99999999999999999999999", "data.vocab_size=99999999999",
                                     "train.num_threads=100000"])
def test_sizes_past_any_model_are_refused_in_one_line(tmp_path: Path, setting: str) -> None:
    """They built layers for hours, overflowed, or ran out of memory in a traceback."""
    with pytest.raises(ConfigError, match=rf"{re.escape(setting.split('=')[0])} must be"):
        load_config(write(tmp_path, MINIMAL), [setting])


@pytest.mark.parametrize("langs", [["en"], [], ["en", "de", "fr"]])
def test_a_corpus_of_other_than_two_languages_is_one_line(langs: list[str]) -> None:
    """langs: [en] was an IndexError traceback (the language defaults ran first); [] was taken
    for the default direction, unsaid."""
    raw = {"data": {"name": "x", "src_lang": "en", "tgt_lang": "de", "sources": [{"source": "a", "langs": langs}]}}
    with pytest.raises(ConfigError, match=rf"data.sources\[0\].langs must be two different languages "
                                          rf"\[source, target\], got {re.escape(str(langs))}$"):
        config_from_dict(raw)


@pytest.mark.parametrize(("sources", "message"), [
    ([{"source": "a", "langs": ["en", "de"]}, {"source": "b", "langs": ["eng", "deu"]}],
     r"data.src_lang 'en' and data.sources\[1\].langs 'eng' are one language written two ways \(en\)"),
    ([{"source": "a", "langs": ["en", "de"]}, {"source": "b", "langs": ["en", "ger"]}],
     r"data.tgt_lang 'de' and data.sources\[1\].langs 'ger' are one language written two ways \(de\)"),
    ([{"source": "a", "langs": ["en", "de"]}, {"source": "b", "langs": ["fr", "en"]}, {"source": "c", "langs": ["en", "fra_Latn"]}],
     r"data.sources\[1\].langs 'fr' and data.sources\[2\].langs 'fra_Latn' are one language written two ways \(fr\)"),
])
def test_one_language_written_two_ways_is_refused(sources: list, message: str) -> None:
    """German as de in one corpus and deu in another was two target languages, <2de> and <2deu>,
    its pairs split between them, without a word."""
    raw = {"data": {"name": "x", "src_lang": "en", "tgt_lang": "de", "sources": sources}}
    with pytest.raises(ConfigError, match=message + ": a model keeps each code apart .*; write it one way$"):
        config_from_dict(raw)


def test_regions_and_scripts_that_say_something_are_other_languages() -> None:
    raw = {"data": {"name": "x", "src_lang": "en", "tgt_lang": "pt", "sources": [
        {"source": "a", "langs": ["en", "pt"]}, {"source": "b", "langs": ["en", "pt-BR"]},
        {"source": "c", "langs": ["en", "zh-TW"]}, {"source": "d", "langs": ["en", "zh-CN"]},
        {"source": "e", "langs": ["en", "sr-Latn"]}, {"source": "f", "langs": ["en", "sr-Cyrl"]}]}}
    assert len(config_from_dict(raw).data.corpora()) == 6


def test_a_value_of_shared_references_is_quoted_short_and_a_deep_one_refused(tmp_path: Path) -> None:
    """A 600-byte YAML of aliases took all memory: its type error quoted the value in full. A
    value nested past Python's limit was a RecursionError traceback."""
    from mtcli.checkpoint import architecture_mismatches

    parts = ["&a0 [x, x, x, x, x, x, x, x, x]"] + [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 7)]
    toy = (REPO / "configs" / "toy.yaml").read_text(encoding="utf-8")
    assert "  beam_size: 2\n" in toy
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(toy.replace("  beam_size: 2\n", "  beam_size: [" + ", ".join(parts) + "]\n"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"key 'decode.beam_size' must be int, got \[\[") as caught:
        load_config(bomb)
    assert len(str(caught.value)) < 300
    deep = tmp_path / "deep.yaml"
    deep.write_text(toy.replace("  beam_size: 2\n", "  beam_size: " + "[" * 20000 + "]" * 20000 + "\n"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"deep.yaml: nested too deeply to be a config$"):
        load_config(deep)
    nested: list = ["x"] * 9
    for _ in range(6):
        nested = [nested] * 9
    (key, saved, ours), = architecture_mismatches({"d_model": nested}, {"d_model": 64})
    assert (key, ours) == ("d_model", 64) and len(saved) <= 120


def test_numbers_are_yaml_1_2s_and_yaml_1_1s_octal_and_base_60_stay_text() -> None:
    """train.seed=0042 was seed 34 (octal), max_minutes 1:30 was 90, data.name 007 was '7'; yet
    beam_size=08 (no octal) was refused: YAML 1.1's numbers, where mtcli reads 1.2's booleans."""
    from mtcli.yamlfile import load_yaml

    assert load_yaml("[42, -3, +7, 0, 0o17, 0x10, 1.5, -.5, 1e-3, 2E+2, 0042, 08, '1:30', 1:30, 1_000]") == \
        [42, -3, 7, 0, 15, 16, 1.5, -0.5, 0.001, 200.0, "0042", "08", "1:30", "1:30", "1_000"]
    with pytest.raises(ConfigError, match=r"key 'train.seed' must be int, got '0042'"):
        load_config(REPO / "configs" / "toy.yaml", ["train.seed=0042"])
    with pytest.raises(ConfigError, match=r"key 'train.max_minutes' must be (float|number).*got '1:30'"):
        load_config(REPO / "configs" / "toy.yaml", ["train.max_minutes=1:30"])
    assert load_config(REPO / "configs" / "toy.yaml", ["data.name=007", "train.lr_factor=5e-1"]).data.name == "007"


def test_an_unknown_key_points_to_the_key_meant() -> None:
    """A key under the wrong section, or misspelt, got the section's forty names and no pointer."""
    for change, meant in (("train.vocab_size=100", "data.vocab_size"), ("train.max_step=3", "train.max_steps"),
                          ("decode.beam=4", "decode.beam_size")):
        with pytest.raises(ConfigError, match=rf"unknown key '{change.split('=')[0]}'; did you mean {meant}\? \(known"):
            config_from_dict(MINIMAL, overrides=[change])
    with pytest.raises(ConfigError, match=r"unknown key 'train.zzz' \(known keys: run_dir, "):
        config_from_dict(MINIMAL, overrides=["train.zzz=1"])


def test_a_set_value_that_is_yaml_syntax_alone_is_its_text() -> None:
    """`--set train.run_dir=&x` was an anchor of nothing, null: the default run directory, unsaid."""
    toy = REPO / "configs" / "toy.yaml"
    assert load_config(toy, ["train.run_dir=&x"]).train.run_dir == "&x"
    assert load_config(toy, ["train.init_from=null"]).train.init_from is None
    assert load_config(toy, ["train.init_from=~"]).train.init_from is None


def test_the_readmes_table_of_languages_says_what_the_code_does() -> None:
    """Each row's codes: how cleaning counts them, BLEU's tokeniser, and the SentencePiece
    defaults of a config with such a target (the table was written by hand beside the code)."""
    from mtcli.languages import (
        default_character_coverage,
        default_normalization,
        measured_in_characters,
    )
    from mtcli.metrics import BLEU_TOKENIZERS, language_code

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (.+?) \| (words|characters) \| `([\w-]+)`.*? \| `(\w+)` \| ([\d.]+) \|$", readme, re.M)
    assert len(rows) == 7, rows
    for languages, unit, tokenizer, normalization, coverage in rows:
        codes = re.findall(r"`(\w+)`", languages) or ["de", "pt", "sw"]  # (any other)
        for code in codes:
            assert measured_in_characters(code) == (unit == "characters"), code
            assert BLEU_TOKENIZERS.get(language_code(code), "13a") == tokenizer, code
            assert default_normalization(["en", code]) == normalization, code
            assert default_character_coverage(["en", code]) == float(coverage), code


@pytest.mark.parametrize(("key", "said"), [("1", "data.1"), ("null", "data.None"), ("1.5", "data.1.5")])
def test_a_key_yaml_reads_as_no_text_is_an_unknown_key(tmp_path: Path, key: str, said: str) -> None:
    """``1: foo`` under data was a TypeError traceback (the spelling suggestion took the key for text)."""
    path = write(tmp_path, "data:\n  name: x\n  source: somewhere\n  src_lang: de\n  tgt_lang: en\n"
                           f"  {key}: foo\n")
    assert f"unknown key '{said}'" in cli_error(path)
    sources = write(tmp_path, "data:\n  name: x\n  sources:\n    - source: somewhere\n      true: 3\n", "s.yaml")
    assert "unknown key 'data.sources[0].True'" in cli_error(sources)


def test_a_config_of_dash_points_to_dev_stdin() -> None:
    """`mtcli prepare -` said only "-: config file not found", where translate reads - as stdin."""
    assert cli_error(Path("-")).endswith("-: config file not found; a config on standard input is given as "
                                         "/dev/stdin (with a data.name)")
