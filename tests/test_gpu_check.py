"""bench/gpu_check.sh, the one script a lent GPU runs (issue 56's figures), checked on the CPU:
a GPU is lent to few sessions for minutes, so a variant renamed or an option gone in
bench/bench_train.py must show here, not on the device."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, bench_script

SCRIPT = (REPO / "bench" / "gpu_check.sh").read_text(encoding="utf-8")


def test_gpu_check_names_only_variants_and_options_bench_train_has() -> None:
    variants = set(re.findall(r"(?<![\w-])((?:ours|reference|torch-nn)-[\w-]+)", SCRIPT.split("set -euo pipefail")[1]))
    assert variants and variants <= set(bench_script("bench_train").VARIANTS), sorted(variants)
    helped = subprocess.run([sys.executable, str(REPO / "bench" / "bench_train.py"), "--help"], capture_output=True,
                            text=True, check=True).stdout
    known = set(re.findall(r"(--[a-z][\w-]*)", helped))
    given = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", SCRIPT.split("set -euo pipefail")[1]))
    assert given - {"--set", "--query-gpu", "--format"} <= known, sorted(given - known)


@pytest.mark.slow
def test_the_gpu_rows_are_written_on_a_cpu_in_the_smoke_shape(tmp_path: Path) -> None:
    """The rows the issue's check reads (variant, device, tokens_per_s, mfu, peak_mem_gb), from
    the variants that run on a CPU: about two minutes on two cores."""
    rows_path = tmp_path / "gpu_train.json"
    subprocess.run([sys.executable, str(REPO / "bench" / "bench_train.py"), "--device", "cpu", "--synthetic", "--smoke",
                    "--variants", "ours-bf16", "reference-bf16-eager", "ours-bf16-packed-graphs", "--pack-length", "64",
                    "--output", str(tmp_path / "tables.json"), "--gpu-json", str(rows_path), "--worker-timeout", "300"],
                   check=True, cwd=REPO, capture_output=True)
    rows = json.loads(rows_path.read_text(encoding="utf-8"))["rows"]
    assert [r["variant"] for r in rows] == ["ours-bf16", "reference-bf16-eager", "ours-bf16-packed-graphs"]
    for row in rows:
        assert {"variant", "device", "tokens_per_s", "mfu", "peak_mem_gb", "vs_reference"} <= set(row)
        assert row["tokens_per_s"] > 0 and row["peak_mem_gb"] > 0


def test_every_step_asked_for_is_timed_however_few_batches_the_corpus_makes(tmp_path: Path) -> None:
    """The synthetic corpus made 36 batches of gpu_check.sh's 25,000 tokens, so its 12 + 30 steps
    timed 24 (22 packed), and a warm-up past the batches divided by zero. The batches now come
    round again from the first."""
    import argparse

    import torch

    bench = bench_script("bench_train")
    args = argparse.Namespace(warmup=5, steps=3, prepared=tmp_path / "none", synthetic=True, smoke=False, vocab=500,
                              mean_length=28.0, max_tokens=150_000, pack_length=128, static_length=32)
    info = bench.build_batches(args, tmp_path / "batches.pt")
    assert info["batches"] == 8 and 0 < info["padding_timed_batches"] < 1
    data = torch.load(tmp_path / "batches.pt", weights_only=True)
    bench.fixed_shape_batches(args, data, True, 500)
    assert len(data["src"]) == 8 and {tuple(s.shape) for s in data["src"]} == {(150_000 // 128, 128)}
