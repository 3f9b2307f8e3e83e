"""The harness benchmark's tasks: arithmetic word problems and string puzzles with one checkable
answer each, made by a seeded generator (the same seed, the same tasks, on any machine). Numbers
are large enough that a small model gets them wrong in its head more often than with a program.

    python -m bench.harness_tasks --count 5     # print a few
"""

from __future__ import annotations

import argparse
import random
import re
from dataclasses import dataclass

WORDS = (
    "strawberry banana bookkeeper mississippi parallel committee balloon necessary occurrence "
    "accommodate embarrass harbour lighthouse afternoon watermelon keyboard programming "
    "assessment successful referee"
).split()
NAMES = "Ana Ben Chloe Dev Ema Farid Grace Hugo Iris Jonas".split()


@dataclass(frozen=True)
class Task:
    id: str
    kind: str  # "arithmetic" or "string"
    question: str
    answer: str  # an integer's digits, or a word

    def solved_by(self, text: str) -> bool:
        """Whether an answer `text` gives this task's answer: for a number, the last number it
        writes (thousands separators aside); for a word, the word anywhere, case aside."""
        if self.kind == "arithmetic":
            numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
            if not numbers:
                return False
            last = numbers[-1].replace(",", "")
            try:
                return float(last) == float(self.answer)
            except ValueError:
                return False
        return re.search(rf"\b{re.escape(self.answer)}\b", text, re.IGNORECASE) is not None


def _arithmetic(rng: random.Random, n: int) -> Task:
    name = rng.choice(NAMES)
    kind = n % 4
    if kind == 0:
        price, count = rng.randint(13, 97), rng.randint(101, 499)
        note = ((price * count) // 1000 + 1) * 1000
        q = (
            f"A pencil costs {price} cents. {name} buys {count} pencils and pays with "
            f"{note} cents. How many cents of change does {name} get?"
        )
        return Task(f"a{n}", "arithmetic", q, str(note - price * count))
    if kind == 1:
        a, b, c, d = (
            rng.randint(41, 139),
            rng.randint(3, 17),
            rng.randint(41, 139),
            rng.randint(3, 17),
        )
        q = (
            f"A train runs at {a} km/h for {b} hours, then at {c} km/h for {d} hours. "
            "How many kilometres does it run in all?"
        )
        return Task(f"a{n}", "arithmetic", q, str(a * b + c * d))
    if kind == 2:
        friends, each = rng.randint(7, 23), rng.randint(13, 47)
        start = friends * each + rng.randint(100, 999)
        q = (
            f"{name} has {start} marbles and gives {each} marbles to each of {friends} friends. "
            "How many marbles are left?"
        )
        return Task(f"a{n}", "arithmetic", q, str(start - friends * each))
    rows, cols, missing = rng.randint(23, 89), rng.randint(23, 89), rng.randint(11, 99)
    q = (
        f"A hall has {rows} rows of {cols} seats, and {missing} seats are broken. "
        "How many seats can be used?"
    )
    return Task(f"a{n}", "arithmetic", q, str(rows * cols - missing))


def _string(rng: random.Random, n: int) -> Task:
    word = rng.choice(WORDS)
    kind = (n // 3) % 3  # (n is 2 mod 3 here)
    if kind == 0:
        letter = rng.choice(sorted(set(word)))
        q = f"How many times does the letter '{letter}' appear in the word '{word}'?"
        return Task(f"s{n}", "arithmetic", q, str(word.count(letter)))
    if kind == 1:
        q = f"Write the word '{word}' backwards. Give the reversed word."
        return Task(f"s{n}", "string", q, word[::-1])
    q = f"Sort the letters of '{word}' in alphabetical order and give them as one word."
    return Task(f"s{n}", "string", q, "".join(sorted(word)))


def tasks(count: int = 100, seed: int = 2026) -> list[Task]:
    """`count` tasks, two arithmetic problems to each string puzzle."""
    rng = random.Random(seed)
    return [_string(rng, n) if n % 3 == 2 else _arithmetic(rng, n) for n in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()
    for task in tasks(args.count, args.seed):
        print(f"{task.id:5} {task.answer:>12}  {task.question}")


if __name__ == "__main__":
    main()
