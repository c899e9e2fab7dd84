"""Fully-async GRPO on top of the runtime and the weight-sync plane, one package per role: config,
tasks, model, trainer, sampler, driver (docs/architecture.md draws the map and what may import
what). Nothing in ``asyncrl.runtime`` or ``asyncrl.comm`` imports from here."""
