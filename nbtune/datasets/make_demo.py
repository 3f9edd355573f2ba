"""Generate the instruction dataset that ships with nbtune (the embedded default).

Tasks a ~1 M-parameter model can visibly learn in about a minute on 2 CPU cores.
The held-out split has inputs that never appear in training.

    python -m nbtune.datasets.make_demo   # rewrites nbtune/datasets/demo/*.jsonl
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "demo"
CONSONANTS = "bcdfghjklmnpqrstvwxz"


def hide(rng: random.Random, pool: str) -> str:
    """3-5 random consonants with one character of ``pool`` inserted at a random place."""
    chars = [rng.choice(CONSONANTS) for _ in range(rng.randint(3, 5))]
    chars.insert(rng.randint(0, len(chars)), rng.choice(pool))
    return "".join(chars)


def the_one(pool: str):
    return lambda text: next(c for c in text if c in pool)


# A ~1 M-parameter model trained from random weights learns tasks it can solve by
# looking for a kind of character (content) within a few hundred steps, and needs
# thousands for tasks that copy by position. Measured on 2 CPU cores with the demo model
# (batch 16, lr 1e-3): after 500 steps, vowel 88-100 % and parity 92 % held-out, digit and
# capital at most 24 %; "last letter" and reversal stayed at 0-10 % after 1000 steps.
# So the mix is graded: parity and vowel are learned in about a minute, the others later.
TASKS = {
    # name: (instruction, make an input, answer it)
    "parity": ("Is the number even or odd?", lambda rng: str(rng.randint(0, 999)),
               lambda s: "even" if int(s) % 2 == 0 else "odd"),
    "vowel": ("Which vowel is in the word?", lambda rng: hide(rng, "aeiou"), the_one("aeiou")),
    "digit": ("Which digit is in the word?", lambda rng: hide(rng, "0123456789"),
              the_one("0123456789")),
    "capital": ("Which letter is a capital?", lambda rng: hide(rng, "ABCDEFGHIJKLMNOPQRSTUVWXYZ"),
                the_one("ABCDEFGHIJKLMNOPQRSTUVWXYZ")),
}


def main(train_per_task: int = 600, heldout_per_task: int = 25, seed: int = 1234) -> None:
    rng = random.Random(seed)
    train, heldout = [], []
    for name, (instruction, make, answer) in TASKS.items():
        seen: set[str] = set()
        for split, count in ((heldout, heldout_per_task), (train, train_per_task)):
            while count:
                value = make(rng)
                if value in seen:
                    continue
                seen.add(value)
                split.append({"task": name, "instruction": instruction, "input": value,
                              "output": answer(value)})
                count -= 1
    rng.shuffle(train)
    OUT.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("heldout", heldout)):
        with open(OUT / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{OUT / name}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
