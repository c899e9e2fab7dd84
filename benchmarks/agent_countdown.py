"""Countdown as an agent, for measuring a GRPO run through the OpenAI endpoint against the same
run on the task itself (docs/agents.md, "What the endpoint costs").

    asyncrl launch examples/grpo.py --task.name benchmarks/agent_countdown.py:CountdownAgent \
        --model_path MODEL --task.score_timeout_s 120 ...
    asyncrl launch examples/grpo_countdown.py --model_path MODEL ...          # the direct path

Same problems and splits as the `Countdown` task; one chat call per episode whose only message is
the problem's compact prompt (the embedded model's chat template renders it to exactly the
prompt the direct path gives it), scored by Countdown's own score.
"""

from __future__ import annotations

from asyncrl.rl.tasks import Agent, Score
from asyncrl.rl.tasks.countdown import Countdown


class CountdownAgent(Agent):
    name = "countdown_agent"
    max_calls = 1
    correct_reward = Countdown.correct_reward

    def __init__(self, config=None):
        super().__init__(config)
        self.countdown = Countdown()

    def splits(self, seed, n_train, n_heldout):
        return self.countdown.splits(seed, n_train, n_heldout)

    async def run(self, problem, client) -> Score:
        prompt = self.countdown.prompt(problem).compact
        answer = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}])
        return self.countdown.score(problem, answer.choices[0].message.content or "")
