"""`mtcli train` on a large prepared corpus: start-up, memory by component, epoch boundary, resume.

For a recipe whose cache is prepared (e.g. the WMT14 base recipe on a corpus from
bench/make_wmt_corpus.py), in one process:

* **start-up**: seconds from this process's start to the end of the first optimiser step, and
  the part of it spent opening the cache (checksums verified) and building the trainer;
* **memory** (VmRSS): after the imports; with one model built (torch's start-up and the
  model); after building the trainer (the cache's memory maps, the batch stream's length arrays
  and the optimiser: what the corpus costs is this minus the previous, the model being built
  again in the memory the first one freed); the peak over ``--steps`` steps (activations and the
  optimiser's moments on top). Model and optimiser bytes are also counted from their tensors;
* **tokens/s** over the steps after the first;
* **data wait**: the part of each step spent taking the next batches from the stream, while the
  device waits (CPU and GPU alike);
* **on a GPU**: peak GPU memory, the FLOPs per target token of a step (torch's FlopCounterMode)
  and the rate they give, against a bf16 matrix product's rate measured in the same run;
* **epoch boundary**: the seconds to build one epoch's batch list (shuffle and token-budget
  batching over every pair), what the step that crosses an epoch pays;
* **exact resume** (``--resume-steps K``): K steps, stop, resume for K more in a new trainer,
  against 2K steps straight, in fresh run directories; the parameters must be bit-identical.

Usage (from the repository root)::

    python bench/bench_train_scale.py configs/wmt14_en_de_base.yaml --set data.source=/tmp/wmt45/text \\
        --set data.hub_config=null --set data.prepared_dir=/tmp/wmt45/prepared --steps 200
    python bench/bench_train_scale.py configs/toy.yaml --steps 5 --resume-steps 3        # smoke

Prints a table and writes ``bench/results/train_scale_<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from mtcli.config import load_config  # noqa: E402
from mtcli.data.freshness import open_prepared  # noqa: E402
from mtcli.device import resolve_device  # noqa: E402
from mtcli.model import Transformer  # noqa: E402
from mtcli.train import train  # noqa: E402
from mtcli.train.distributed import DistInfo  # noqa: E402
from mtcli.train.schedule import build_optimizer  # noqa: E402
from mtcli.train.trainer import Trainer  # noqa: E402


def rss_mb() -> float:
    """This process's resident set now (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def process_age() -> float:
    """Seconds since this process started (from /proc/self/stat and the boot clock)."""
    ticks = os.sysconf("SC_CLK_TCK")
    start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - start


def tensor_mb(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def measure(config, run_dir: Path, steps: int) -> dict:
    """Start-up, memory by component, tokens/s and the epoch boundary of one trainer."""
    out: dict = {"rss_after_imports_mb": rss_mb()}
    began = time.perf_counter()
    corpus = open_prepared(config)
    device = resolve_device(config.train.device, 0)
    if config.train.num_threads > 0:
        torch.set_num_threads(config.train.num_threads)
    out["open_cache_s"] = time.perf_counter() - began
    # a model and its optimiser alone first: torch's own start-up memory (building an optimiser
    # imports torch._dynamo) and the model's, apart from the corpus's
    start = time.perf_counter()
    probe = Transformer(config.model, corpus.vocab_size)
    build_optimizer(probe, config.train)
    out["torch_startup_s"] = time.perf_counter() - start
    out["model_mb"] = tensor_mb(probe.parameters())
    out["rss_with_a_model_mb"] = rss_mb()
    del probe
    start = time.perf_counter()
    trainer = Trainer(config, DistInfo.from_env(), device, corpus, run_dir)
    out["build_trainer_s"] = time.perf_counter() - start
    out["rss_after_setup_mb"] = rss_mb()
    out["corpus_mb"] = out["rss_after_setup_mb"] - out["rss_with_a_model_mb"]
    pairs = len(trainer.stream.indices)
    start = time.perf_counter()
    batches = trainer.stream.epoch_batches(0)  # the first epoch's list: what a boundary builds
    out["epoch_boundary_s"] = time.perf_counter() - start
    out.update(pairs=pairs, batches_per_epoch=len(batches), rss_with_epoch_list_mb=rss_mb())
    peak, tokens, timed, waited = out["rss_with_epoch_list_mb"], 0.0, 0.0, 0.0
    for step in range(steps):
        start = time.perf_counter()
        group, batches = trainer.feed.next()  # the data path (collated during the last step, after the first)
        fetched = time.perf_counter()
        counted = [*trainer.train_step(group, batches), trainer.settle()]  # counted now, to time it whole
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if step == 0:
            out["first_step_s"] = seconds
            out["command_to_first_step_s"] = process_age()
        elif any(counted):
            tokens += sum(stats["tokens"] for stats in counted if stats)
            timed += seconds
            waited += fetched - start
        peak = max(peak, rss_mb())
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    out.update(optimizer_mb=tensor_mb(state), peak_rss_mb=peak, rss_after_steps_mb=rss_mb(),
               tokens_per_s=tokens / timed if timed else float("nan"), steps=steps,
               data_wait_ms_per_step=1000 * waited / max(steps - 1, 1),
               data_wait_share=waited / timed if timed else float("nan"))
    if device.type == "cuda":
        out.update(gpu_efficiency(trainer, device, out["tokens_per_s"]))
    return out


def matmul_peak_tflops(device: torch.device, n: int = 8192, repeats: int = 10) -> float:
    """What this GPU's bf16 matrix product reaches here: an n x n x n product, timed."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def gpu_efficiency(trainer: Trainer, device: torch.device, tokens_per_s: float) -> dict:
    """Peak GPU memory, and the training FLOP rate against the bf16 matmul peak measured here.

    The FLOPs of one more step are counted by torch's FlopCounterMode (forward and backward
    matrix products and attention), per target token; times tokens/s that is the rate reached."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        counted = trainer.train_step(*trainer.feed.next())
        stats = trainer.settle() or (counted[-1] if counted else None)  # this step's
    per_token = counter.get_total_flops() / max(stats["tokens"] if stats else 1.0, 1.0)
    peak = matmul_peak_tflops(device)
    reached = per_token * tokens_per_s / 1e12
    return {"gpu": torch.cuda.get_device_name(device),
            "gpu_peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "train_flops_per_target_token": per_token, "train_tflops": reached,
            "bf16_matmul_peak_tflops": peak, "share_of_bf16_peak": reached / peak}


def exact_resume(config_path: str, overrides: list[str], work: Path, k: int) -> bool:
    """K steps + resume K more == 2K steps straight (bit-identical parameters)."""
    from mtcli.checkpoint import load_checkpoint

    # no cool-down: it counts back from train.max_steps, so a first half stopped by a smaller
    # max_steps would follow other rates than the straight run (a schedule change, not a resume)
    common = [*overrides, "train.valid_every=1000000", "train.valid_bleu=false", "train.progress=false",
              "train.cooldown_steps=0"]
    straight, halves = work / "straight", work / "halves"
    train(load_config(config_path, [*common, f"train.run_dir={straight}", f"train.max_steps={2 * k}"]))
    train(load_config(config_path, [*common, f"train.run_dir={halves}", f"train.max_steps={k}"]))
    train(load_config(config_path, [*common, f"train.run_dir={halves}", f"train.max_steps={2 * k}"]))
    a = load_checkpoint(straight / "checkpoints" / "checkpoint_last.pt")["model"]
    b = load_checkpoint(halves / "checkpoints" / "checkpoint_last.pt")["model"]
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--resume-steps", type=int, default=0, help="check exact resume with K + K steps")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_train_scale."))
    config = load_config(args.config, [*args.overrides, f"train.run_dir={work / 'run'}", "train.progress=false"])
    result = measure(config, work / "run", args.steps)
    if args.resume_steps:
        result["exact_resume"] = exact_resume(args.config, args.overrides, work, args.resume_steps)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    result.update(config=args.config, overrides=args.overrides, cpu=cpu, cores=os.cpu_count(),
                  device=str(resolve_device(config.train.device, 0)))
    for key, value in result.items():
        print(f"{key:28s} {value:.2f}" if isinstance(value, float) else f"{key:28s} {value}")
    out = REPO / "bench" / "results" / f"train_scale_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result.get("exact_resume", True) else 1


if __name__ == "__main__":
    sys.exit(main())
