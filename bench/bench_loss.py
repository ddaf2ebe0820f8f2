"""Loss speed: forward + backward of the training losses over one R-Drop batch's logits.

Times, on random logits of the en-de recipe's shape (``--rows`` target positions a pass,
``--vocab`` output pieces, the German-piece softmax), each stacked twice as R-Drop runs them:

* ``cross_entropy``: :class:`mtcli.train.loss.LabelSmoothedLoss` over both passes ([2N, V]);
* ``symmetric_kl_autograd``: R-Drop's KL written with autograd through ``log_softmax``
  (:func:`mtcli.train.loss.reference_symmetric_kl`, the autograd formula);
* ``symmetric_kl_fused``: the one-sweep KL with its closed-form gradient that training runs
  (called through :func:`mtcli.train.loss.symmetric_kl`, which first stacks the two halves: one copy
  that training's stacked logits do not need);
* ``rdrop_loss_autograd_kl``: the cross entropy plus the autograd KL (R-Drop's loss before);
* ``rdrop_loss``: :func:`mtcli.train.rdrop.rdrop_loss`, the cross entropy plus the fused KL, as one
  training step runs them now.

Each is warmed up, then timed over ``--reps`` calls (median ms); peak RSS is not reported
because all four share one process (bench/bench_train.py measures a whole step's). Freed memory is
kept in the process, as in training (:mod:`mtcli.allocator`; ``MTCLI_KEEP_FREED_MEMORY=0`` times
the losses in fresh pages, where page faults make every pass several times slower).

Usage (from the repository root)::

    python bench/bench_loss.py                       # bf16 logits, 2 threads
    python bench/bench_loss.py --dtype float32 --rows 1900 --vocab 5484 --threads 2

Results: a table on stdout and ``bench/results/loss_<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def time_ms(fn: Callable[[], None], warmup: int, reps: int) -> float:
    """Median wall-clock milliseconds of ``fn`` over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1900, help="target positions per pass (default: %(default)s)")
    parser.add_argument("--vocab", type=int, default=5484, help="output pieces (default: %(default)s)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="logits dtype (bf16: what autocast training produces)")
    parser.add_argument("--scale", type=float, default=2.0,
                        help="logits ~ scale * N(0, 1); 15 puts most log-probabilities below -80, as a "
                             "model trained without label smoothing does (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    import torch

    from mtcli.allocator import keep_freed_memory
    from mtcli.device import cpu_name
    from mtcli.train.loss import LabelSmoothedLoss
    from mtcli.train.rdrop import rdrop_loss, reference_symmetric_kl, symmetric_kl

    torch.set_num_threads(args.threads)
    kept = keep_freed_memory()  # as training does: without it, page faults on fresh memory dominate
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    logits = (args.scale * torch.randn(2, args.rows, args.vocab)).to(dtype).requires_grad_()
    target = torch.randint(1, args.vocab, (1, args.rows))
    keep = torch.ones(1, args.rows, dtype=torch.bool)
    criterion = LabelSmoothedLoss(0.1)

    def first() -> torch.Tensor:
        return logits[:1]

    def second() -> torch.Tensor:
        return logits[1:]

    cases: dict[str, Callable[[], torch.Tensor]] = {
        "cross_entropy": lambda: criterion(logits, torch.cat([target, target])).loss,
        "symmetric_kl_autograd": lambda: reference_symmetric_kl(first(), second(), keep),
        "symmetric_kl_fused": lambda: symmetric_kl(first(), second(), keep),
        "rdrop_loss_autograd_kl": lambda: 0.5 * (criterion(logits, torch.cat([target, target])).loss
                                                 + 5.0 * reference_symmetric_kl(first(), second(), keep)),
        "rdrop_loss": lambda: rdrop_loss(criterion, logits, target, 5.0)[0],
    }
    rows = []
    for name, loss in cases.items():
        def step(loss: Callable[[], torch.Tensor] = loss) -> None:
            logits.grad = None
            loss().backward()

        ms = time_ms(step, args.warmup, args.reps)
        rows.append({"loss": name, "ms": round(ms, 2)})
        print(f"  {name:24s} {ms:8.1f} ms", flush=True)
    result = {"device": f"{cpu_name()}", "threads": args.threads, "freed_memory_kept": kept, "dtype": args.dtype,
              "rows_per_pass": args.rows, "scale": args.scale, "vocab": args.vocab, "torch": torch.__version__, "results": rows}
    out = args.output or REPO / "bench" / "results" / f"loss_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
