"""An actor whose endpoint raises the trainer's `TrainerMemoryError` (a module of its own: it
imports the trainer, torch and all, which the other test actors need not)."""

from __future__ import annotations

from asyncrl import Actor, endpoint
from asyncrl.rl.trainer.out_of_memory import TrainerMemoryError


class RunsOutOfMemory(Actor):
    @endpoint
    async def train_step(self) -> None:
        raise TrainerMemoryError(
            "train step 1 ran out of cuda memory on a micro-batch of 8 x 512 tokens "
            "(--trainer.micro_batch_tokens 4096): lower that"
        )


class PolicyTooBig(Actor):
    """A constructor that fails as the trainer's does when the policy does not fit its GPU."""

    def __init__(self):
        raise TrainerMemoryError(
            "the policy of /ckpt does not fit in the trainer's GPU's 79 GiB: train LoRA "
            "adapters (--trainer.lora.rank 16)\n(a second line, left out)"
        )
