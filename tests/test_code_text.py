"""No measurement in the code's own text: what a docstring, a comment or ``--help`` says stays true
as the code changes, a figure measured on one machine on one day does not. Figures live in
benchmarks/README.md and docs/, with their date and machine; the code keeps the reason and names
the page.

Checked: every docstring, comment and ``help=`` string under asyncrl/, and the help a user reads
(``asyncrl --help`` and each subcommand's, a GRPO script's ``--help``), for the marks of a
measurement: a GPU kind, a date, a rate in samples or tokens a second, a ratio against TRL, an MFU.
And README.md's opening: what asyncrl is and the two commands on its first screen, no figure before
its table of results, the test command the one .ci/run runs.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import re
import tokenize

import pytest

import asyncrl
from asyncrl.cli_parser import build_parser
from asyncrl.rl.config import grpo_config_type, help_text
from asyncrl.rl.launch import OPTIONS
from asyncrl.rl.tasks.loading import task_class

ROOT = os.path.dirname(asyncrl.__file__)

MEASUREMENT = re.compile(
    r"\b(?:H100|H200|H800|A100|A800|B200|L40S?|MI300X?|EPYC|Xeon)\b"  # a machine
    r"|\b20\d\d-[01]\d(?:-[0-3]\d)?\b"  # a date
    r"|\d\s*(?:k\s*)?(?:samples|tokens|tok)/s\b"  # a rate
    r"|\d(?:\.\d+)?\s*x\s+TRL\b"  # a ratio against TRL
    r"|\d(?:\.\d+)?\s*%\s*MFU\b|\bMFU\s+(?:of\s+)?\d"  # a utilisation
)


def _texts(path: str) -> list[tuple[int, str]]:
    """(line, text) of every docstring (a string standing alone as a statement: a module's, a
    class's, a function's, or an attribute's below it), ``help=`` string and comment in ``path``."""
    with open(path) as f:
        source = f.read()
    found = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found += [(node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
        elif isinstance(node, ast.keyword) and node.arg in ("help", "description", "epilog"):
            found += [(node.lineno, s.value) for s in ast.walk(node.value) if isinstance(s, ast.Constant)]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found.append((tok.start[0], tok.string))
    return found


def _sources() -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(ROOT) for f in files if f.endswith(".py"))


def test_the_marks_of_a_measurement_are_recognised():
    for text in (
        "on an H100: step 0.842 -> 0.649 s",
        "(2026-11-25, benchmarks/README.md)",
        "1.5B async 62.7 samples/s",
        "from 27.5k to 19.3k tokens/s",
        "2.64x TRL's GRPOTrainer",
        "29.5% MFU at 0.5B",
        "an MFU of 41.0%",
    ):
        assert MEASUREMENT.search(text), text
    for text in ("tokens/s of the sampler", "MFU is reported every step", "a 16k-token micro-batch", "0.5B"):
        assert not MEASUREMENT.search(text), text


def test_no_docstring_comment_or_help_string_in_asyncrl_holds_a_measurement():
    sources = _sources()
    assert len(sources) > 100  # the whole package was read
    found = [
        f"{os.path.relpath(path, ROOT)}:{line}: {text.strip()}"
        for path in sources
        for line, text in _texts(path)
        if MEASUREMENT.search(text)
    ]
    assert not found, "move these figures to benchmarks/README.md or docs/, keep the reason:\n" + "\n".join(found)


def _subcommand_helps(parser: argparse.ArgumentParser) -> list[str]:
    texts = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            texts += [sub.format_help() for sub in action.choices.values()]
    return texts


def test_the_help_a_user_reads_holds_no_measurement():
    helps = _subcommand_helps(build_parser())
    assert len(helps) > 5  # asyncrl's own and its subcommands'
    config = grpo_config_type(task_class("countdown"))()
    helps.append(help_text(config, OPTIONS))
    assert "--trainer.compile" in helps[-1] and "--sampler.per_gpu" in helps[-1]  # every key's docstring is in it
    found = [line.strip() for text in helps for line in text.splitlines() if MEASUREMENT.search(line)]
    assert not found, found


@pytest.mark.parametrize("kind", ["docstring", "comment"])
def test_a_measurement_in_the_code_would_be_found(tmp_path, kind):
    path = tmp_path / "module.py"
    text = '"""Fast: 77.7 samples/s on one H100."""\n' if kind == "docstring" else "x = 1  # 2026-11-28: 9 ms\n"
    path.write_text(text)
    assert [line for _, line in _texts(str(path)) if MEASUREMENT.search(line)]


# --- the front door: README.md ----------------------------------------------------------------------

REPO = os.path.dirname(ROOT)
MAIN_JOB = "pip install -e '.[observe]' && asyncrl launch examples/grpo_countdown.py"
TESTS = "pip install -e '.[test,lora,observe,agents]' && python -m pytest -q -n 2 --dist loadfile"
FIGURE = re.compile(r"\d(?:[.,]\d+)?\s*(?:s|ms|us|min|minutes|hours|%|x|GiB|GB|MB|samples/s|tokens/s)\b")


def test_the_readme_opens_with_what_it_is_and_the_two_commands_and_no_figure():
    with open(os.path.join(REPO, "README.md")) as f:
        lines = f.read().splitlines()
    first_screen = lines[:40]
    cpu_torch = next(i for i, line in enumerate(first_screen) if "download.pytorch.org/whl/cpu" in line)
    assert cpu_torch < first_screen.index(MAIN_JOB) and cpu_torch < first_screen.index(TESTS)
    opening = lines[: lines.index("## Results")]  # what it is, how to run it: figures come after
    assert [line for line in opening if FIGURE.search(line)] == []
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = f.read()
    assert "pip install -q -e '.[test,lora,observe,agents]'" in ci  # the README's test command, as CI runs it
    assert "python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile" in ci
