"""The package map of docs/architecture.md, checked: which part of asyncrl may import which, and no
import circle between modules. Every import counts, the lazy ones inside functions too: a lazy
import hides a dependency from a reader, it does not remove it."""

from __future__ import annotations

import ast
import os

import asyncrl

ROOT = os.path.dirname(asyncrl.__file__)

SHARED_RL = {
    "asyncrl.rl.config",
    "asyncrl.rl.generation",
    "asyncrl.rl.tasks",
    "asyncrl.rl.model",
    "asyncrl.rl.rollout",
    "asyncrl.rl.checkpoint",
    "asyncrl.rl.digest",
    "asyncrl.rl.agents",
    "asyncrl.rl.actor_device",
}
MAY_IMPORT = {
    # the generic layers know nothing of RL
    "asyncrl.errors": set(),
    "asyncrl.runtime": {"asyncrl.errors"},
    "asyncrl.comm": {"asyncrl.errors", "asyncrl.runtime"},
    # rl/: the config at the bottom, then the task, the model, the shared wire/disk formats
    "asyncrl.rl.config": {"asyncrl.errors"},
    "asyncrl.rl.generation": set(),
    "asyncrl.rl.tasks": {"asyncrl.errors", "asyncrl.rl.config", "asyncrl.rl.generation"},
    "asyncrl.rl.rollout": {"asyncrl.errors", "asyncrl.rl.generation"},
    # the OpenAI endpoint agents talk to, over any generation function (a sampler's, the evaluation's)
    "asyncrl.rl.agents": {"asyncrl.errors", "asyncrl.runtime", "asyncrl.rl.generation", "asyncrl.rl.tasks"},
    "asyncrl.rl.digest": set(),
    # the device an actor computes on (its GPU set up once: trainer, sampler, scorer)
    "asyncrl.rl.actor_device": set(),
    # views drawn from a run directory alone (curves.png, sparklines): the driver's and the CLI's
    "asyncrl.rl.view": {"asyncrl.errors"},
    # what a run records and shows while it runs: handed the driver's records, never importing the
    # driver (comm and sampler for the types of a sync's answers, trainer for a train step's)
    "asyncrl.rl.observe": {
        "asyncrl.errors",
        "asyncrl.runtime",
        "asyncrl.comm",
        *SHARED_RL,
        "asyncrl.rl.sampler",
        "asyncrl.rl.trainer",
        "asyncrl.rl.view",
    },
    "asyncrl.rl.checkpoint": {"asyncrl.errors", "asyncrl.runtime", "asyncrl.rl.config"},
    "asyncrl.rl.model": {
        "asyncrl.errors",
        "asyncrl.runtime",
        "asyncrl.rl.config",
        "asyncrl.rl.generation",
        "asyncrl.rl.tasks",
        "asyncrl.rl.agents",
    },
    # a causal LM's scores of a batch (micro-batches, forward, log-probs), below the trainer and the
    # scorer alike: both score with it, neither imports the other
    "asyncrl.rl.scoring": {"asyncrl.errors"},
    # the actors never import each other, nor the driver
    "asyncrl.rl.trainer": {"asyncrl.errors", "asyncrl.runtime", "asyncrl.comm", *SHARED_RL, "asyncrl.rl.scoring"},
    "asyncrl.rl.sampler": {"asyncrl.errors", "asyncrl.runtime", "asyncrl.comm", *SHARED_RL},
    "asyncrl.rl.scorer": {"asyncrl.errors", "asyncrl.runtime", *SHARED_RL, "asyncrl.rl.scoring"},
    # the driver spawns the actors (their classes only) and talks to them through the runtime
    "asyncrl.rl.driver": {
        "asyncrl.errors",
        "asyncrl.runtime",
        "asyncrl.comm",
        *SHARED_RL,
        "asyncrl.rl.trainer",
        "asyncrl.rl.sampler",
        "asyncrl.rl.scorer",
        "asyncrl.rl.view",
        "asyncrl.rl.observe",
    },
    # the command line of a GRPO run (the example scripts' main): parse, check, then drive
    "asyncrl.rl.launch": {
        "asyncrl",
        "asyncrl.errors",
        "asyncrl.runtime",
        "asyncrl.rl.config",
        "asyncrl.rl.tasks",
        "asyncrl.rl.driver",
    },
    # `asyncrl eval`: a saved policy's held-out evaluation, the run's own (the model's evaluation;
    # the samplers' engine factory; a run's command line and config.json)
    "asyncrl.rl.policy_eval": {
        "asyncrl.errors",
        *SHARED_RL,
        "asyncrl.rl.sampler",
        "asyncrl.rl.launch",
    },
    "asyncrl.rl": set(),
    # the command line and the package's front door
    "asyncrl": {"asyncrl.errors", "asyncrl.runtime"},
    "asyncrl.cli": {
        "asyncrl",
        "asyncrl.errors",
        "asyncrl.runtime",
        "asyncrl.launch",
        "asyncrl.nodes",
        "asyncrl.rl.view",
        "asyncrl.rl.policy_eval",
    },
    "asyncrl.launch": {"asyncrl.errors", "asyncrl.runtime"},
    "asyncrl.nodes": {"asyncrl.errors", "asyncrl.runtime"},
}


def _modules() -> dict[str, str]:
    modules = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                modules[rel.removesuffix(".__init__")] = path
    return modules


def _imports(module: str, path: str) -> set[str]:
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {name for name in found if name == "asyncrl" or name.startswith("asyncrl.")}


def _part(module: str) -> str:
    """The unit of the map a module belongs to: the longest MAY_IMPORT key that is it or contains it."""
    return max((key for key in MAY_IMPORT if module == key or module.startswith(key + ".")), key=len)


def test_every_part_imports_only_what_the_map_allows():
    modules = _modules()
    wrong = []
    for module, path in sorted(modules.items()):
        part = _part(module)
        for name in sorted(_imports(module, path)):
            if name not in modules:  # `from pkg import name` also yields pkg.name, which may be a value
                continue
            target = _part(name)
            if target != part and target not in MAY_IMPORT[part]:
                wrong.append(f"{module} imports {name} ({part} -> {target})")
    assert not wrong, "imports the map in docs/architecture.md does not allow:\n" + "\n".join(wrong)


def test_no_import_circle_between_modules():
    modules = _modules()
    graph = {
        m: {t for t in _imports(m, p) if t in modules and t != m and not m.startswith(t + ".")}
        for m, p in modules.items()
    }
    circles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_map_knows_every_part():
    parts = {_part(m) for m in _modules()}
    assert "asyncrl.rl.driver" in parts and "asyncrl.rl.sampler" in parts  # the walk found the packages
    assert parts <= set(MAY_IMPORT)


LOOP = (
    "asyncrl.rl.driver",
    "asyncrl.rl.driver.grpo",
    "asyncrl.rl.driver.run",
    "asyncrl.rl.driver.build",
    "asyncrl.rl.driver.run_scope",
    "asyncrl.rl.driver.spawn",
    "asyncrl.rl.driver.heldout",
    "asyncrl.rl.driver.saving",
    "asyncrl.rl.driver.start_checks",
    "asyncrl.rl.driver.step_record",
    "asyncrl.rl.driver.run_progress",
    "asyncrl.rl.driver.resume",
)
"""The driver's loop: the package (its __init__ imports train()), the steps, the run (its build, its
scope, its actors' spawns), and the parts of them in modules of their own (evaluation, saving, start
checks, step records, the progress, resume)."""


def test_the_fleet_never_reaches_back_into_the_loop():
    # The loop builds the fleet and passes in what it needs; an import the other way would make
    # the fleet's parts depend on the steps they serve (prime-rl's rule for its components).
    wrong = [
        f"{module} imports {name}"
        for module, path in sorted(_modules().items())
        if module.startswith("asyncrl.rl.driver.fleet")
        for name in sorted(_imports(module, path))
        if name in LOOP or name.startswith(tuple(f"{loop}." for loop in LOOP[1:]))
    ]
    assert not wrong, "the fleet imports the loop:\n" + "\n".join(wrong)


def test_membership_is_the_one_writer_of_a_members_state():
    # Every field of a `Member`, and whether the group must be formed again (``dirty``), is
    # written by `Membership` alone: any other module asks it through a method.
    owner = os.path.join(ROOT, "rl", "driver", "fleet", "membership.py")
    tree = ast.parse(open(owner).read())
    (member,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Member"]
    fields = {n.target.id for n in member.body if isinstance(n, ast.AnnAssign)} | {"dirty"}
    assert {"state", "incarnation", "pump", "seq"} <= fields
    wrong = []
    for module, path in sorted(_modules().items()):
        if not module.startswith("asyncrl.rl.driver") or path == owner:
            continue
        for node in ast.walk(ast.parse(open(path).read())):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if (
                        isinstance(t, ast.Attribute)
                        and t.attr in fields
                        and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                    ):
                        wrong.append(f"{module}:{t.lineno} writes .{t.attr}")
    assert not wrong, "a member's state written outside Membership:\n" + "\n".join(wrong)
