"""Writes examples/data/word_problems.jsonl: arithmetic word problems from a seeded generator, the
data of the dataset example (`examples/word_problems.py` is its reward).

    python examples/data/make_word_problems.py              # the shipped file (seed 0, 6000 rows)
    python examples/data/make_word_problems.py --check      # exit 1 if the shipped file differs

One JSON object a line: ``prompt`` (what the policy is asked), ``answer`` (an int) and
``demonstration`` (what a perfect model writes: the sum as an equation, then the answer in tags;
the embedded model is warm-started on it). Deterministic for ``--seed`` and ``--n``: the same bytes
on every machine (`random.Random` with a fixed seed, no hashing of str, no set order). Problems are
distinct by prompt, so no held-out problem is also a training problem.

The numbers are small but not tiny: a 1M-parameter character-level model learns the templates at
once and the sums only in part (two-digit carries, times tables), so the warm start solves some
held-out problems, far from all, and GRPO has room.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

NAMES = ["Ann", "Ben", "Cy", "Dee", "Eli", "Fay", "Gus", "Ivy", "Jo", "Kim", "Lea", "Max", "Ned", "Oli", "Pat", "Sam"]
ITEMS = ["apples", "pens", "coins", "cards", "books", "eggs", "shells", "stamps", "cups", "rocks"]


def _add(rng: random.Random) -> tuple[str, int, str]:
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    return f"{name} has {a} {item} and gets {b} more. How many {item} now?", a + b, f"{a}+{b}"


def _sub(rng: random.Random) -> tuple[str, int, str]:
    a = rng.randint(12, 99)
    b = rng.randint(2, a - 1)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    return f"{name} had {a} {item} and gave away {b}. How many are left?", a - b, f"{a}-{b}"


def _mul(rng: random.Random) -> tuple[str, int, str]:
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    return f"{name} buys {a} bags of {b} {item}. How many {item}?", a * b, f"{a}*{b}"


def _div(rng: random.Random) -> tuple[str, int, str]:
    each, kids = rng.randint(2, 12), rng.randint(2, 9)
    item = rng.choice(ITEMS)
    return f"{each * kids} {item} are shared by {kids} kids. How many each?", each, f"{each * kids}/{kids}"


TEMPLATES = [_add, _sub, _mul, _div]


def rows(seed: int, n: int) -> list[dict]:
    """``n`` distinct problems, a template drawn uniformly for each."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict] = []
    for _ in range(50 * n):  # a bound, not a retry loop that could spin: distinct prompts abound
        if len(out) == n:
            break
        prompt, answer, equation = rng.choice(TEMPLATES)(rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "answer": answer, "demonstration": f" {equation}=<answer>{answer}</answer>"})
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct problems found; ask for fewer than {n}")
    return out


def render(seed: int, n: int) -> str:
    """The file's text: one JSON object a line."""
    return "".join(json.dumps(row) + "\n" for row in rows(seed, n))


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=6000, help="rows (default 6000)")
    parser.add_argument("--out", default=os.path.join(here, "word_problems.jsonl"))
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args()
    text = render(args.seed, args.n)
    if args.check:
        with open(args.out) as f:
            same = f.read() == text
        print(f"{args.out}: {'up to date' if same else 'differs from the generator output'}")
        return 0 if same else 1
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.n} problems to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
