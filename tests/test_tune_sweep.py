"""bench/tune_sweep.py: variant parsing and the summary it builds from the runs' files.

The sweep itself runs ``mtcli reproduce --valid-only`` per variant, which the
reproduce tests cover; here the runs' outputs are written by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import bench_script


@pytest.fixture(scope="module")
def sweep():
    return bench_script("tune_sweep")


def test_parse_variant(sweep) -> None:
    assert sweep.parse_variant("base=") == ("base", [])
    assert sweep.parse_variant("v6k=data.vocab_size=6000,data.name=x") == (
        "v6k", ["data.vocab_size=6000", "data.name=x"])
    for bad in ("=train.seed=2", "a b=train.seed=2", "x/y="):
        with pytest.raises(SystemExit, match="bad variant name"):
            sweep.parse_variant(bad)


def test_summary_rows_from_train_log_and_tuning_json(sweep, tmp_path: Path) -> None:
    done, failed = tmp_path / "done", tmp_path / "failed"
    done.mkdir()
    failed.mkdir()
    (done / "train.log").write_text(
        "2026-11-22 17:17:55 | INFO | valid step 200 | loss 5.6889 | nll 5.1250 | ppl 168.17 | bleu 4.55 | best\n"
        "2026-11-22 17:18:01 | INFO | step 300 | epoch 1 | loss 5.1 | nll 4.9 | ppl 130.2 | lr 1e-3\n"
        "2026-11-22 17:18:08 | INFO | valid step 400 | loss 4.6748 | nll 3.9595 | ppl 52.43 | bleu 8.46 | best\n",
        encoding="utf-8")
    (done / "tuning.json").write_text(json.dumps({"average_last": 2, "length_penalty": 1.4,
                                                  "valid_bleu": 40.54}), encoding="utf-8")
    (failed / "train.log").write_text(
        "2026-11-22 17:17:55 | INFO | valid step 200 | loss 5.7 | nll 5.1 | ppl 168.1 | bleu 3.10\n",
        encoding="utf-8")
    jobs = [{"name": "done", "variant": ["train.lr_factor=1.0"], "returncode": 0, "wall_s": 376.04},
            {"name": "failed", "variant": [], "returncode": -15, "wall_s": 12.0}]
    rows = sweep.summarise(tmp_path, jobs)
    assert rows["done"]["curve"] == [(200, 5.6889, 4.55), (400, 4.6748, 8.46)]  # train lines skipped
    assert rows["done"]["valid_bleu"] == 40.54 and "valid_bleu" not in rows["failed"]
    table = (tmp_path / "summary.md").read_text(encoding="utf-8").splitlines()
    assert table[2] == "| done | train.lr_factor=1.0 | 400 | 4.6748 | 8.46 | 2 / 1.4 | 40.54 | 376.0 |"
    assert table[3] == "| failed | - | 200 | 5.7 | 3.1 | - / - | failed (rc -15) | 12.0 |"
    assert json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))["done"]["valid_bleu"] == 40.54
