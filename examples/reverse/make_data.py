"""Write the example's data: reverse a string of digits (`483=` -> `384`), a task whose answer is checkable.

    python examples/reverse/make_data.py      # writes train.jsonl, eval.jsonl, demos.jsonl, prefs.jsonl here

train.jsonl / eval.jsonl: {"prompt": "483=", "answer": "384"}, disjoint strings.
demos.jsonl: {"prompt": "483=", "completion": "720"}: the right format (three digits, then the end)
with random digits, so supervised fine-tuning teaches the format and RL has to learn the edit.
prefs.jsonl: {"prompt": "483=", "chosen": "384", "rejected": "348"}: for a reward model (reward=model).
"""

import json
import random
from pathlib import Path

DIGITS = 3
HERE = Path(__file__).parent


def main(seed: int = 0) -> None:
    rng = random.Random(seed)
    strings = [f"{i:0{DIGITS}d}" for i in range(10**DIGITS)]
    rng.shuffle(strings)
    held_out, train = strings[:100], strings[100:]
    write(HERE / "train.jsonl", [{"prompt": f"{s}=", "answer": s[::-1]} for s in train])
    write(HERE / "eval.jsonl", [{"prompt": f"{s}=", "answer": s[::-1]} for s in held_out])
    demos = [{"prompt": f"{s}=", "completion": "".join(rng.choice("0123456789") for _ in range(DIGITS))} for s in train]
    write(HERE / "demos.jsonl", demos)
    prefs = []
    for s in train:
        wrong = list(s[::-1])
        i = rng.randrange(DIGITS)
        wrong[i] = rng.choice([d for d in "0123456789" if d != wrong[i]])
        prefs.append({"prompt": f"{s}=", "chosen": s[::-1], "rejected": "".join(wrong)})
    write(HERE / "prefs.jsonl", prefs)


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
