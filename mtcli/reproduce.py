"""``make reproduce``: prepare -> train -> average checkpoints -> evaluate, then the BLEU table.

Run one direction with ``python -m mtcli.reproduce de_en [--data DIR]``. Results are merged into
``results/multi30k.json`` (one object per direction, keyed ``"de-en"`` / ``"en-de"``), rendered
to ``results/multi30k.md``, and that table replaces the block between the results markers in
README.md, so every number in the README comes from this command.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from mtcli.fileio import atomic_write

RESULTS_DIR = Path("results")
README = Path("README.md")
MARK_START, MARK_END = "<!-- results:start -->", "<!-- results:end -->"
RECIPES = {"de_en": "configs/multi30k_de_en.yaml", "en_de": "configs/multi30k_en_de.yaml"}
AVERAGE_LAST = 5


def git_commit() -> str:
    """Short hash of HEAD (with ``-dirty`` when the tree has changes), or ``unknown``."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def device_name(device: str) -> str:
    """Human-readable name of the device a run used."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    import os

    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU ({model}, {os.cpu_count()} cores)"


def render_markdown(results: dict[str, dict[str, Any]]) -> str:
    """The results table (one row per direction) and the sacreBLEU signatures below it."""
    lines = [
        "| direction | BLEU | BLEU (lc, 13a) | chrF | params | train min | train tok/s "
        "| decode sent/s | device | commit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(results):
        r = results[key]
        lines.append(
            f"| {key} | {r['bleu']:.2f} | {r['bleu_lc']:.2f} | {r['chrf']:.2f} "
            f"| {r['params'] / 1e6:.1f}M | {r['train_minutes']:.1f} | {r['train_tokens_per_s']:,.0f} "
            f"| {r['decode_sents_per_s']:.1f} | {r['device']} | {r['commit']} |"
        )
    lines.append("")
    for key in sorted(results):
        r = results[key]
        lines.append(f"- {key} {r.get('test_set', '')}, {r.get('decode', '')}:")
        lines.append(f"  BLEU `{r['bleu_signature']}`; chrF `{r['chrf_signature']}`;")
        lines.append(f"  lowercased BLEU `{r.get('bleu_lc_signature', '')}`")
    return "\n".join(lines) + "\n"


def write_results(results: dict[str, dict[str, Any]], results_dir: Path = RESULTS_DIR,
                  readme: Path = README) -> None:
    """Write ``multi30k.json`` and ``.md`` atomically and refresh the README's results block."""
    table = render_markdown(results)
    with atomic_write(results_dir / "multi30k.json") as handle:
        json.dump(results, handle, indent=2, sort_keys=True)
        handle.write("\n")
    with atomic_write(results_dir / "multi30k.md") as handle:
        handle.write(table)
    if readme.exists():
        text = readme.read_text(encoding="utf-8")
        if MARK_START in text and MARK_END in text:
            head, rest = text.split(MARK_START, 1)
            _, tail = rest.split(MARK_END, 1)
            with atomic_write(readme) as handle:
                handle.write(f"{head}{MARK_START}\n{table}{MARK_END}{tail}")


def load_results(results_dir: Path = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """Previously written results (empty when there are none)."""
    path = results_dir / "multi30k.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def run_recipe(config_path: str, data_dir: str | None, extra: list[str]) -> dict[str, Any]:
    """prepare -> train -> average the last checkpoints -> evaluate on the test split."""
    from mtcli.checkpoint import average_run_checkpoints, load_checkpoint
    from mtcli.config import load_config
    from mtcli.evaluate import evaluate
    from mtcli.model import count_parameters
    from mtcli.prepare import prepare
    from mtcli.train import train

    overrides = ([f"data.source={data_dir}"] if data_dir else []) + extra
    config = load_config(config_path, overrides)
    prepare(config)
    summary = train(config)
    run_dir = config.run_path()
    k = min(AVERAGE_LAST, config.train.keep_last)  # only keep_last step checkpoints are kept
    averaged = run_dir / "checkpoints" / f"checkpoint_avg_last{k}.pt"
    used = average_run_checkpoints(run_dir, averaged, last=k)
    split = config.data.test_splits[0]
    report = evaluate(run_dir, split=split, src_file=None, ref_file=None, checkpoint=str(averaged),
                      average_last=0, average_best=0, overrides=[], output_dir=None)
    state = load_checkpoint(run_dir / "checkpoints" / "checkpoint_last.pt")
    train_state = state.get("train_state", {})
    from mtcli.model import Transformer

    model = Transformer(config.model, state["vocab"]["size"])
    return {
        "bleu": report["bleu"],
        "bleu_signature": report["bleu_signature"],
        "bleu_lc": report["bleu_lc"],
        "bleu_lc_signature": report.get("bleu_lc_signature", ""),
        "chrf": report["chrf"],
        "chrf_signature": report["chrf_signature"],
        "params": count_parameters(model),
        "train_minutes": float(train_state.get("elapsed_seconds", 0.0)) / 60.0,
        "train_tokens_per_s": float(getattr(summary, "tokens_per_second", 0.0)),
        "train_steps": int(state.get("step", 0)),
        "decode_sents_per_s": float(report["sentences_per_second"]),
        "device": device_name(str(report.get("device", "cpu"))),
        "commit": git_commit(),
        "test_set": f"{split} ({report.get('sentences', '?')} sentences)",
        "decode": f"beam {config.decode.beam_size}, length penalty {config.decode.length_penalty}, "
                  f"average of {len(used)} checkpoints",
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry: ``python -m mtcli.reproduce {de_en,en_de} [--data DIR] [--set k=v]``."""
    from mtcli.errors import MtcliError
    from mtcli.logs import setup_logging

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("direction", choices=sorted(RECIPES))
    parser.add_argument("--data", default=None, help="directory of <split>.<lang> files")
    parser.add_argument("--config", default=None, help="recipe to run instead of the direction's")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="results directory")
    parser.add_argument("--readme", type=Path, default=README, help="README whose table to refresh")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="config override section.key=value (repeatable)")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        row = run_recipe(args.config or RECIPES[args.direction], args.data, args.overrides)
    except MtcliError as exc:
        print(f"mtcli: error: {exc}", file=sys.stderr)
        return exc.exit_code
    results = load_results(args.results)
    results[args.direction.replace("_", "-")] = row
    write_results(results, args.results, args.readme)
    print(render_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
