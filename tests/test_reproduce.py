"""The results table is rendered from results JSON and replaces the README's results block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TOY_CONFIG, TOY_DIR, mtcli_status

from mtcli.checkpoint import load_checkpoint, save_checkpoint
from mtcli.reproduce import combine_seeds, render_markdown, write_results
from mtcli.results import MARK_END, MARK_START, device_name
from mtcli.tuning import choose_average, search_length_penalty

ROW = {
    "bleu": 38.123, "bleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
    "bleu_lc": 40.5, "bleu_lc_signature": "nrefs:1|case:lc|eff:no|tok:13a|smooth:exp|version:2.6.0",
    "chrf": 60.25, "chrf_signature": "nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0",
    "params": 9_500_000, "train_minutes": 59.9, "train_tokens_per_s": 3210.4,
    "decode_sents_per_s": 101.2, "device": "CPU (x86_64, 2 cores)", "commit": "abc1234",
}


def main(argv: list[str]) -> int:
    """``mtcli reproduce ARGV`` in this process: its exit status; its output where capsys reads it."""
    return mtcli_status("reproduce", *argv)


def test_render_has_a_row_per_direction_and_signatures() -> None:
    text = render_markdown({"en-de": ROW, "de-en": dict(ROW, bleu=41.0)})
    rows = [line for line in text.splitlines() if line.startswith("| de-en") or line.startswith("| en-de")]
    assert rows[0].startswith("| de-en | 40.50 | – | – | 41.00 | 60.25 | 9.5M | ? | 59.9 | 3,210 | 101.2")
    assert rows[1].startswith("| en-de | 40.50 | – | – | 38.12")
    assert ROW["bleu_signature"] in text and ROW["chrf_signature"] in text


def seed_row(seed: int, device: str, tokens_per_s: float) -> dict:
    """One seed's row as ``run_recipe`` returns it."""
    return dict(ROW, seed=seed, device=device, train_tokens_per_s=tokens_per_s, train_steps=8000,
                average_last=1, length_penalty=1.0, decode="beam 5, length penalty 1")


def test_seeds_on_one_machine_show_their_mean_speed() -> None:
    row = combine_seeds({s: seed_row(s, "CPU (x86_64, 2 cores)", 1000.0 * s) for s in (1, 2, 3)})
    line = render_markdown({"en-de": row}).splitlines()[2]
    assert "| 59.9 | 2,000 | 101.2 | CPU (x86_64, 2 cores) |" in line


def test_a_seeds_row_shows_the_mean_the_sample_sd_and_each_seed_to_two_places() -> None:
    rows = {s: dict(seed_row(s, "CPU (x86_64, 2 cores)", 1000.0), bleu_lc=bleu) for s, bleu in ((1, 40.0), (2, 41.0),
                                                                                                   (3, 42.5))}
    row = combine_seeds(rows)
    assert row["bleu_lc"] == pytest.approx(41.1666667) and row["bleu_lc_std"] == pytest.approx(1.2583057)  # n - 1
    line = render_markdown({"en-de": row}).splitlines()[2]
    assert line.startswith("| en-de | 41.17 | 1.26 | 40.00 / 41.00 / 42.50 | 38.12 | 60.25 |"), line


def test_seeds_on_different_machines_show_each_seeds_speed() -> None:
    """A mean of two machines' speeds is no speed figure: the row gives each seed's, and names
    which seeds ran where."""
    rows = {1: seed_row(1, "CPU (A)", 1000.0), 2: seed_row(2, "CPU (B)", 2500.0), 3: seed_row(3, "CPU (B)", 2600.0)}
    line = render_markdown({"en-de": combine_seeds(rows)}).splitlines()[2]
    assert "| 59.9 / 59.9 / 59.9 | 1,000 / 2,500 / 2,600 | 101.2 / 101.2 / 101.2 " in line
    assert "| CPU (A) (seed 1) / CPU (B) (seeds 2, 3) |" in line


def test_write_results_updates_json_md_and_readme(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{MARK_START}\nold table\n{MARK_END}\n\nafter\n", encoding="utf-8")
    write_results({"de-en": ROW}, results_dir=tmp_path / "results", readme=readme)
    data = json.loads((tmp_path / "results" / "multi30k.json").read_text())
    assert data["de-en"]["bleu"] == ROW["bleu"]
    md = (tmp_path / "results" / "multi30k.md").read_text()
    text = readme.read_text()
    assert "old table" not in text and md in text and text.endswith("after\n")


def test_reproduce_pipeline_on_toy(tmp_path: Path, toy_config_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare -> train -> average -> evaluate end to end, writing results and the README table;
    run again, the finished run's row is kept (nothing decoded again) while its checkpoints
    and config are those it was scored from."""
    import os

    import mtcli.reproduce
    import mtcli.tuning

    readme = tmp_path / "README.md"
    readme.write_text(f"{MARK_START}\n{MARK_END}\n", encoding="utf-8")
    argv = [
        "de_en", "--config", str(toy_config_path), "--results", str(tmp_path / "results"),
        "--readme", str(readme),
        "--set", f"data.prepared_dir={tmp_path / 'prep'}", "--set", f"train.run_dir={tmp_path / 'run'}",
        "--set", "train.max_steps=40", "--set", "train.valid_every=10",
    ]
    code = main(argv)
    assert code == 0
    first = (tmp_path / "results" / "multi30k.json").read_text()
    decoded: list[str] = []
    scores = mtcli.reproduce.evaluate
    for module in (mtcli.reproduce, mtcli.tuning):  # the test split's decodes, and val's (average, alpha)
        monkeypatch.setattr(module, "evaluate", lambda *a, **k: decoded.append(k["split"]) or scores(*a, **k))
    averages = sorted((tmp_path / "run" / "checkpoints").glob("checkpoint_avg_last*.pt"))
    for path in averages:  # (a full model each: a user may remove it; the adaptation decodes it)
        path.unlink()
    assert main(argv) == 0 and decoded == []  # (a rerun after an interruption in a later seed)
    assert (tmp_path / "results" / "multi30k.json").read_text() == first
    assert sorted((tmp_path / "run" / "checkpoints").glob("checkpoint_avg_last*.pt")) == averages  # made again
    assert main([*argv, "--set", "decode.max_len_b=40"]) == 0 and "test" in decoded  # decoded otherwise
    decoded.clear()
    step = tmp_path / "run" / "checkpoints" / "checkpoint_40.pt"
    os.utime(step, ns=(step.stat().st_atime_ns, step.stat().st_mtime_ns + 1))  # as a run trained anew
    assert main([*argv, "--set", "decode.max_len_b=40"]) == 0 and "test" in decoded
    row = json.loads((tmp_path / "results" / "multi30k.json").read_text())["de-en"]
    for key in ("bleu", "bleu_signature", "bleu_lc", "chrf", "params", "train_minutes",
                "train_tokens_per_s", "decode_sents_per_s", "device", "commit", "recipe", "data"):
        assert key in row
    assert len(row["data"]) == 16
    assert row["params"] > 0 and row["train_tokens_per_s"] > 0
    # keep_last=2 in the toy recipe: the averaging window is chosen on val among the last 1 and 2
    assert set(row["valid_bleu_by_average"]) == {"1", "2"}
    chosen = max(row["valid_bleu_by_average"], key=lambda k: row["valid_bleu_by_average"][k])
    assert f"average of the last {chosen} checkpoints (both chosen on val)" in row["decode"]
    # then the length penalty, on val with that average: the recipe's 1.0 and the grid
    by_alpha = row["valid_bleu_by_length_penalty"]
    assert {"0.6", "1.0", "1.4"} <= set(by_alpha)  # and a step outwards while the best is an edge
    alpha = max(sorted(by_alpha, key=lambda a: (a != "1.0", float(a))), key=lambda a: by_alpha[a])
    assert f", length penalty {float(alpha):g}, " in row["decode"]
    left = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("checkpoint_avg_last*.pt"))
    assert left == [f"checkpoint_avg_last{chosen}.pt"]
    assert (tmp_path / "run" / "learning_curves.png").exists()
    assert "| de-en |" in (tmp_path / "results" / "multi30k.md").read_text()
    assert "| de-en |" not in readme.read_text()  # another recipe than the README's: its table is left alone


def test_more_test_splits_get_rows_and_their_own_table(tmp_path: Path) -> None:
    """The WMT news recipe scores two test splits; its table goes to wmt_news.* and its README block."""
    from mtcli.results import markers

    more = {"newstest2014-filtered": {"bleu": 5.5, "bleu_lc": 6.25, "chrf": 30.0, "sentences": 2737,
                                      "decode_sents_per_s": 40.0}}
    start, end = markers("wmt_news")
    readme = tmp_path / "README.md"
    readme.write_text(f"{MARK_START}\nmulti30k\n{MARK_END}\n{start}\nold\n{end}\n", encoding="utf-8")
    write_results({"en-de": dict(ROW, more_tests=more)}, tmp_path / "results", readme, "wmt_news")
    md = (tmp_path / "results" / "wmt_news.md").read_text()
    assert "| en-de newstest2014-filtered | 6.25 | – | – | 5.50 | 30.00 | 9.5M" in md
    assert "| en-de | 40.50 | – | – | 38.12" in md
    text = readme.read_text()
    assert "multi30k" in text and "old" not in text and md in text
    assert not (tmp_path / "results" / "multi30k.json").exists()


def test_valid_only_tuning_run_never_decodes_test(tmp_path: Path, toy_config_path: Path, capsys) -> None:
    """--valid-only chooses on val, writes run_dir/tuning.json, and leaves test and the tables alone."""

    code = main([
        "de_en", "--config", str(toy_config_path), "--results", str(tmp_path / "results"),
        "--readme", str(tmp_path / "README.md"), "--valid-only",
        "--set", f"data.prepared_dir={tmp_path / 'prep'}", "--set", f"train.run_dir={tmp_path / 'run'}",
        "--set", "train.max_steps=20", "--set", "train.valid_every=10",
    ])
    assert code == 0
    row = json.loads((tmp_path / "run" / "tuning.json").read_text())
    assert json.loads(capsys.readouterr().out) == row
    assert row["train_steps"] == 20 and row["valid_split"] == "val"
    assert row["valid_bleu"] == row["valid_bleu_by_length_penalty"][str(row["length_penalty"])]
    assert set(row["valid_bleu_by_average"]) == {"1", "2"}
    assert not (tmp_path / "results").exists() and not (tmp_path / "README.md").exists()
    decoded = [p.name for p in (tmp_path / "run" / "eval").rglob("*") if p.is_file()]
    assert decoded and all("test" not in name for name in decoded), decoded


@pytest.mark.parametrize("has_units", [True, False])
def test_cpu_device_name_says_whether_it_has_bf16_units(monkeypatch: pytest.MonkeyPatch,
                                                        has_units: bool) -> None:
    import mtcli.results

    monkeypatch.setattr(mtcli.results, "cpu_has_bf16_units", lambda *args: has_units)
    name = device_name("cpu")
    assert name.startswith("CPU (") and name.endswith(")")
    assert ("bf16 units" in name) is has_units


@pytest.mark.parametrize(("peak", "recipe", "chosen", "tried"), [
    (1.0, 1.0, 1.0, ["0.6", "1.0", "1.4"]),                        # inside the grid: no more
    (1.8, 1.0, 1.8, ["0.6", "1.0", "1.4", "1.8", "2.2"]),          # top edge: up until it falls
    (3.0, 1.0, 2.6, ["0.6", "1.0", "1.4", "1.8", "2.2", "2.6"]),   # ... but not past the bound
    (0.0, 1.0, 0.2, ["0.2", "0.6", "1.0", "1.4"]),                 # bottom edge: down to 0.2
    (1.2, 1.2, 1.2, ["0.6", "1.0", "1.2", "1.4"]),                 # the recipe's own alpha joins
])
def test_length_penalty_search_steps_outwards_from_an_edge(peak: float, recipe: float, chosen: float,
                                                           tried: list[str]) -> None:
    calls: list[float] = []

    def score(alpha: float) -> float:
        calls.append(alpha)
        return 40.0 - abs(alpha - peak)

    best, scores = search_length_penalty(score, recipe)
    assert best == chosen
    assert sorted(scores, key=float) == tried
    assert len(calls) == len(set(calls)) == len(tried)  # each alpha decoded once


def test_length_penalty_search_reuses_the_recipe_score_and_prefers_it_on_ties() -> None:
    calls: list[float] = []

    def flat(alpha: float) -> float:
        calls.append(alpha)
        return 40.0

    best, scores = search_length_penalty(flat, 1.0, recipe_score=40.0)
    assert best == 1.0 and 1.0 not in calls and scores["1.0"] == 40.0


def test_length_penalty_search_breaks_a_tie_without_the_recipe_by_the_smaller_alpha() -> None:
    by_alpha = {0.2: 38.0, 0.6: 40.0, 1.0: 39.0, 1.4: 40.0, 1.8: 38.0}
    best, scores = search_length_penalty(by_alpha.__getitem__, 1.0)
    assert best == 0.6 and sorted(scores, key=float) == ["0.2", "0.6", "1.0", "1.4"]  # (1.4 would try 1.8)


def test_averaging_window_ties_go_to_the_smaller_window_and_only_it_stays(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        save_checkpoint(tmp_path / "checkpoints" / f"checkpoint_{step}.pt",
                        {"format": 1, "step": step, "model": {"w": torch.full((2,), float(step))}})
    path, used, scores = choose_average(tmp_path, "val", 3, lambda path, k: 40.0 + (k > 1))
    assert scores == {"1": 40.0, "2": 41.0, "3": 41.0}
    assert path.name == "checkpoint_avg_last2.pt" and [p.name for p in used] == ["checkpoint_20.pt", "checkpoint_30.pt"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("checkpoint_avg_*")) == ["checkpoint_avg_last2.pt"]


def test_seeds_train_their_own_runs_and_the_row_keeps_each(tmp_path: Path, toy_config_path: Path) -> None:
    """--seeds 1,2: two runs (train.seed, RUN_DIR-seed<N>), scored each; the row holds their mean,
    sample standard deviation and every seed's row, and the table shows them."""

    readme = tmp_path / "README.md"
    readme.write_text(f"{MARK_START}\n{MARK_END}\n", encoding="utf-8")
    code = main([
        "de_en", "--config", str(toy_config_path), "--results", str(tmp_path / "results"),
        "--readme", str(readme), "--seeds", "1,2",
        "--set", f"data.prepared_dir={tmp_path / 'prep'}", "--set", f"train.run_dir={tmp_path / 'run'}",
        "--set", "train.max_steps=20", "--set", "train.valid_every=10",
    ])
    assert code == 0
    row = json.loads((tmp_path / "results" / "multi30k.json").read_text())["de-en"]
    assert sorted(row["seeds"]) == ["1", "2"] and row["train_steps"] == 20
    seeds = [row["seeds"][s] for s in ("1", "2")]
    assert [s["seed"] for s in seeds] == [1, 2] and all(s["train_steps"] == 20 for s in seeds)
    for key in ("bleu", "bleu_lc", "chrf"):
        assert row[key] == pytest.approx((seeds[0][key] + seeds[1][key]) / 2)
        assert row[f"{key}_std"] == pytest.approx(abs(seeds[0][key] - seeds[1][key]) / 2 ** 0.5)
    assert (tmp_path / "run-seed1" / "checkpoints").is_dir() and (tmp_path / "run-seed2" / "checkpoints").is_dir()
    a = load_checkpoint(tmp_path / "run-seed1" / "checkpoints" / "checkpoint_last.pt")["model"]
    b = load_checkpoint(tmp_path / "run-seed2" / "checkpoints" / "checkpoint_last.pt")["model"]
    assert any(not torch.equal(a[k], b[k]) for k in a)
    line = next(x for x in (tmp_path / "results" / "multi30k.md").read_text().splitlines() if x.startswith("| de-en |"))
    assert f"| {seeds[0]['bleu_lc']:.2f} / {seeds[1]['bleu_lc']:.2f} |" in line


@pytest.mark.parametrize("text", ["1,x", "", "2,2"])
def test_bad_seeds_are_one_line_errors(text: str, capsys) -> None:

    assert main(["de_en", "--seeds", text]) == 2
    assert "--seeds" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["{\n<<<<<<< HEAD\n  \"de-en\": {}\n=======\n}\n", "[1, 2]"])
def test_a_results_table_that_cannot_be_read_is_said_before_any_training(
        text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A merge conflict left in a results table was a traceback after the recipe had trained
    and decoded; it is one line naming the file, before."""
    import mtcli.reproduce as reproduce

    monkeypatch.setattr(reproduce, "run_seeds", lambda *a, **k: pytest.fail("trained before the check"))
    table = tmp_path / "results" / "multi30k.json"
    table.parent.mkdir()
    table.write_text(text, encoding="utf-8")
    assert main(["de_en", "--seeds", "1", "--results", str(table.parent)]) == 1
    err = capsys.readouterr().err
    assert f"{table}: not a results table" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    # a tuning run writes no table: the broken one is none of its business
    monkeypatch.setattr(reproduce, "run_seeds", lambda *a, **k: {"val": {"bleu": 1.0}})
    assert main(["de_en", "--valid-only", "--results", str(table.parent)]) == 0


def _seed_file(directory: Path, seed: int, bleu_lc: float) -> Path:
    """A results directory as ``reproduce de_en --seeds <seed> --results DIR`` leaves it."""
    row = dict(ROW, seed=seed, bleu_lc=bleu_lc, train_steps=8000, average_last=2, length_penalty=1.0,
               decode="beam 5, length penalty 1, average of the last 2 checkpoints (both chosen on val)")
    write_results({"de-en": {**row, "seeds": {str(seed): row}}}, results_dir=directory, readme=directory / "none")
    return directory


def test_data_for_a_recipe_of_several_corpora_is_refused_naming_it(tmp_path: Path, capsys) -> None:
    """--data DIR on the adaptation recipe said "data.source='DIR': give data.source or
    data.sources, not both", a key the user never set."""

    assert main(["wmt_news_en_de_adapt", "--data", str(tmp_path), "--results", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.startswith(f"mtcli: error: --data {tmp_path}: configs/wmt_news_en_de_adapt.yaml "
                                              "reads several corpora (data.sources)")


def test_merge_combines_seeds_run_apart_and_refuses_a_seed_twice(tmp_path: Path, capsys) -> None:

    one, two = _seed_file(tmp_path / "one", 1, 40.0), _seed_file(tmp_path / "two", 2, 42.0)
    readme = tmp_path / "README.md"
    readme.write_text(f"{MARK_START}\n{MARK_END}\n", encoding="utf-8")
    out = tmp_path / "results"
    assert main(["de_en", "--merge", str(one), str(two / "multi30k.json"), "--results", str(out),
                 "--readme", str(readme)]) == 0
    row = json.loads((out / "multi30k.json").read_text())["de-en"]
    assert sorted(row["seeds"]) == ["1", "2"] and row["bleu_lc"] == pytest.approx(41.0)
    assert row["bleu_lc_std"] == pytest.approx(2 ** 0.5)
    assert "| 40.00 / 42.00 |" in readme.read_text()
    assert row["decode"].startswith("beam 5; for seed 1/2:")
    capsys.readouterr()
    assert main(["de_en", "--merge", str(one), str(one), "--results", str(out)]) == 2
    assert "seed 1" in capsys.readouterr().err
    assert main(["en_de", "--merge", str(one), "--results", str(out)]) == 2
    assert "no 'en-de' row" in capsys.readouterr().err


@pytest.mark.parametrize("table", [[1, 2], {"de-en": "x"}, {"de-en": {"seed": 1}}, {"de-en": {"seeds": {"a": {}}}},
                                   {"de-en": {"seeds": {"1": dict(ROW, bleu_lc="41")}}}],
                         ids=["list", "row-text", "no-scores", "seed-name", "score-text"])
def test_merge_of_a_file_of_another_shape_is_one_line(tmp_path: Path, table: object, capsys) -> None:
    """Python's TypeError, KeyError, AttributeError or ValueError, each a traceback."""
    file = tmp_path / "multi30k.json"
    file.write_text(json.dumps(table), encoding="utf-8")
    assert main(["de_en", "--merge", str(file), "--results", str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"mtcli: error: {file}") and said.count("\n") == 1, said


@pytest.mark.parametrize("table", [[1, 2], {"seeds": []}, {"seeds": {"1": {}}}, {"seeds": {"1": {"directions": "x"}}},
                                   {"seeds": {"1": {"directions": {"de-en": {"bleu": "x"}}}}}])
def test_multilingual_merge_of_a_file_of_another_shape_is_one_line(tmp_path: Path, table: object, capsys,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "multilingual.json"
    file.write_text(json.dumps(table), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert mtcli_status("reproduce-multilingual", "--merge", str(file), "--results", str(tmp_path / "out")) == 2
    said = capsys.readouterr().err
    assert said.startswith(f"mtcli: error: {file}") and said.count("\n") == 1, said


def _git(repo: Path, *args: str) -> str:
    import subprocess

    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.strip()


def test_a_copy_with_a_stale_git_is_merged_under_the_commit_whose_files_it_ran(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A working tree copied with an older ``.git`` labels its rows ``<old>-dirty``; its tree hash
    names the files it ran, and ``--merge`` in the real repository finds the commit they belong to."""
    from mtcli.results import commit_of_tree, git_commit, source_tree

    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "recipe.yaml").write_text("steps: 1\n", encoding="utf-8")
    _git(repo, "add", "recipe.yaml")
    _git(repo, "commit", "-qm", "one")
    old = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "recipe.yaml").write_text("steps: 2\n", encoding="utf-8")
    (repo / "new.sh").write_text("echo\n", encoding="utf-8")
    _git(repo, "add", "recipe.yaml", "new.sh")
    _git(repo, "commit", "-qm", "two")
    new = _git(repo, "rev-parse", "--short", "HEAD")
    monkeypatch.setattr("mtcli.results.checkout", lambda: repo)  # mtcli's files: this repository's
    assert git_commit() == new and source_tree() == _git(repo, "rev-parse", "HEAD^{tree}")
    index = (repo / ".git" / "index").read_bytes()

    copy = tmp_path / "copy"  # the device's copy: the new files, the old .git
    _git(tmp_path, "clone", "-q", str(repo), str(copy))
    _git(copy, "reset", "-q", "--mixed", old)
    monkeypatch.setattr("mtcli.results.checkout", lambda: copy)
    assert git_commit() == f"{old}-dirty"
    ran = source_tree()
    assert ran == _git(repo, "rev-parse", f"{new}^{{tree}}")
    for written in ("results/changed/multi30k.json", "bench/results/train_cpu.json"):  # a smoke test's, a bench's
        (copy / written).parent.mkdir(parents=True, exist_ok=True)
        (copy / written).write_text("{}\n", encoding="utf-8")
    assert source_tree() == ran  # not what runs: still the files of the commit
    (copy / "recipe.yaml").write_text("steps: 3\n", encoding="utf-8")
    edited = source_tree()
    assert edited != ran

    monkeypatch.setattr("mtcli.results.checkout", lambda: repo)
    assert (repo / ".git" / "index").read_bytes() == index  # the real index is left alone
    assert commit_of_tree(ran) == new and commit_of_tree(edited) is None
    one, two = _seed_file(tmp_path / "one", 1, 40.0), _seed_file(tmp_path / "two", 2, 42.0)
    for directory, tree in ((one, ran), (two, edited)):
        table = json.loads((directory / "multi30k.json").read_text())
        table["de-en"]["seeds"][next(iter(table["de-en"]["seeds"]))].update(commit=f"{old}-dirty", tree=tree)
        (directory / "multi30k.json").write_text(json.dumps(table))
    out = tmp_path / "results"
    assert main(["de_en", "--merge", str(one), str(two), "--results", str(out),
                 "--readme", str(tmp_path / "none.md")]) == 0
    seeds = json.loads((out / "multi30k.json").read_text())["de-en"]["seeds"]
    assert seeds["1"]["commit"] == new  # the files of a commit: named by it
    assert seeds["2"]["commit"] == f"{old}-dirty"  # files no commit has: left as they were


def test_two_directions_in_a_row_on_a_clean_clone_both_carry_the_clean_commit(
    tmp_path: Path, toy_config_path: Path, monkeypatch
) -> None:
    """The first direction rewrites results/ and the README's table; the second direction's row
    still names the clean commit (and its tree), while an edit of anything else would not."""
    from mtcli.results import git_commit, source_tree

    repo = tmp_path / "repo"
    (repo / "results").mkdir(parents=True)
    (repo / "README.md").write_text(f"# mtcli\n\n{MARK_START}\nold table\n{MARK_END}\n\nafter\n", encoding="utf-8")
    (repo / "results" / "multi30k.json").write_text("{}\n", encoding="utf-8")
    (repo / "results" / "multi30k.md").write_text("old table\n", encoding="utf-8")
    _git(repo, "init", "-q")
    _git(repo, "add", "--all")
    _git(repo, "commit", "-qm", "clean")
    clean, tree = _git(repo, "rev-parse", "--short", "HEAD"), _git(repo, "rev-parse", "HEAD^{tree}")
    monkeypatch.chdir(repo)
    monkeypatch.setattr("mtcli.results.checkout", lambda: repo)
    monkeypatch.setattr("mtcli.reproduce.row_is_the_recipe", lambda *args: True)  # the toy stands for the recipes
    monkeypatch.setattr("mtcli.reproduce.is_the_recipe", lambda *args: True)
    for recipe in ("de_en", "en_de"):
        assert main([recipe, "--config", str(toy_config_path), "--data", str(TOY_DIR),
                     "--set", f"data.prepared_dir={tmp_path / 'prep'}",
                     "--set", f"train.run_dir={tmp_path / recipe}", "--set", "train.max_steps=20",
                     "--set", "train.valid_every=10"]) == 0
    rows = json.loads((repo / "results" / "multi30k.json").read_text())
    assert [(rows[d]["commit"], rows[d]["tree"]) for d in ("de-en", "en-de")] == [(clean, tree)] * 2
    assert "| en-de |" in (repo / "README.md").read_text()
    with (repo / "README.md").open("a", encoding="utf-8") as handle:
        handle.write("an edit outside the table\n")
    assert git_commit() == f"{clean}-dirty" and source_tree() != tree


def test_a_row_names_mtcli_s_files_not_those_of_the_project_it_is_run_in(tmp_path: Path, monkeypatch) -> None:
    """Run in a user's own git project, a reproduction named that project's HEAD as its commit,
    and hashed the project's files (checkpoints too) into the project's .git as loose objects."""
    from mtcli.results import checkout, git_commit, source_tree

    project = tmp_path / "project"
    project.mkdir()
    _git(project, "init", "-q")
    (project / "notes.txt").write_text("mine\n", encoding="utf-8")
    _git(project, "add", "notes.txt")
    _git(project, "commit", "-qm", "mine")
    (project / "checkpoint.pt").write_bytes(b"weights" * 100)
    objects = sorted(p.name for p in (project / ".git" / "objects").rglob("*"))
    monkeypatch.chdir(project)
    mine = _git(project, "rev-parse", "--short", "HEAD")
    assert git_commit() != mine and source_tree() != _git(project, "rev-parse", "HEAD^{tree}")
    assert sorted(p.name for p in (project / ".git" / "objects").rglob("*")) == objects
    if checkout() is not None:  # (a test run from mtcli's checkout: its HEAD)
        assert git_commit().removesuffix("-dirty") == _git(checkout(), "rev-parse", "--short", "HEAD")


def test_an_installed_mtcli_names_its_version_and_a_digest_of_its_files(monkeypatch) -> None:
    """Without a checkout a row said ``unknown``, and the rows a pipeline keeps were never
    invalidated by another version of mtcli (their key held ``unknown`` for the files)."""
    from mtcli.results import git_commit, package_digest, source_tree
    from mtcli.version import __version__

    monkeypatch.setattr("mtcli.results.checkout", lambda: None)
    assert git_commit() == f"mtcli {__version__}"
    tree = source_tree()
    assert tree == package_digest() and tree.startswith("package:") and len(tree) == len("package:") + 64


def test_every_recipe_table_is_a_known_results_table_and_the_pairs_are_their_own_rows() -> None:
    from mtcli.reproduce import PAIRS, RECIPES, pair_overrides
    from mtcli.results import TABLES

    assert {table for _, table, _ in RECIPES.values()} <= set(TABLES)  # their edits never count as -dirty
    assert pair_overrides("en_de") == []
    for name, (src, tgt) in PAIRS.items():
        assert RECIPES[name][1:] == ("multi30k", f"{src}-{tgt}")
        assert f"data.name=multi30k_{name}" in pair_overrides(name)
        assert f"data.src_lang={src}" in pair_overrides(name) and f"data.tgt_lang={tgt}" in pair_overrides(name)


def test_a_seed_run_again_keeps_the_other_seeds_of_its_recipe_only() -> None:
    """SEEDS=1 run again replaced a three-seed row by seed 1 alone; seeds of another recipe (a
    smoke test's 20 steps) must not be averaged with it either."""
    from mtcli.reproduce import with_earlier_seeds

    def seed_row(seed: int, bleu_lc: float, recipe: str | None) -> dict:
        return dict(ROW, seed=seed, bleu_lc=bleu_lc, train_steps=8000, average_last=2, length_penalty=1.0,
                    recipe=recipe, decode="beam 5, length penalty 1, average of the last 2 checkpoints")

    earlier = combine_seeds({1: seed_row(1, 40.0, "a"), 2: seed_row(2, 41.0, "a"), 3: seed_row(3, 42.0, "b")})
    again = with_earlier_seeds(earlier, combine_seeds({1: seed_row(1, 39.0, "a")}))
    assert sorted(again["seeds"]) == ["1", "2"] and again["bleu_lc"] == pytest.approx(40.0)
    other = combine_seeds({1: seed_row(1, 10.0, "c")})
    assert with_earlier_seeds(earlier, other) == other
    unknown = combine_seeds({1: seed_row(1, 10.0, None)})
    assert with_earlier_seeds(earlier, unknown) == unknown


def test_a_seed_run_again_is_listed_in_seed_order_with_the_kept_ones() -> None:
    """Seeds 2 and 3 kept from the earlier row come before seed 1 run again; each seed's window,
    length penalty and steps are listed in the order of the seeds the row names."""
    from mtcli.reproduce import with_earlier_seeds

    def seed_row(seed: int, window: int, alpha: float) -> dict:
        return dict(ROW, seed=seed, train_steps=1000 * seed, average_last=window, length_penalty=alpha, recipe="a",
                    decode="beam 5, length penalty 1")

    earlier = combine_seeds({2: seed_row(2, 2, 0.6), 3: seed_row(3, 3, 1.4)})
    again = with_earlier_seeds(earlier, combine_seeds({1: seed_row(1, 1, 1.0)}))
    assert again["decode"] == ("beam 5; for seed 1/2/3: the average of the last 1/2/3 checkpoints and length "
                               "penalty 1/0.6/1.4 (chosen on val)")
    assert again["train_steps"] == [1000, 2000, 3000]


def test_seeds_trained_on_other_data_are_neither_kept_nor_merged(tmp_path: Path, prepared_toy: Path) -> None:
    """A seed trained and scored on another copy of the data (``--data DIR``, whose place the
    recipe's fingerprint leaves out) was averaged with this run's into one row."""
    from mtcli.config import ConfigError
    from mtcli.reproduce import merge_seed_results, trained_on, with_earlier_seeds
    from mtcli.results import data_fingerprint

    def seed_row(seed: int, bleu_lc: float, data: str | None) -> dict:
        return dict(ROW, seed=seed, bleu_lc=bleu_lc, train_steps=8000, average_last=2, length_penalty=1.0,
                    recipe="a", data=data, decode="beam 5, length penalty 1, average of the last 2 checkpoints")

    earlier = combine_seeds({1: seed_row(1, 40.0, "x"), 2: seed_row(2, 41.0, "x"), 3: seed_row(3, 42.0, None)})
    again = with_earlier_seeds(earlier, combine_seeds({1: seed_row(1, 30.0, "y")}))
    assert sorted(again["seeds"]) == ["1", "3"]  # seed 3 does not say (a row from before): kept
    for seed, data in ((1, "x"), (2, "y")):
        row = seed_row(seed, 40.0, data)
        write_results({"de-en": {**row, "seeds": {str(seed): row}}}, results_dir=tmp_path / str(seed), readme=None)
    with pytest.raises(ConfigError, match=r"seeds were trained on different data \(seed 1: x, seed 2: y\)"):
        merge_seed_results([tmp_path / "1", tmp_path / "2"], "de-en", "multi30k")
    inputs = json.loads((prepared_toy / "manifest.json").read_text(encoding="utf-8"))["inputs"]
    assert trained_on(prepared_toy) == data_fingerprint(inputs) != data_fingerprint({**inputs, "kind": "other"})


def test_adaptation_from_too_few_parent_checkpoints_says_which_setting(tiny_run_dir: Path, tmp_path: Path) -> None:

    from mtcli.config import ConfigError, load_config
    from mtcli.reproduce import run_adaptation

    config = load_config(TOY_CONFIG, [f"train.init_from={tiny_run_dir}", "train.init_average=4",
                                      f"train.run_dir={tmp_path / 'child'}"])
    with pytest.raises(ConfigError, match=r"give train.init_average at most its 2, or train the parent longer"):
        run_adaptation(config)
    config = load_config(TOY_CONFIG, [f"train.init_from={tmp_path / 'none'}", f"train.run_dir={tmp_path / 'child'}"])
    with pytest.raises(ConfigError, match="train the parent first"):
        run_adaptation(config)
    from mtcli.config import save_config, with_changes

    child = tmp_path / "child"  # a child trained to another recipe: said before the cache is prepared
    config = load_config(TOY_CONFIG, [f"train.init_from={tiny_run_dir}", "train.init_average=2",
                                      f"train.run_dir={child}", f"data.prepared_dir={tmp_path / 'cache'}"])
    (child / "checkpoints").mkdir(parents=True)
    (child / "checkpoints" / "checkpoint_2.pt").write_bytes(b"")
    save_config(with_changes(config, "train", lr_factor=9.0), child / "config.yaml")
    with pytest.raises(ConfigError, match=r"child: trained to another recipe \(train.lr_factor: 9.0 -> "):
        run_adaptation(config)
    assert not (tmp_path / "cache").exists()


def test_a_recipe_fingerprint_leaves_out_where_a_run_ran_and_merges_refuse_two_recipes(tmp_path: Path) -> None:
    from mtcli.config import ConfigError, load_config
    from mtcli.reproduce import merge_seed_results
    from mtcli.results import recipe_fingerprint

    recipe = "configs/multi30k_en_de.yaml"
    here = recipe_fingerprint(load_config(recipe))
    elsewhere = load_config(recipe, ["train.seed=2", "train.device=cpu", "decode.max_tokens=100", "data.source=/x",
                                     "train.run_dir=/y", "train.num_threads=1"])
    assert recipe_fingerprint(elsewhere) == here
    assert recipe_fingerprint(load_config(recipe, ["train.max_steps=20"])) != here
    for seed, fingerprint in ((1, "a" * 16), (2, "b" * 16)):
        row = dict(ROW, seed=seed, train_steps=8000, average_last=2, length_penalty=1.0, recipe=fingerprint,
                   decode="beam 5, length penalty 1, average of the last 2 checkpoints (both chosen on val)")
        write_results({"de-en": {**row, "seeds": {str(seed): row}}}, results_dir=tmp_path / str(seed),
                      readme=None)
    with pytest.raises(ConfigError, match="seeds were trained by different recipes"):
        merge_seed_results([tmp_path / "1", tmp_path / "2"], "de-en", "multi30k")
    from mtcli.results import RESULTS_DIR, results_home

    assert results_home(RESULTS_DIR, True) == RESULTS_DIR / "changed"  # a smoke test keeps off the README's rows
    assert results_home(RESULTS_DIR, False) == RESULTS_DIR and results_home(tmp_path, True) == tmp_path


@pytest.mark.parametrize("module", ["mtcli.reproduce", "mtcli.multilingual", "mtcli.backtranslation"])
def test_a_results_place_that_cannot_be_written_is_one_line_before_any_training(
        module: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file where the results directory should be was a NotADirectoryError traceback after
    the whole pipeline, and the row was lost."""
    from conftest import TOY_CONFIG

    from mtcli.config import load_config, save_config, with_changes

    command = {"mtcli.reproduce": "reproduce", "mtcli.multilingual": "reproduce-multilingual",
               "mtcli.backtranslation": "reproduce-bt"}[module]
    blocker = tmp_path / "afile"
    blocker.write_text("", encoding="utf-8")
    table = {"mtcli.reproduce": "multi30k", "mtcli.multilingual": "multilingual", "mtcli.backtranslation": "bt"}[module]
    (tmp_path / "results" / f"{table}.md").mkdir(parents=True)  # the table's .md place: a directory
    toy = str(TOY_CONFIG)  # should the check go, the pipeline that runs is the toy's
    reverse = tmp_path / "reverse.yaml"  # (the toy's other direction, as back-translation needs)
    save_config(with_changes(load_config(TOY_CONFIG), "data", src_lang="tgt", tgt_lang="src"), reverse)
    recipes = {"mtcli.reproduce": ["de_en", "--config", toy], "mtcli.multilingual": ["--config", toy, "--seeds", "1"],
               "mtcli.backtranslation": ["--forward", toy, "--reverse", str(reverse)]}[module]
    args = [*recipes, "--results", str(blocker), "--set", f"train.run_dir={tmp_path / 'run'}",
            "--set", f"data.prepared_dir={tmp_path / 'prep'}", "--set", "train.max_steps=4"]
    assert mtcli_status(command, *args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"mtcli: error: {blocker}: ") and "directory" in err[-1], err
    args[args.index(str(blocker))] = str(tmp_path / "results")
    assert mtcli_status(command, *args) == 1  # the .json's place is fine, the .md's is not
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"mtcli: error: {tmp_path / 'results' / table}.md: "), err
    assert not list((tmp_path / "results").glob("*.json"))
    assert not (tmp_path / "run").exists() and not any(tmp_path.glob("run*"))


def test_a_row_that_cannot_be_written_is_printed_with_one_line(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    import mtcli.reproduce as reproduce
    from mtcli.pipeline import write_or_keep

    def full() -> None:
        raise OSError(28, "No space left on device", b"results/multi30k.json")  # (a bytes name: not b'...')

    def finished(direction: str, **kwargs: object) -> reproduce.Reproduced:
        write_or_keep(writes.pop(0), {"bleu": 40.0})
        raise AssertionError("written")

    def interrupted() -> None:  # a Ctrl-C while the table was written: a traceback, the row lost
        raise KeyboardInterrupt

    monkeypatch.setattr(reproduce, "reproduce", finished)
    writes = [full, interrupted]
    assert main(["de_en"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {"bleu": 40.0}
    assert err == "mtcli: error: results/multi30k.json: No space left on device\n"
    assert main(["de_en"]) == 130
    out, err = capsys.readouterr()
    assert json.loads(out) == {"bleu": 40.0} and err == "mtcli: error: interrupted (run the same command again to go on)\n"


@pytest.mark.parametrize(("seeds", "says"), [("-1", "between 0 and 4294967295"),
                                             ("1,99999999999999999999", "between 0 and 4294967295"),
                                             ("1,1", "distinct")])
def test_seeds_out_of_range_are_refused_before_any_work(seeds: str, says: str) -> None:
    from mtcli.config import ConfigError
    from mtcli.pipeline import parse_seeds

    with pytest.raises(ConfigError, match=says):
        parse_seeds(seeds)


def test_a_config_of_another_rows_direction_is_refused(toy_config_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """de_en --config an en-de recipe filed the en-de model's scores as the de-en row."""
    from mtcli.config import ConfigError, load_config
    from mtcli.reproduce import check_row

    en_de = load_config("configs/multi30k_en_de.yaml")
    with pytest.raises(ConfigError, match="the config trains en-de, whose row is not 'de-en': give the direction en_de"):
        check_row(en_de, "multi30k", "de-en")
    check_row(en_de, "multi30k", "en-de")
    check_row(load_config("configs/wmt_news_en_de_adapt.yaml"), "wmt_news", "en-de adapted")
    check_row(load_config(toy_config_path), "multi30k", "de-en")  # a pair of no row: a changed recipe's table,
    assert "the config trains src-tgt, a pair of no row: its scores are filed as the 'de-en' row" in caplog.text


def test_a_data_directory_is_the_recipes_only_when_it_holds_the_pinned_text(tmp_path: Path, monkeypatch,
                                                                             caplog) -> None:
    """make reproduce DATA=DIR: a local copy of Multi30k refreshes the README's table; a subset or
    another corpus in its place is not the recipe's data (its scores went into the table)."""
    from mtcli import pipeline
    from mtcli.config import load_config
    from mtcli.data import download
    from mtcli.fileio import sha256_file
    from mtcli.pipeline import is_the_recipe

    copy = tmp_path / "copy"
    copy.mkdir()
    for split in ("train", "val", "test_2016_flickr"):
        for lang, name in (("de", "src"), ("en", "tgt")):
            (copy / f"{split}.{lang}").write_bytes((TOY_DIR / f"{split.split('_')[0]}.{name}").read_bytes())
    pinned = tuple(download.PublicFile(p.name, (), p.stat().st_size, sha256_file(p)) for p in copy.iterdir())
    monkeypatch.setitem(download.CORPORA, "multi30k", pinned)  # the copy stands for Multi30k
    recipe = "configs/multi30k_de_en.yaml"
    assert is_the_recipe(load_config(recipe, [f"data.source={copy}"]), recipe)
    with (copy / "val.en").open("a", encoding="utf-8") as handle:
        handle.write("one more line\n")
    with (copy / "val.de").open("a", encoding="utf-8") as handle:
        handle.write("noch eine zeile\n")
    assert not is_the_recipe(load_config(recipe, [f"data.source={copy}"]), recipe)
    assert f"{copy}: val.de is not the text of multi30k the recipe reads" in caplog.text

    class HubPlan:  # a hub dataset in the corpus's place: no files to compare (was a KeyError)
        def fingerprint(self, hasher: object) -> dict:
            return {"kind": "hub", "dataset": "org/name", "revision": "abc"}

    monkeypatch.setattr(pipeline, "plan_corpora", lambda data: HubPlan())
    assert not is_the_recipe(load_config(recipe, ["data.source=org/name"]), recipe)


def test_a_run_trained_to_another_recipe_is_refused_not_filed_under_this_one(tmp_path: Path) -> None:
    """A finished run rerun with another --set (or a tuning run's directory, then the plain
    recipe): training resumed it and trained nothing, and its scores were filed as the recipe."""
    from mtcli.config import load_config, save_config, with_changes
    from mtcli.errors import ConfigError
    from mtcli.pipeline import check_run_recipe

    config = load_config(TOY_DIR.parent.parent.parent / "configs" / "toy.yaml",
                         [f"train.run_dir={tmp_path / 'run'}", "train.precision=auto"])
    check_run_recipe(config)  # no run yet
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    trained = with_changes(config, "train", lr_factor=3.0, precision="fp32", num_threads=1)  # (auto: fp32 here)
    save_config(trained, tmp_path / "run" / "config.yaml")
    check_run_recipe(config)  # a config.yaml but no checkpoint (out of memory at step 1): starts afresh
    (tmp_path / "run" / "checkpoints" / "checkpoint_2.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"run: trained to another recipe \(train.lr_factor: 3.0 -> 0.5\); a row "
                                          r"of the table is one recipe's: remove that directory"):
        check_run_recipe(config)
    same = with_changes(config, "train", lr_factor=3.0)
    check_run_recipe(same)  # the same recipe, where it ran: goes on
    check_run_recipe(with_changes(same, "train", max_tokens=64, update_freq=8))  # smaller batches, for memory
    check_run_recipe(with_changes(same, "data", test_splits=["test", "val"]))  # no training setting


def test_seeds_for_the_adapted_row_are_refused(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # noqa: ANN001
    """--seeds 2,3 on wmt_news_en_de_adapt was ignored: one row of the seed-1 run, as if of the seeds."""
    from conftest import REPO


    monkeypatch.chdir(REPO)
    assert main(["wmt_news_en_de_adapt", "--seeds", "2,3"]) != 0
    assert "--seeds 2,3: wmt_news_en_de_adapt adapts one parent run, with its seed; leave --seeds out" in \
        capsys.readouterr().err


def test_a_sigterm_to_a_pipeline_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """SIGTERM while a pipeline averaged or decoded ended it without a word (its default action);
    a Ctrl-C there said it was interrupted."""
    import os
    import signal

    import mtcli.reproduce as reproduce

    def averaging(direction: str, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("not stopped")

    monkeypatch.setattr(reproduce, "reproduce", averaging)
    assert main(["de_en"]) == 143
    assert capsys.readouterr().err == "mtcli: error: terminated (run the same command again to go on)\n"


def test_a_row_record_that_cannot_be_written_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The row was scored: a record it cannot keep (a file where the run directory is, a full
    disk) must not fail the pipeline before the table is written."""
    from mtcli.config import load_config
    from mtcli.pipeline import ROW_RECORD, scored_row

    blocked = tmp_path / "run"
    blocked.write_text("a file in the way")
    config = load_config(TOY_CONFIG, [f"train.run_dir={blocked}"])
    assert scored_row(config, "recipe", "data", lambda: {"bleu": 1.0}) == ({"bleu": 1.0}, False)
    assert f"{blocked / ROW_RECORD}: cannot keep the row for a rerun" in caplog.text
    assert scored_row(config, "recipe", "data", lambda: {"bleu": 2.0}) == ({"bleu": 2.0}, False)  # none kept


def test_a_pipeline_out_of_memory_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The pipelines had a command line of their own, whose one-line errors left out running out
    of memory: a traceback after hours of work."""
    import mtcli.reproduce as reproduce

    def short_of_memory(direction: str, **kwargs: object) -> None:
        raise MemoryError

    monkeypatch.setattr(reproduce, "reproduce", short_of_memory)
    assert main(["de_en"]) == 1
    assert capsys.readouterr().err == "mtcli: error: out of memory\n"


def test_the_help_names_every_recipe() -> None:
    from conftest import mtcli_here

    from mtcli.reproduce import RECIPES

    said = " ".join(mtcli_here("reproduce", "--help").stdout.decode().split())
    assert all(name in said for name in RECIPES), said


def test_a_table_made_unreadable_during_the_training_prints_the_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A results table that became a directory (or unreadable) while the seeds trained lost their
    row: only the error was said."""
    import mtcli.reproduce as reproduce

    results = tmp_path / "results"
    row = {"bleu": 40.0, "bleu_lc": 41.0, "chrf": 60.0}

    def trained(*args: object, **kwargs: object) -> dict:
        (results / "multi30k.json").mkdir(parents=True)
        return row

    monkeypatch.setattr(reproduce, "run_seeds", trained)
    assert main(["de_en", "--config", str(TOY_CONFIG), "--results", str(results),
                 "--readme", str(tmp_path / "README.md")]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == row
    assert err.splitlines()[-1].startswith(f"mtcli: error: {results / 'multi30k.json'}: "), err


@pytest.mark.parametrize("option", ["--seeds", "--data", "--results", "--config"])
def test_an_option_whose_value_is_left_out_is_refused(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--seeds $SEEDS --valid-only`` with an empty variable read ``--valid-only`` as the seeds,
    and a tuning run decoded test and wrote a table into ./--valid-only/."""
    assert main(["de_en", option, "--valid-only"]) == 2
    assert "--valid-only is an option, not a value" in capsys.readouterr().err


def test_merge_refuses_a_row_without_a_seed_and_an_unchecked_recipe_beside_a_checked_one(tmp_path: Path) -> None:
    """A row from before the seeds were recorded was a KeyError traceback; one from before the
    recipe's fingerprint was averaged with rows of another recipe, unsaid."""
    from mtcli.config import ConfigError
    from mtcli.reproduce import merge_seed_results

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "multi30k.json").write_text(json.dumps({"de-en": dict(ROW)}), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"old/multi30k.json: its 'de-en' row names no seed \(a table from an older"):
        merge_seed_results([tmp_path / "old"], "de-en", "multi30k")
    for seed, fingerprint in ((1, None), (2, "b" * 16), (3, None)):
        row = dict(ROW, seed=seed, train_steps=8000, average_last=2, length_penalty=1.0,
                   decode="beam 5, length penalty 1, average of the last 2 checkpoints (both chosen on val)",
                   **({"recipe": fingerprint} if fingerprint else {}))
        write_results({"de-en": {**row, "seeds": {str(seed): row}}}, results_dir=tmp_path / str(seed),
                      readme=None)
    with pytest.raises(ConfigError, match=r"by different recipes \(seed 1: not said, seed 2: b{16}\)"):
        merge_seed_results([tmp_path / "1", tmp_path / "2"], "de-en", "multi30k")
    assert sorted(merge_seed_results([tmp_path / "1", tmp_path / "3"], "de-en", "multi30k")["seeds"]) == ["1", "3"]


@pytest.mark.parametrize("command", [["reproduce", "de_en"], ["reproduce-multilingual"], ["reproduce-bt"]])
def test_a_recipe_reproduced_outside_a_checkout_says_where_they_run(command: list[str], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The recipes are the checkout's configs/: from elsewhere it was `config file not found`."""
    monkeypatch.chdir(tmp_path)
    assert mtcli_status(*command, "--seeds" if command[0] != "reproduce-bt" else "--seed", "1") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtcli: error: configs/multi30k_") and len(err.splitlines()) == 1
    assert err.endswith(f"not found in {tmp_path}; the reproduce commands run from an mtcli checkout, whose "
                        "configs/ holds the recipes (or give the path of a recipe file)")


def test_an_unknown_recipe_is_refused_with_the_known_ones(capsys) -> None:  # noqa: ANN001
    from mtcli.reproduce import RECIPES

    assert mtcli_status("reproduce", "nosuch", "--seeds", "1") == 2
    assert capsys.readouterr().err == f"mtcli: error: nosuch: no such recipe; give one of {', '.join(RECIPES)}\n"


def test_results_of_their_own_directory_leave_the_readme_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys) -> None:  # noqa: ANN001
    """--results DIR without --readme refreshed README.md's table with DIR's rows alone: the
    README lost every other direction's row, and disagreed with results/."""
    one = _seed_file(tmp_path / "one", 1, 40.0)
    monkeypatch.chdir(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(f"{MARK_START}\n| other rows |\n{MARK_END}\n", encoding="utf-8")
    assert main(["de_en", "--merge", str(one), "--results", str(tmp_path / "out")]) == 0
    assert "| other rows |" in readme.read_text() and (tmp_path / "out" / "multi30k.json").is_file()
    assert main(["de_en", "--merge", str(one), "--results", str(tmp_path / "out"), "--readme", str(readme)]) == 0
    assert "| other rows |" not in readme.read_text()  # asked for


def test_a_local_copy_the_recipes_name_finds_is_checked_as_a_directory_given_is(tmp_path: Path, monkeypatch,
                                                                                 caplog) -> None:  # noqa: ANN001
    """A subset of Multi30k in ../shared/data/multi30k, found by the recipe's own name, was
    never hashed: its scores refreshed the README's table as the recipe's."""
    from mtcli.config import load_config
    from mtcli.data import download
    from mtcli.fileio import sha256_file
    from mtcli.pipeline import is_the_recipe

    copy = tmp_path / "shared" / "multi30k"
    copy.mkdir(parents=True)
    for split in ("train", "val", "test_2016_flickr"):
        for lang, name in (("de", "src"), ("en", "tgt")):
            (copy / f"{split}.{lang}").write_bytes((TOY_DIR / f"{split.split('_')[0]}.{name}").read_bytes())
    pinned = tuple(download.PublicFile(p.name, (), p.stat().st_size, sha256_file(p)) for p in copy.iterdir())
    monkeypatch.setitem(download.CORPORA, "multi30k", pinned)
    monkeypatch.setattr(download, "LOCAL_COPIES", (tmp_path / "shared",))
    recipe = "configs/multi30k_de_en.yaml"
    assert is_the_recipe(load_config(recipe), recipe)  # the pinned text, found by name
    with (copy / "train.en").open("a", encoding="utf-8") as handle:
        handle.write("one more line\n")
    assert not is_the_recipe(load_config(recipe), recipe)
    assert f"{copy}: train.en is not the text of multi30k the recipe reads" in caplog.text
