"""make reproduce-multilingual on the toy corpus in three directions: every direction scored per
seed, its length penalty chosen on its own val, the table beside the bilingual results."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import REPO, TOY_CONFIG, TOY_DIR, make_trilingual, mtcli_status, multi_overrides

from mtcli.checkpoint import save_checkpoint
from mtcli.multilingual import MARKS, render


def main(argv: list[str]) -> int:
    """``mtcli reproduce-multilingual ARGV`` in this process: its exit status; its output where
    capsys reads it."""
    return mtcli_status("reproduce-multilingual", *argv)


def test_multilingual_table_on_toy(tmp_path: Path, monkeypatch, capsys) -> None:  # noqa: ANN001
    root = make_trilingual(tmp_path / "corpus")
    (root / "yy").mkdir()  # a direction of its own with no validation or test split: not scored, said
    for lang, words in (("src", "src"), ("yy", "tgt")):
        lines = (TOY_DIR / f"train.{words}").read_text(encoding="utf-8").splitlines()[:50]
        (root / "yy" / f"train.{lang}").write_text("".join(f"{line} y\n" for line in lines), encoding="utf-8")
    results = tmp_path / "results"
    results.mkdir()
    (results / "multi30k.json").write_text(json.dumps({"src-tgt": {"bleu_lc": 12.5}}))  # a bilingual row
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{MARKS[0]}\n{MARKS[1]}\nend\n", encoding="utf-8")
    overrides = [o.replace("}]", f"}}, {{source: {root}/yy, langs: [src, yy]}}]") if o.startswith("data.sources=") else o
                 for o in multi_overrides(root, tmp_path / "prep")]
    overrides += [f"train.run_dir={tmp_path / 'run'}",
                 "train.max_steps=20", "train.valid_every=10", "train.valid_bleu=false", "train.keep_last=2"]
    args = ["--config", str(TOY_CONFIG), "--seeds", "1", "--results", str(results), "--readme", str(readme)]
    assert main([*args, *[a for o in overrides for a in ("--set", o)]]) == 0
    table = json.loads((results / "multilingual.json").read_text())
    assert list(table["directions"]) == ["src-tgt", "tgt-src", "src-xx"]  # (it stopped at src-yy's missing val)
    assert "src-yy: not scored: it has no text of split 'val' or 'test'" in capsys.readouterr().err
    seed = table["seeds"]["1"]
    assert seed["run_dir"].endswith("run-seed1") and set(seed["valid_mean_bleu_by_average"]) == {"1", "2"}
    for name, row in seed["directions"].items():
        assert {"0.6", "1.0", "1.4"} <= set(row["valid_bleu_by_length_penalty"]), name
        assert row["sentences"] == 40 and row["bleu_lc_signature"].startswith("nrefs:1|case:lc")
    # the recipe's own length penalty (1.0) was decoded while choosing the average: not again
    assert (tmp_path / "run-seed1" / "eval" / "lp0.6").is_dir()
    assert not (tmp_path / "run-seed1" / "eval" / "lp1").exists()
    src_tgt = table["directions"]["src-tgt"]
    assert src_tgt["bilingual_bleu_lc"] == 12.5 and src_tgt["bleu_lc_per_seed"] == [seed["directions"]["src-tgt"]["bleu_lc"]]
    assert readme.read_text() == f"intro\n{MARKS[0]}\n{MARKS[1]}\nend\n"  # another recipe: left alone
    text = (results / "multilingual.md").read_text()
    assert "| src-tgt |" in text and "| src-xx |" in text and "| 12.50 (1 seed) |" in text
    # run again (as after an interruption in a later seed): the finished seed's row is kept
    import mtcli.multilingual
    import mtcli.tuning

    monkeypatch.setattr(mtcli.multilingual, "evaluate_directions", None)  # (not called)
    monkeypatch.setattr(mtcli.multilingual, "evaluate", None)
    monkeypatch.setattr(mtcli.tuning, "evaluate", None)
    assert main([*args, *[a for o in overrides for a in ("--set", o)]]) == 0
    assert json.loads((results / "multilingual.json").read_text())["seeds"]["1"] == seed
    monkeypatch.undo()
    # a seed run apart (another process, --results elsewhere) is added with --merge, never twice
    apart = tmp_path / "apart"
    apart.mkdir()
    other = json.loads(json.dumps(seed))
    other["directions"]["src-tgt"]["bleu_lc"] = seed["directions"]["src-tgt"]["bleu_lc"] + 2.0
    (apart / "multilingual.json").write_text(json.dumps({"seeds": {"2": other}}))
    monkeypatch.chdir(tmp_path)  # where no configs/multi30k_multi.yaml is: --merge trains nothing, needs no recipe
    assert main(["--merge", str(apart), "--results", str(results), "--readme", str(readme)]) == 0
    merged = json.loads((results / "multilingual.json").read_text())
    assert sorted(merged["seeds"]) == ["1", "2"]
    first = seed["directions"]["src-tgt"]["bleu_lc"]
    assert merged["directions"]["src-tgt"]["bleu_lc_per_seed"] == [first, first + 2.0]
    assert main(["--merge", str(apart), str(apart / "multilingual.json"), "--results", str(results)]) != 0
    capsys.readouterr()  # settings of a training, which --merge does not run
    assert main(["--merge", str(apart), "--results", str(results), "--set", "train.max_steps=5"]) == 2
    assert "--merge trains nothing" in capsys.readouterr().err


def test_training_speed_is_given_per_machine() -> None:
    """Seeds trained on two machines: each machine's mean speed, with its seeds, never one mean."""
    def seed(device: str, minutes: float, tokens: float) -> dict:
        return {"params": 9e6, "train_steps": 100, "train_minutes": minutes, "train_tokens_per_s": tokens,
                "device": device, "commit": "abc1234"}
    direction = {"bleu_lc": 30.0, "bleu_lc_std": None, "bleu_lc_per_seed": [30.0], "bilingual_bleu_lc": None,
                 "bleu_lc_signature": "nrefs:1|case:lc"}
    seeds = {"1": seed("GPU A", 10.0, 9000.0), "2": seed("GPU B", 20.0, 4000.0), "3": seed("GPU A", 12.0, 7000.0)}
    text = render({"directions": {"en-de": direction}, "seeds": seeds})
    assert ("11.0 min of training each on GPU A (8,000 tok/s; seeds 1, 3); "
            "20.0 min of training each on GPU B (4,000 tok/s; seed 2)") in text
    one = render({"directions": {"en-de": direction}, "seeds": {"1": seeds["1"], "3": seeds["3"]}})
    assert "11.0 min of training each on GPU A (8,000 tok/s); commit abc1234" in one


def test_data_reads_every_corpus_from_the_local_copy_as_the_same_recipe() -> None:
    from mtcli.config import load_config
    from mtcli.multilingual import RECIPE, read_from
    from mtcli.results import recipe_fingerprint

    recipe = load_config(REPO / RECIPE)
    local = read_from(recipe, "/copy/of/multi30k")
    assert {c.source for c in local.data.sources} == {"/copy/of/multi30k"}
    assert [c.langs for c in local.data.sources] == [c.langs for c in recipe.data.sources]
    assert recipe_fingerprint(local) == recipe_fingerprint(recipe)  # where the data is read from is a place
    assert read_from(recipe, None) is recipe


def test_each_directions_tokeniser_is_named_with_the_directions_it_scored() -> None:
    """zh and ja targets are scored with their own tokenisers: one signature line each."""
    def direction(signature: str) -> dict:
        return {"bleu_lc": 30.0, "bleu_lc_std": None, "bleu_lc_per_seed": [30.0], "bilingual_bleu_lc": None,
                "bleu_lc_signature": signature}
    seeds = {"1": {"params": 9e6, "train_steps": 100, "train_minutes": 1.0, "train_tokens_per_s": 1.0,
                   "device": "cpu", "commit": "abc1234"}}
    text = render({"directions": {"en-zh": direction("case:lc|tok:zh"), "zh-en": direction("case:lc|tok:13a"),
                                  "de-en": direction("case:lc|tok:13a")}, "seeds": seeds})
    assert "13a" not in text.splitlines()[0]
    assert "- lowercased BLEU `case:lc|tok:zh`: en-zh\n- lowercased BLEU `case:lc|tok:13a`: zh-en, de-en\n" in text
    one = render({"directions": {"de-en": direction("case:lc|tok:13a")}, "seeds": seeds})
    assert one.endswith("- lowercased BLEU `case:lc|tok:13a`\n")


def test_merged_seeds_of_another_recipe_leave_the_readme_table_alone(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """--merge of a CPU trial's seeds (150 steps, as bench/gpu_multilingual.sh's trial)
    replaced the README's seeds: merged seeds were taken as the recipe's without a look."""
    import shutil

    from mtcli.config import load_config
    from mtcli.results import recipe_fingerprint

    (tmp_path / "configs").mkdir()
    shutil.copy(REPO / "configs" / "multi30k_multi.yaml", tmp_path / "configs")
    trial = recipe_fingerprint(load_config(REPO / "configs" / "multi30k_multi.yaml", ["train.max_steps=150"]))
    shipped = json.loads((REPO / "results" / "multilingual.json").read_text(encoding="utf-8"))["seeds"]
    row = {**next(iter(shipped.values())), "recipe": trial}  # a seed's row as the table holds one
    (tmp_path / "trial").mkdir()
    (tmp_path / "trial" / "multilingual.json").write_text(json.dumps({"seeds": {"1": row, "2": row}}))
    (tmp_path / "README.md").write_text(f"intro\n{MARKS[0]}\n{MARKS[1]}\nend\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert main(["--merge", "trial"]) == 0
    assert (tmp_path / "results" / "changed" / "multilingual.json").is_file()
    assert not (tmp_path / "results" / "multilingual.json").exists()
    assert (tmp_path / "README.md").read_text() == f"intro\n{MARKS[0]}\n{MARKS[1]}\nend\n"


def test_a_bilingual_row_of_another_test_set_is_not_set_beside_it() -> None:
    """A multilingual run scored on 200 lines stood beside the bilingual 1000-line row, under a
    header that says "same test set", with their difference."""
    from mtcli.multilingual import combine

    seed = {"directions": {"en-de": {"bleu": 30.0, "bleu_lc": 31.0, "chrf": 55.0, "sentences": 200,
                                     "bleu_lc_signature": "case:lc|tok:13a"}},
            "params": 1e6, "train_steps": 10, "train_minutes": 1.0, "train_tokens_per_s": 1.0, "commit": "c",
            "device": "cpu"}
    bilingual = {"en-de": {"bleu_lc": 41.18, "seeds": ["1", "2", "3"], "test_set": "test_2016_flickr (1000 sentences)"}}
    other = combine({"1": seed}, bilingual)
    assert other["directions"]["en-de"]["bilingual_bleu_lc"] is None
    text = render(other)
    assert "| en-de | 31.00 | – | 31.00 | – | – |" in text
    assert ("- not beside the bilingual rows, scored on other test sets: en-de (test_2016_flickr (1000 sentences); "
            "these: 200 sentences)") in text
    seed["directions"]["en-de"]["sentences"] = 1000
    assert combine({"1": seed}, bilingual)["directions"]["en-de"]["bilingual_bleu_lc"] == 41.18


def test_the_kept_averages_validation_scores_are_those_of_its_window(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """Each direction's val BLEU passed on (as the recipe length penalty's score) is the chosen
    window's, not the last window tried."""
    import mtcli.multilingual

    for step in (10, 20, 30):
        save_checkpoint(tmp_path / "checkpoints" / f"checkpoint_{step}.pt",
                        {"format": 1, "step": step, "model": {"w": torch.full((2,), float(step))}})
    by_k = {"avg1": (30.0, 32.0), "avg2": (35.0, 37.0), "avg3": (33.0, 33.0)}

    def evaluate_directions(run_dir: Path, *, split: str, checkpoint: str, output_dir: Path) -> list[dict]:
        return [{"direction": d, "bleu": b} for d, b in zip(("a-b", "c-d"), by_k[output_dir.name], strict=True)]

    monkeypatch.setattr(mtcli.multilingual, "evaluate_directions", evaluate_directions)
    path, k, by_mean, valid = mtcli.multilingual.choose_average_all(tmp_path, "val", 3)
    assert (path.name, k, by_mean) == ("checkpoint_avg_last2.pt", 2, {"1": 31.0, "2": 36.0, "3": 33.0})
    assert valid == {"a-b": 35.0, "c-d": 37.0}


def test_a_directions_row_holds_the_mean_sample_sd_and_its_difference_to_the_bilingual_row() -> None:
    from mtcli.multilingual import combine

    def seed(bleu_lc: float) -> dict:
        return {"directions": {"en-de": {"bleu": bleu_lc - 1, "bleu_lc": bleu_lc, "chrf": 55.0, "sentences": 1000,
                                         "bleu_lc_signature": "case:lc|tok:13a"}},
                "params": 1e6, "train_steps": 10, "train_minutes": 1.0, "train_tokens_per_s": 1.0, "commit": "c",
                "device": "cpu"}

    bilingual = {"en-de": {"bleu_lc": 29.0, "seeds": ["1", "2"], "test_set": "test_2016_flickr (1000 sentences)"}}
    text = render(combine({"1": seed(30.0), "2": seed(32.0)}, bilingual))
    row = next(line for line in text.splitlines() if line.startswith("| en-de"))
    assert row == "| en-de | 31.00 | 1.41 | 30.00 / 32.00 | 29.00 (2 seeds) | +2.00 |"  # (sd over n - 1)


def test_a_directions_length_penalty_is_chosen_on_its_validation_split_and_test_decoded_once(
        tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    from types import SimpleNamespace

    import mtcli.multilingual

    calls: list[tuple[str, float]] = []

    def evaluate(run_dir: Path, *, split: str, length_penalty: float, **kwargs) -> dict:  # noqa: ANN003
        calls.append((split, length_penalty))
        return {"bleu": 40.0 - abs(length_penalty - 1.4) - 5 * (split == "test"), "device": "cpu"}

    monkeypatch.setattr(mtcli.multilingual, "evaluate", evaluate)
    config = SimpleNamespace(data=SimpleNamespace(valid_split="val", test_splits=["test", "test2"]),
                             decode=SimpleNamespace(length_penalty=1.0))
    row = mtcli.multilingual.score_direction(tmp_path, config, tmp_path / "avg.pt", ("src", "tgt"), recipe_bleu=39.6)
    assert row["length_penalty"] == 1.4 and row["bleu"] == 35.0
    assert calls == [("val", 0.6), ("val", 1.4), ("val", 1.8), ("test", 1.4)]
