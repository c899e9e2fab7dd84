"""Reinforcement learning on top of the runtime: the Countdown task and its reward, GRPO's loss and
the rollout queue. Nothing in ``asyncrl.runtime`` imports from here."""
