"""A generative judge's scores: a causal LM asked, through a prompt template, to judge each
completion, as a `ScorerActor` of kind "judge" serves them (`JudgeScorer`).

The scorer gets token ids; the judge reads text. Each prompt and completion is decoded with the
student's tokenizer, put into the template (``{prompt}``, ``{completion}``) and encoded with the
judge's own, so a judge need not share the student's tokenizer. The verdict is read one of two
ways (``--reward_model.judge_read``):

- ``logprob`` (the default): one prefill of the templated text, and the score is the judge's
  probability of the first verdict token against the second at the next position,
  ``p(yes) / (p(yes) + p(no))`` = ``sigmoid(log p(yes) - log p(no))``, in [0, 1]. Deterministic,
  one forward a completion (batched like the reward model's), nothing to parse, a graded score
  rather than a coin flip of sampling; it needs each verdict word to be one token of the judge's.
  Chosen as the default for these reasons; the probability mass outside the two words is not
  looked at (a judge that would rather say something else still gets a score).
- ``generate``: greedy generation of up to ``max_new_tokens`` after the templated text, and the
  first group of the regular expression ``verdict`` (the whole match if it has none) read as a
  number: for judges prompted to write a grade ("Score: 7"). An output it does not match, or
  whose match is not a finite number, is an unparsed verdict: ``None`` in place of the score,
  counted by the driver (`driver/teacher.py`'s `RewardModel`), never an exception.
"""

from __future__ import annotations

import math
import re

import torch

from asyncrl.rl.config.teacher import DEFAULT_VERDICT
from asyncrl.rl.scorer.base import Scored
from asyncrl.rl.scoring.batch import ScoreRequest

CPU = torch.device("cpu")
_FIELD = re.compile(r"\{prompt\}|\{completion\}")


class JudgeError(ValueError):
    """The judge, its template or its verdict cannot be used as configured; the message names the flag."""


def render(template: str, prompt: str, completion: str) -> str:
    """``template`` with ``{prompt}`` and ``{completion}`` replaced, in one pass (a completion that
    contains the text ``{prompt}`` stays as written; no other braces are read)."""
    return _FIELD.sub(lambda m: prompt if m.group(0) == "{prompt}" else completion, template)


def parse_verdict(pattern: re.Pattern, text: str) -> float | None:
    """The number ``pattern`` finds in ``text`` (its first group, or the whole match), or None when
    it finds none or what it finds is not a finite number."""
    found = pattern.search(text)
    if found is None:
        return None
    try:
        value = float(found.group(1) if pattern.groups else found.group(0))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


class Judge:
    """The judge at ``model_path`` on ``device``, reading the student's token ids with the
    tokenizer at ``student_path``. ``read``: "logprob" (``verdict_tokens``, two words) or
    "generate" (``verdict``, a regular expression; ``max_new_tokens``). See the module docstring."""

    def __init__(
        self,
        model_path: str,
        student_path: str,
        template: str,
        *,
        read: str = "logprob",
        verdict_tokens: tuple[str, str] = ("yes", "no"),
        verdict: str = DEFAULT_VERDICT,
        max_new_tokens: int = 16,
        device: torch.device = CPU,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if read not in ("logprob", "generate"):
            raise JudgeError(f"--reward_model.judge_read must be 'logprob' or 'generate', not {read!r}")
        if "{completion}" not in template:
            raise JudgeError(
                "the judge's template (--reward_model.template) has no {completion}: the judge would "
                "never see what it judges"
            )
        self.read, self.template, self.device, self.max_new_tokens = read, template, device, max_new_tokens
        self.student = AutoTokenizer.from_pretrained(student_path, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, local_files_only=True, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
        )
        self.model.to(device).eval().requires_grad_(False)
        pad = self.tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.tokenizer.eos_token_id
        if read == "logprob":
            ids = [self.tokenizer.encode(word, add_special_tokens=False) for word in verdict_tokens]
            if len(verdict_tokens) != 2 or any(len(i) != 1 for i in ids):
                raise JudgeError(
                    f"--reward_model.verdict_tokens {','.join(verdict_tokens)}: two words, each one token "
                    f"of the judge's tokenizer, are needed; they encode as {ids} (other words, or "
                    "--reward_model.judge_read generate)"
                )
            self.verdict_ids = (ids[0][0], ids[1][0])
        else:
            try:
                self.pattern = re.compile(verdict)
            except re.error as exc:
                raise JudgeError(f"--reward_model.verdict {verdict!r} is not a regular expression: {exc}") from None
            if self.pattern.groups > 1:
                raise JudgeError(
                    f"--reward_model.verdict {verdict!r} has {self.pattern.groups} groups: one (the "
                    "number) or none (the whole match) is read"
                )

    def texts(self, requests: list[ScoreRequest]) -> list[list[str]]:
        """The judge's input text for each completion of each ``(prompt, completions)`` request."""
        decode = lambda ids: self.student.decode(ids, skip_special_tokens=True)  # noqa: E731
        return [
            [render(self.template, decode(prompt), decode(c)) for c in completions] for prompt, completions in requests
        ]

    @torch.no_grad()
    def score(self, requests: list[ScoreRequest], budget: int) -> tuple[list[list[float | None]], int]:
        """One score (None: an unparsed verdict) per completion of each request, and the forwards
        (or generate calls) it took, at most ``budget`` padded tokens each."""
        rows = [
            (r, j, self.tokenizer.encode(text))
            for r, texts in enumerate(self.texts(requests))
            for j, text in enumerate(texts)
        ]
        rows.sort(key=lambda row: len(row[2]))  # similar lengths together: less padding
        out: list[list[float | None]] = [[None] * len(completions) for _, completions in requests]
        calls, start = 0, 0
        while start < len(rows):
            end = start + 1
            while end < len(rows) and (len(rows[end][2]) + self._extra()) * (end + 1 - start) <= budget:
                end += 1
            chunk = rows[start:end]
            for (r, j, _), score in zip(chunk, self._chunk([ids for _, _, ids in chunk])):
                out[r][j] = score
            calls += 1
            start = end
        return out, calls

    def _extra(self) -> int:
        return self.max_new_tokens if self.read == "generate" else 0

    def _chunk(self, seqs: list[list[int]]) -> list[float | None]:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        attention = torch.zeros(len(seqs), width, dtype=torch.long)
        if self.read == "logprob":  # right-padded: the verdict is read after each row's last real token
            for i, s in enumerate(seqs):
                ids[i, : len(s)], attention[i, : len(s)] = torch.tensor(s), 1
            ids, attention = ids.to(self.device), attention.to(self.device)
            logits = self.model(input_ids=ids, attention_mask=attention).logits
            last = logits[torch.arange(len(seqs), device=self.device), attention.sum(1) - 1].float()
            yes, no = self.verdict_ids
            return torch.sigmoid(last[:, yes] - last[:, no]).tolist()  # log_softmax's normaliser cancels
        for i, s in enumerate(seqs):  # left-padded: generation continues every row from its end
            ids[i, width - len(s) :], attention[i, width - len(s) :] = torch.tensor(s), 1
        generated = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=attention.to(self.device),
            max_new_tokens=self.max_new_tokens,
            do_sample=False,
            pad_token_id=self.pad,
        )
        texts = self.tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True)
        return [parse_verdict(self.pattern, text) for text in texts]


class JudgeScorer:
    """A `Judge` as a scorer: one verdict per completion, None where it did not parse, counted."""

    kind = "judge"
    endpoint = "rewards"
    # a judge reads the student's ids with the student's tokenizer (the driver passes its path)
    vocabulary = "the vocabulary of {n} of the student's tokenizer, which the judge decodes completions with"

    def __init__(self, judge: Judge):
        self.judge = judge
        self.vocab = len(self.judge.student)  # requests carry the student's token ids

    def score(self, requests: list[ScoreRequest], budget: int) -> Scored:
        scores, calls = self.judge.score(requests, budget)
        return Scored(scores, calls, unparsed=sum(s is None for row in scores for s in row))
