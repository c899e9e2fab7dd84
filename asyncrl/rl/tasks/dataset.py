"""Problems from a file on disk: rows of JSONL or Parquet (`load_rows`), the default train and
held-out splits of a task's problems (`default_splits`), the default fingerprint of a task for the
warm start's cache key (`default_fingerprint`), and the task a data file plus a reward function
make (`RewardFunctionTask`).

Rows are data, never code: JSON is parsed by msgspec, Parquet read by pyarrow (optional: ``pip
install pyarrow``), and nothing in a row is evaluated. A file that cannot give rows is a one-line
`DatasetError` naming the file and the line (JSONL) or row (Parquet).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from asyncrl.rl.tasks.base import Splits, Task, TaskError, as_prompt, default_splits

PARQUET_SUFFIXES = (".parquet", ".pq")
"""A data file with one of these suffixes is read as Parquet; any other as JSONL."""


class DatasetError(TaskError, ValueError):
    """A data file gives no rows: missing, a directory, empty, a malformed line or a row that is
    not an object (a JSON object, a Parquet record). One line naming the file and the line or row."""


def load_rows(path: str) -> list[dict[str, Any]]:
    """The rows of the JSONL or Parquet file ``path`` (by its suffix: .parquet or .pq is Parquet),
    each a dict; blank JSONL lines are skipped. `DatasetError` for a file without rows."""
    return read_rows(path)[0]


def read_rows(path: str) -> tuple[list[dict[str, Any]], list[str]]:
    """`load_rows` and where each row is in the file (``"line 3"``, ``"row 2"``), for messages
    about a row that come after loading (a row without its prompt)."""
    if not os.path.exists(path):
        raise DatasetError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DatasetError(f"{path}: a directory, not a data file (JSONL or Parquet)")
    rows, where = _parquet(path) if path.lower().endswith(PARQUET_SUFFIXES) else _jsonl(path)
    if not rows:
        raise DatasetError(f"{path}: no rows (an empty file)")
    return rows, where


def _jsonl(path: str) -> tuple[list[dict[str, Any]], list[str]]:
    decoder = msgspec.json.Decoder()
    rows, where = [], []
    try:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = decoder.decode(line)
                except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # malformed JSON, or not UTF-8
                    raise DatasetError(f"{path}: line {number}: not valid JSON ({exc})") from None
                if not isinstance(row, dict):
                    raise DatasetError(
                        f"{path}: line {number}: a row must be a JSON object ({{...}}), not {_json_kind(row)}"
                    )
                rows.append(row)
                where.append(f"line {number}")
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    return rows, where


def _json_kind(value: Any) -> str:
    kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _parquet(path: str) -> tuple[list[dict[str, Any]], list[str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow's errors (ArrowInvalid, OSError, ...) have no common base
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DatasetError(f"{path}: cannot read it as Parquet ({reason})") from None
    for number, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(f"{path}: row {number}: a row must be a record, not {type(row).__name__}")
    return rows, [f"row {number}" for number in range(len(rows))]


# --- splits and fingerprint -----------------------------------------------------------------------


# --- a data file and a reward function --------------------------------------------------------------


RewardFunction = Callable[[dict[str, Any], str], Any]
"""``fn(row, completion) -> float | Score`` (or an awaitable of one)."""


class RewardFunctionTask(Task[dict]):
    """The task of ``--task.data`` rows scored by a user's function (``--task.reward
    file.py:fn``): the prompt is the row's ``prompt_key`` (a string, or a list of ``{"role",
    "content"}`` messages), the score ``fn(row, completion)`` (sync or async, a float or a
    `Score`). A row may carry ``"demonstration"``: the text a perfect model writes, which the
    embedded model is warm-started on (without it, give ``--model_path``). Other keys (an
    ``"answer"``, say) are the reward function's to read. Built by `asyncrl.rl.tasks.loading.load_task`,
    which names the class after the user's function as given (``my_reward.py:reward``)."""

    name = "reward_fn"
    fn: RewardFunction

    def __init__(self, fn: RewardFunction, prompt_key: str = "prompt"):
        super().__init__(None)
        self.fn = fn
        self.prompt_key = prompt_key

    @classmethod
    def of(cls, fn: RewardFunction, ref: str = "") -> type[RewardFunctionTask]:
        """A subclass named after ``fn``, as ``ref`` (``--task.reward``) gives it: ``my_reward.py:reward``
        for a file (its name, not its path), ``package.module:reward`` for a module; logs and errors
        then say whose function it is. Without ``ref``, ``reward_fn:<name>``."""
        name = getattr(fn, "__name__", type(fn).__name__)
        target, _, attr = ref.rpartition(":")
        shown = f"{os.path.basename(target)}:{attr}" if target else f"reward_fn:{name}"
        return type(f"RewardFunctionTask[{name}]", (cls,), {"name": shown, "__module__": __name__})

    def check_rows(self, rows: Sequence[dict[str, Any]], where: Sequence[str], path: str) -> None:
        """Every row has a prompt under ``prompt_key``: a `DatasetError` naming the first that
        does not, and its line, before any process is spawned."""
        for row, at in zip(rows, where):
            value = row.get(self.prompt_key)
            if value is None:
                keys = ", ".join(map(repr, list(row)[:8])) or "none"
                raise DatasetError(
                    f"{path}: {at}: no {self.prompt_key!r} key (--task.prompt_key {self.prompt_key}); its keys: {keys}"
                )
            try:
                as_prompt(value)
            except TaskError as exc:
                raise DatasetError(f"{path}: {at}: {self.prompt_key!r}: {exc}") from None

    def splits(self, seed: int | str, n_train: int, n_heldout: int) -> Splits:
        """As `Task.splits`, seeded by the data alone: runs that differ only in their reward
        function hold out the same rows, so their solve rates compare."""
        return default_splits(self, seed, n_train, n_heldout, salt="data")

    def prompt(self, problem: dict[str, Any]) -> Any:
        return problem[self.prompt_key]

    def score(self, problem: dict[str, Any], completion: str) -> Any:
        return self.fn(problem, completion)

    def demonstration(self, problem: dict[str, Any]) -> str | None:
        """The row's ``"demonstration"`` if it is a string (the completion a perfect model writes)."""
        value = problem.get("demonstration")
        return value if isinstance(value, str) else None
