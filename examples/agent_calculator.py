"""The calculator task (examples/calculator.py) as an agent written against the OpenAI API.

    asyncrl launch examples/agent_calculator.py                                  # the embedded model
    asyncrl launch examples/agent_calculator.py --model_path ~/ckpt/Qwen2.5-0.5B-Instruct
    asyncrl launch examples/grpo.py --task.name examples/agent_calculator.py:CalculatorAgent ...  # the same task

The agent offers the model a ``calculator`` tool (``tools=[{"type": "function", ...}]``, the real
``openai`` client), runs each call itself and sends the result back as a ``tool`` message, until
the model answers ``<answer>N</answer>`` or has made ``max_calls`` calls. Reward 1 for the exact
answer; the metrics say how often episodes used the tool (``tool_used``) and used it correctly
(``tool_used_correctly``: a call whose result is the answer), as the environment's do, and how
often the conversation outgrew the model (``context_exceeded``: the endpoint refused the next call
with OpenAI's ``context_length_exceeded``; the episode ends unanswered, scored 0). Nothing here
knows about tokens: the sampler's endpoint records them, and docs/agents.md says what is trained.

Without ``--model_path`` the embedded model is warm-started on `CalculatorAgent.demonstration`:
conversations in OpenAI messages that call the tool for some problems only, as the environment's
traces do (`calculator.TOOL_RATE`, more often for a product than for a sum), rendered through the
embedded agent template as the endpoint renders the episodes (its compact call form,
``<tool_call>calculator expression=47 * 38</tool_call>``, the result in ``<tool_response>``). The
model learns a per-operator chance of calling the tool and answers the rest itself, mostly
wrongly: GRPO, through the endpoint, has both the solve rate and the share of episodes that use
the tool to raise. (Measured, docs/agents.md: greedily 0.19 of the held-out problems solved
before GRPO, 0.43 after the default 50 steps, 0.54 after 100.) A checkpoint's own chat template
(Qwen2.5, Hermes) describes ``TOOLS`` to the model instead.

The calculator is asyncrl's bounded arithmetic parser: the model's arguments are parsed, never
``eval``-ed.
"""

from __future__ import annotations

import json
import random
import sys

import openai
from calculator import TOOL_RATE, Arithmetic, answer_value, make_problems  # the environment's problems

from asyncrl.rl.launch import grpo_main
from asyncrl.rl.tasks import Agent, Score
from asyncrl.rl.tasks.tools import calculator

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "The exact value of an arithmetic expression (+ - * / and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]

# grpo.py's defaults, and room for an episode: its three calls wait for the batch's generations
# (--task.score_timeout_s bounds the whole episode). 50 steps: about 15 minutes on two loaded CPU
# cores, the warm start included; --run.steps 100 goes on learning (docs/agents.md has both).
DEFAULTS = [
    "--sampler.temperature",
    "0.7",
    "--trainer.lr_schedule",
    "cosine",
    "--task.score_timeout_s",
    "120",
    "--run.steps",
    "50",
    "--run.eval_every",
    "25",
]


class CalculatorAgent(Agent):
    name = "calculator_agent"
    max_calls = 3  # a call, perhaps a second one, an answer

    def problems(self) -> list[Arithmetic]:
        if not hasattr(self, "_problems"):  # built once per process
            self._problems = make_problems()
        return self._problems

    async def run(self, problem: Arithmetic, client) -> Score:
        messages = [_question(problem)]
        used = used_correctly = overflowed = 0.0
        content = ""
        for _ in range(self.max_calls):
            try:
                reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            except openai.BadRequestError as exc:
                if exc.code != "context_length_exceeded":
                    raise
                # The conversation outgrew the model's positions (a long call, then its result):
                # the model gave no answer, scored 0 as one; not a failure of this code.
                overflowed = 1.0
                break
            message = reply.choices[0].message
            content = message.content or ""
            if not message.tool_calls:
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                value = calculator(_expression(call.function.arguments))
                used = 1.0
                used_correctly = max(used_correctly, float(value == str(problem.answer)))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": value})
        correct = answer_value(content) == problem.answer
        metrics = {"tool_used": used, "tool_used_correctly": used_correctly, "context_exceeded": overflowed}
        return Score(float(correct), correct=correct, metrics=metrics)

    def demonstration(self, problem: Arithmetic) -> list[dict]:
        """A solver's episode: a call for the problems picked to use the tool (the environment's
        pick: a seeded draw per problem, `TOOL_RATE` of each operator), its result, the answer."""
        answer = {"role": "assistant", "content": f"<answer>{problem.answer}</answer>"}
        if random.Random(f"tool/{problem.expression}").random() >= TOOL_RATE[problem.op]:
            return [_question(problem), answer]
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": problem.expression})},
        }
        return [
            _question(problem),
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": calculator(problem.expression)},
            answer,
        ]


def _question(problem: Arithmetic) -> dict:
    return {"role": "user", "content": f"{problem.expression} = ? Reply <answer>N</answer>."}


def _expression(arguments: str) -> str:
    """The ``expression`` argument of a call (model output: parsed as JSON, never evaluated)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return ""
    return str(value.get("expression", "")) if isinstance(value, dict) else ""


async def main() -> int:
    return await grpo_main(sys.argv[1:], __doc__, default_task="agent_calculator.py:CalculatorAgent", defaults=DEFAULTS)
