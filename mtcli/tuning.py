"""Choices a pipeline makes on the validation split, never the test split: how many of a run's
last step checkpoints to average (:func:`choose_average`), and the GNMT length penalty alpha
(:func:`search_length_penalty`, :func:`choose_length_penalty`). The test split is decoded once,
afterwards, with what was chosen."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mtcli.evaluate import evaluate
from mtcli.infer.averaging import average_run_checkpoints
from mtcli.rundir import step_checkpoints

# the averaging window k is chosen on val among 1..min(AVERAGE_LAST, train.keep_last)
AVERAGE_LAST = 10
# GNMT length-penalty alphas tried on val with the chosen average (the recipe's own is added);
# while the best is at an edge of what was tried, the grid goes one more step that way, within
# the bounds
LENGTH_PENALTIES = (0.6, 1.0, 1.4)
LENGTH_PENALTY_STEP = 0.4
LENGTH_PENALTY_BOUNDS = (0.2, 2.6)


def choose_average(run_dir: Path, valid_split: str, max_k: int,
                   score: Callable[[Path, int], float] | None = None) -> tuple[Path, list[Path], dict[str, float]]:
    """Average the last k step checkpoints for k = 1..max_k and keep the k with the best
    validation BLEU (beam search as in the run's ``decode`` section); ``score(checkpoint, k)``,
    when given, is the validation BLEU instead (a multilingual run's mean over its directions).

    The averaging window is a tuning choice, so it is made on the validation split; the test
    split is decoded once, afterwards, with the chosen average. Returns the chosen averaged
    checkpoint, the checkpoints in it, and validation BLEU by k (keys ``"1"``..``"max_k"``).
    """
    scores: dict[str, float] = {}
    best: tuple[float, Path, list[Path]] | None = None
    for k in range(1, max(1, min(max_k, len(step_checkpoints(run_dir)))) + 1):
        path = run_dir / "checkpoints" / f"checkpoint_avg_last{k}.pt"
        used = average_run_checkpoints(run_dir, path, last=k)
        bleu = score(path, k) if score is not None else evaluate(run_dir, split=valid_split, checkpoint=str(path))["bleu"]
        scores[str(k)] = round(float(bleu), 2)
        if best is None or scores[str(k)] > best[0]:  # ties go to the smaller window
            best = (scores[str(k)], path, used)
    assert best is not None
    for k in scores:  # keep only the chosen average on disk (each is a full model)
        path = run_dir / "checkpoints" / f"checkpoint_avg_last{k}.pt"
        if path != best[1]:
            path.unlink(missing_ok=True)
    return best[1], best[2], scores


def search_length_penalty(score: Callable[[float], float], recipe_alpha: float,
                          recipe_score: float | None = None) -> tuple[float, dict[str, float]]:
    """Try the alphas of :data:`LENGTH_PENALTIES` and the recipe's, then step outwards by
    :data:`LENGTH_PENALTY_STEP` while the best is at the edge of those tried (within
    :data:`LENGTH_PENALTY_BOUNDS`); ``score(alpha)`` is val BLEU. Ties go to the recipe's value,
    then the smaller alpha. Returns the best alpha and the scores by alpha (keys as ``"1.0"``).
    """
    recipe = float(recipe_alpha)
    scores: dict[float, float] = {} if recipe_score is None else {recipe: recipe_score}
    for alpha in sorted({recipe, *LENGTH_PENALTIES}):
        if alpha not in scores:
            scores[alpha] = score(alpha)
    low, high = LENGTH_PENALTY_BOUNDS
    while True:
        best = max(scores, key=lambda a: (scores[a], a == recipe, -a))
        if best == max(scores) and best + LENGTH_PENALTY_STEP <= high + 1e-9:
            step = round(best + LENGTH_PENALTY_STEP, 2)
        elif best == min(scores) and best - LENGTH_PENALTY_STEP >= low - 1e-9:
            step = round(best - LENGTH_PENALTY_STEP, 2)
        else:
            return best, {str(a): s for a, s in scores.items()}
        scores[step] = score(step)


def choose_length_penalty(run_dir: Path, valid_split: str, checkpoint: Path, recipe_alpha: float,
                          recipe_score: float | None) -> tuple[float, dict[str, float]]:
    """Choose the GNMT alpha on val with :func:`search_length_penalty`.

    ``recipe_score`` is the checkpoint's val BLEU with the recipe's own alpha when it is already
    known (decoded while choosing the average), else None. Returns the chosen alpha and
    validation BLEU by alpha (keys as ``"1.0"``). The hypotheses of each try go to
    ``run_dir/eval/lp<alpha>/``.
    """

    def score(alpha: float) -> float:
        report = evaluate(run_dir, split=valid_split, checkpoint=str(checkpoint),
                          length_penalty=alpha,
                          output_dir=run_dir / "eval" / f"lp{alpha:g}")
        return round(float(report["bleu"]), 2)

    return search_length_penalty(score, recipe_alpha, recipe_score)
