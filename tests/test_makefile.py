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
    make(tmp_path, "reproduce", "DATA=", "SEEDS=3", f"REPRODUCE_ARGS={toy_args(tmp_path)}")
    rows = json.loads((tmp_path / "results" / "multi30k.json").read_text(encoding="utf-8"))
    assert sorted(rows) == ["de-en", "en-de"]
    assert all(row["train_steps"] == 20 and row["bleu_signature"].startswith("nrefs:1") for row in rows.values())
    assert all(list(row["seeds"]) == ["3"] for row in rows.values())
    assert (tmp_path / "data" / "runs" / "toy-seed3" / "checkpoints").is_dir()
    assert (tmp_path / "results" / "multi30k.md").is_file()


def test_make_reproduce_wmt_news_writes_its_own_table(tmp_path: Path) -> None:
    make(tmp_path, "reproduce-wmt-news", f"REPRODUCE_ARGS={toy_args(tmp_path)}")
    assert "en-de" in json.loads((tmp_path / "results" / "wmt_news.json").read_text(encoding="utf-8"))
    assert not (tmp_path / "results" / "multi30k.json").exists()


def test_make_clean_removes_caches_and_keeps_data(tmp_path: Path) -> None:
    for name in (".pytest_cache", ".ruff_cache", "build", "mtcli.egg-info", "data/runs"):
        (tmp_path / name).mkdir(parents=True)
    make(tmp_path, "clean")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
