"""The results table is rendered from results JSON and replaces the README's results block."""

from __future__ import annotations

import json
from pathlib import Path

from mtcli.reproduce import MARK_END, MARK_START, render_markdown, write_results

ROW = {
    "bleu": 38.123, "bleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
    "bleu_lc": 40.5, "bleu_lc_signature": "nrefs:1|case:lc|eff:no|tok:13a|smooth:exp|version:2.6.0",
    "chrf": 60.25, "chrf_signature": "nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0",
    "params": 9_500_000, "train_minutes": 59.9, "train_tokens_per_s": 3210.4,
    "decode_sents_per_s": 101.2, "device": "CPU (x86_64, 2 cores)", "commit": "abc1234",
}


def test_render_has_a_row_per_direction_and_signatures() -> None:
    text = render_markdown({"en-de": ROW, "de-en": dict(ROW, bleu=41.0)})
    rows = [line for line in text.splitlines() if line.startswith("| de-en") or line.startswith("| en-de")]
    assert rows[0].startswith("| de-en | 41.00 | 40.50 | 60.25 | 9.5M | 59.9 | 3,210 | 101.2")
    assert rows[1].startswith("| en-de | 38.12")
    assert ROW["bleu_signature"] in text and ROW["chrf_signature"] in text


def test_write_results_updates_json_md_and_readme(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{MARK_START}\nold table\n{MARK_END}\n\nafter\n", encoding="utf-8")
    write_results({"de-en": ROW}, results_dir=tmp_path / "results", readme=readme)
    data = json.loads((tmp_path / "results" / "multi30k.json").read_text())
    assert data["de-en"]["bleu"] == ROW["bleu"]
    md = (tmp_path / "results" / "multi30k.md").read_text()
    text = readme.read_text()
    assert "old table" not in text and md in text and text.endswith("after\n")
