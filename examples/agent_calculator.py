"""The calculator task (examples/calculator.py) as an agent written against the OpenAI API.

    asyncrl launch examples/grpo.py --task.name examples/agent_calculator.py:CalculatorAgent \
        --model_path ~/ckpt/Qwen2.5-0.5B-Instruct --task.score_timeout_s 120

The agent offers the model a ``calculator`` tool (``tools=[{"type": "function", ...}]``, the real
``openai`` client), runs each call itself and sends the result back as a ``tool`` message, until
the model answers ``<answer>N</answer>`` or has made ``max_calls`` calls. Reward 1 for the exact
answer; the metrics say how often episodes used the tool and used it correctly, as the
environment's do. Nothing here knows about tokens: the sampler's endpoint records them, and
docs/agents.md says what is trained.

The model needs a chat template with tools (Qwen2.5, Hermes: ``<tool_call>`` JSON); the embedded
model's template takes one user message only, so ``--model_path`` is required. The calculator
is asyncrl's bounded arithmetic parser: the model's arguments are parsed, never ``eval``-ed.
"""

from __future__ import annotations

import json

from asyncrl.rl.tasks import Agent, Score
from asyncrl.rl.tasks.tools import calculator
from calculator import Arithmetic, answer_value, make_problems  # the environment's problems and answer format

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "The exact value of an arithmetic expression (+ - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


class CalculatorAgent(Agent):
    name = "calculator_agent"
    max_calls = 3  # a call, perhaps a second one, an answer

    def problems(self) -> list[Arithmetic]:
        if not hasattr(self, "_problems"):  # built once per process
            self._problems = make_problems()
        return self._problems

    async def run(self, problem: Arithmetic, client) -> Score:
        messages = [{"role": "user", "content": f"{problem.expression} = ? Reply <answer>N</answer>."}]
        used = used_correctly = 0.0
        for _ in range(self.max_calls):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            if not message.tool_calls:
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                value = calculator(_expression(call.function.arguments))
                used = 1.0
                used_correctly = max(used_correctly, float(value == str(problem.answer)))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": value})
        correct = answer_value(message.content or "") == problem.answer
        return Score(float(correct), correct=correct, metrics={"tool_used": used, "tool_used_correctly": used_correctly})


def _expression(arguments: str) -> str:
    """The ``expression`` argument of a call (model output: parsed as JSON, never evaluated)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return ""
    return str(value.get("expression", "")) if isinstance(value, dict) else ""
