"""Generate the toy parallel corpus in tests/fixtures/toy (deterministic; committed).

The "translation" maps each source word to a fixed target word, keeping word order, so a
one-layer model learns it in seconds: enough to test that training and search really work.
Run: python tests/make_toy_corpus.py [OUT_DIR]
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

SRC_WORDS = (
    "der die das ein eine hund katze mann frau kind haus baum ball rot blau gross klein "
    "laeuft springt sitzt spielt sieht im auf unter neben"
).split()
TGT_WORDS = (
    "the the the a a dog cat man woman child house tree ball red blue big small "
    "runs jumps sits plays sees in on under beside"
).split()
LEXICON = dict(zip(SRC_WORDS, TGT_WORDS, strict=True))
SPLITS = {"train": 600, "val": 40, "test": 40}


def make_pairs(n: int, rng: random.Random) -> list[tuple[str, str]]:
    """``n`` random sentence pairs of 3-8 words, target = word-by-word lexicon lookup."""
    pairs = []
    for _ in range(n):
        words = [rng.choice(SRC_WORDS) for _ in range(rng.randint(3, 8))]
        pairs.append((" ".join(words), " ".join(LEXICON[w] for w in words)))
    return pairs


def write_corpus(out_dir: Path, seed: int = 7, sizes: dict[str, int] | None = None) -> None:
    """Write ``<split>.src`` / ``<split>.tgt`` files for every split."""
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, n in (sizes or SPLITS).items():
        pairs = make_pairs(n, rng)
        (out_dir / f"{split}.src").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
        (out_dir / f"{split}.tgt").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")


if __name__ == "__main__":
    write_corpus(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "fixtures" / "toy")
