"""Every Makefile target runs: setup, lint and test in CI (.ci/run); the reproduce targets and
clean here, on the toy recipe in a scratch directory (the real targets train for an hour)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TOY_CONFIG

BIN = Path(sys.executable).parent


def make(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(["make", "-f", str(REPO / "Makefile"), f"BIN={BIN}", *args], cwd=cwd,
                            capture_output=True, text=True, env={"PATH": f"{BIN}:/usr/bin:/bin",
                                                                "PYTHONPATH": str(REPO),
                                                                "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


def toy_args(tmp_path: Path) -> str:
    return " ".join([
        f"--config {TOY_CONFIG}", f"--results {tmp_path / 'results'}", f"--readme {tmp_path / 'README.md'}",
        f"--set data.source={REPO / 'tests' / 'fixtures' / 'toy'}", "--set train.max_steps=20",
        "--set train.valid_every=10", "--set train.num_threads=1",
    ])


def test_make_reproduce_runs_both_directions(tmp_path: Path) -> None:
    """`make reproduce` is the two directions' targets, each the pipeline's command with the
    seeds, data and arguments given (one such target runs for real in the next test; the
    pipeline writing both rows into one table is tests/test_reproduce.py's)."""
    commands = make(tmp_path, "-n", "reproduce", "DATA=/d", "SEEDS=3", "REPRODUCE_ARGS=--set x=1").stdout
    assert commands.splitlines() == [f'{BIN}/python -m mtcli reproduce {direction} --data "/d" --seeds "3" --set x=1'
                                     for direction in ("de_en", "en_de")]


def test_make_reproduce_of_another_pair_writes_its_own_row(tmp_path: Path) -> None:
    """reproduce-en-fr: the en-de recipe with the pair's languages, its own cache and run
    directory, and a row of its own beside the others."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split in ("train", "val", "test"):  # the toy corpus, its sides named en and fr
        for side, lang in (("src", "en"), ("tgt", "fr")):
            shutil.copy(REPO / "tests" / "fixtures" / "toy" / f"{split}.{side}", corpus / f"{split}.{lang}")
    args = toy_args(tmp_path).replace(f"data.source={REPO / 'tests' / 'fixtures' / 'toy'}", f"data.source={corpus}")
    make(tmp_path, "reproduce-en-fr", "DATA=", "SEEDS=3", f"REPRODUCE_ARGS={args}")
    rows = json.loads((tmp_path / "results" / "multi30k.json").read_text(encoding="utf-8"))
    assert list(rows) == ["en-fr"] and list(rows["en-fr"]["seeds"]) == ["3"]
    assert (tmp_path / "data" / "runs" / "multi30k_en_fr-seed3" / "checkpoints").is_dir()
    assert "| en-fr |" in (tmp_path / "results" / "multi30k.md").read_text(encoding="utf-8")


def test_make_reproduce_wmt_news_then_adapt(tmp_path: Path) -> None:
    """reproduce-wmt-news writes its own table (not the Multi30k one). Its toy run is then the
    parent: the adapted run starts from it with its SentencePiece model and adds (a) parent /
    (b) from scratch / (c) adapted to the table."""
    make(tmp_path, "reproduce-wmt-news", f"REPRODUCE_ARGS={toy_args(tmp_path)}")
    assert "en-de" in json.loads((tmp_path / "results" / "wmt_news.json").read_text(encoding="utf-8"))
    assert not (tmp_path / "results" / "multi30k.json").exists()
    parent = tmp_path / "data" / "runs" / "toy"
    child = " ".join([
        f"--set train.init_from={parent}", "--set train.init_average=2", f"--set data.spm_model={parent}",
        "--set data.name=toy_adapt", f"--set train.run_dir={tmp_path / 'data' / 'runs' / 'toy-adapt'}",
        "--set train.lr_schedule=constant", "--set train.lr=0.0005", "--set train.lr_factor=1",
    ])
    make(tmp_path, "reproduce-wmt-news-adapt", f"REPRODUCE_ARGS={toy_args(tmp_path)} {child}")
    rows = json.loads((tmp_path / "results" / "wmt_news.json").read_text(encoding="utf-8"))
    assert sorted(rows) == ["en-de", "en-de adapted"]
    adapted = rows["en-de adapted"]
    assert adapted["parent"]["run_dir"] == str(parent) and adapted["parent"]["step"] == 20
    assert adapted["train_steps"] == 20 and adapted["own_scores_after"]["sentences"] == 40
    # the parent decoded as it is on the child's test set is the parent's own test set here
    assert adapted["parent"]["scores"]["bleu"] == adapted["parent"]["own_scores"]["bleu"]
    assert json.loads((tmp_path / "data" / "runs" / "toy-adapt" / "parent.json").read_text())["average"] == 2
    table = (tmp_path / "results" / "wmt_news.md").read_text(encoding="utf-8")
    assert "(a) parent, as it is" in table and "(c) parent adapted to news" in table
    assert (f"Signatures of (a) and of the parent's test set: BLEU `{adapted['bleu_signature']}`; "
            f"chrF `{adapted['chrf_signature']}`; lowercased BLEU `{adapted['bleu_lc_signature']}`.") in table


def test_make_clean_removes_caches_and_keeps_data(tmp_path: Path) -> None:
    for name in (".pytest_cache", ".ruff_cache", ".hypothesis", "build", "mtcli.egg-info", "data/runs",
                 "mtcli/__pycache__", ".venv/lib/__pycache__"):
        (tmp_path / name).mkdir(parents=True)
    make(tmp_path, "clean")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".venv", "data", "mtcli"]
    assert not (tmp_path / "mtcli" / "__pycache__").exists() and (tmp_path / ".venv" / "lib" / "__pycache__").exists()


def test_data_reaches_every_multi30k_pipeline(tmp_path: Path) -> None:
    """DATA=DIR reached reproduce and the pairs but not reproduce-multilingual or reproduce-bt,
    which went to the network for Multi30k instead."""
    for target, passed in (("reproduce-de-en", '--data "/d"'), ("reproduce-en-fr", '--data "/d"'),
                           ("reproduce-multilingual", '--data "/d"'), ("reproduce-bt", '--set "data.source=/d"')):
        assert passed in make(tmp_path, "-n", target, "DATA=/d").stdout, target


def test_a_bare_make_helps_and_a_missing_python_or_a_misplaced_data_are_said(tmp_path: Path) -> None:
    """A bare `make` ran setup (a CUDA torch of several GB); with no .venv (mtcli installed
    without make) every target failed "No such file or directory"; DATA given to the WMT target
    was dropped, and a DATA or SEEDS with a space split into other arguments."""
    assert "make setup       create .venv" in make(tmp_path).stdout
    missing = subprocess.run(["make", "-f", str(REPO / "Makefile"), "BIN=/nowhere", "test"], cwd=tmp_path,
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "/nowhere/python not found: run make setup, or give the bin directory" \
        in missing.stderr
    wmt = subprocess.run(["make", "-f", str(REPO / "Makefile"), f"BIN={BIN}", "-n", "reproduce-wmt-news", "DATA=/d"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert wmt.returncode != 0 and "DATA is Multi30k's directory" in wmt.stderr
    spaced = make(tmp_path, "-n", "reproduce-de-en", "DATA=/my data", "SEEDS=1, 2").stdout
    assert '--data "/my data" --seeds "1, 2"' in spaced
