"""The ``asyncrl`` command's flags: the parser of every subcommand and the one layout of their
``--help``. Imports nothing beyond argparse, so building it (``--help``) costs no heavy import."""

from __future__ import annotations

import argparse
import re

EXIT_USAGE = 2


class FlagHelp(argparse.HelpFormatter):
    """The one layout of every ``--help`` of asyncrl, a script's keys included (its twin is
    `asyncrl.rl.config.helptext`, which this module may not import): each flag on a line of its
    own, ``--flag METAVAR``, its description on the lines below, indented by six and wrapped to the
    terminal. A flag's words are joined by _ (as a script's keys are, and config.json's); the
    spelling with - is accepted too but not shown."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=6)  # never beside the flag: always below it

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        short = [s for s in action.option_strings if not s.startswith("--")]
        flags = ", ".join(short + [s for s in action.option_strings if s.startswith("--")][:1])
        if action.nargs == 0:
            return flags
        return f"{flags} {self._format_args(action, self._get_default_metavar_for_optional(action))}"


class _Parser(argparse.ArgumentParser):
    """An argparse parser laid out by `FlagHelp`, whose errors are one line naming the flag in
    the spelling help shows, as a script's flag errors are."""

    def __init__(self, prog: str | None = None, description: str | None = None, epilog: str | None = None) -> None:
        super().__init__(prog, description=description, epilog=epilog, formatter_class=FlagHelp, add_help=False)
        self.add_argument("-h", "--help", action="help", help="Show this help and exit.")

    def error(self, message: str):
        message = re.sub(r"argument (--\w+)(/--[\w-]+)*", r"\1", message)  # argparse names every spelling
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _flag(group, name: str, **kwargs) -> argparse.Action:
    """``--name`` (words joined by _) and ``--na-me`` (torchrun's spelling): both parse to ``name``."""
    names = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    return group.add_argument(*names, dest=name, **kwargs)


def _launch_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "launch",
        help="Run a script's main() with a supervisor configured from these flags.",
        description=(
            "Run SCRIPT's main() (sync or async) on this host. Supervisor() created inside the script "
            "takes its defaults from these flags. SIGINT/SIGTERM stop every actor and exit with 128+signal. "
            "Each flag is given as --flag VALUE or --flag=VALUE; its words are joined by _ (- is read the same). "
            "SCRIPT --help lists the script's own flags."
        ),
    )
    nodes = p.add_argument_group(
        "nodes",
        "torchrun's flags; defaults from PET_<NAME> or <NAME> variables, then Slurm's (e.g. NNODES, MASTER_ADDR).",
    )
    _flag(
        nodes,
        "nnodes",
        metavar="N",
        help="Number of nodes (default 1), or MIN:MAX for an elastic cluster: node 0 "
        "starts once MIN have joined, the others may join while it runs.",
    )
    _flag(nodes, "node_rank", metavar="RANK", help="This node's rank; 0 runs the script, the others run a node agent.")
    _flag(
        nodes, "master_addr", metavar="ADDR", help="Node 0's address as the other nodes reach it (default 127.0.0.1)."
    )
    _flag(nodes, "master_port", metavar="PORT", help="Node 0's cluster port (default 29500).")
    _flag(nodes, "nproc_per_node", metavar="N", help="Accelerator devices this node offers (default: all found).")
    _flag(
        nodes,
        "node_addr",
        metavar="ADDR",
        help="Address the other nodes reach this one at (default: that of the interface that routes to the master).",
    )
    _flag(
        nodes,
        "secret_file",
        metavar="PATH",
        help="File holding the cluster secret (else $ASYNCRL_CLUSTER_SECRET[_FILE]); see `asyncrl secret`.",
    )
    _flag(nodes, "join_timeout_s", type=float, metavar="S", help="Deadline for every node to join (default 300).")
    _flag(nodes, "node_timeout_s", type=float, metavar="S", help="A node silent this long is lost (default 5).")
    sup = p.add_argument_group("supervisor", "Defaults of Supervisor() in the script.")
    _flag(sup, "transport", choices=["ipc", "tcp"], help="Control-plane transport (default ipc).")
    _flag(sup, "call_timeout_s", type=float, metavar="S", help="Default deadline of one call.")
    _flag(sup, "start_timeout_s", type=float, metavar="S", help="Deadline for an actor to start.")
    _flag(sup, "stop_timeout_s", type=float, metavar="S", help="Graceful stop deadline before SIGTERM.")
    _flag(sup, "heartbeat_timeout_s", type=float, metavar="S", help="Silence after which an actor counts as dead.")
    p.add_argument("script", help="Path of a Python file defining main().")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="Arguments passed to the script as sys.argv[1:].")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="asyncrl", description="Fully-asynchronous RL runtime.")
    parser.add_argument("--version", action="store_true", help="Print the version and exit.")
    sub = parser.add_subparsers(dest="command")
    _launch_parser(sub)
    secret = sub.add_parser("secret", help="Write a new cluster secret to a file (mode 0600) for multi-node runs.")
    secret.add_argument("path", help="Where to write it; an existing file is not overwritten.")
    _status_parser(sub)
    _scale_parser(sub)
    _show_parser(sub)
    sub.add_parser(  # listed here; its line is parsed by asyncrl.rl.policy_eval (see asyncrl.cli.main)
        "eval",
        help="The held-out solve rates and task metrics of a saved policy (RUN_DIR/final, best/, a "
        "checkpoint), greedy and sampled; asyncrl eval --help for its flags.",
    ).add_argument("args", nargs=argparse.REMAINDER)
    _plot_parser(sub)
    return parser


def _status_parser(sub) -> None:
    """``asyncrl status RUN_DIR``: a live run's actors and progress, or its samplers' endpoints."""
    status = sub.add_parser(
        "status",
        help="Show a live run's actors (state, restarts, last heartbeat) and progress, asked of its supervisor.",
        description=(
            "Ask the supervisor serving RUN_DIR (found through RUN_DIR/supervisor.json) for each actor's state, "
            "pid, restarts and last heartbeat, and the run's progress. Exit codes: 0 answered, 1 no live "
            "supervisor (not started, finished, or gone), 2 no such directory, 3 no valid answer in time."
        ),
    )
    status.add_argument("run_dir", help="The run directory (e.g. runs/grpo-20261122-063000).")
    status.add_argument("--json", action="store_true", help="Print the whole reply as JSON.")
    status.add_argument(
        "--endpoint",
        action="store_true",
        help=(
            "Print each sampler's OpenAI endpoint (root base_url) and its bearer token, for code outside the "
            "run's episodes (docs/agents.md); starts the endpoint on a sampler that has none yet."
        ),
    )
    status.add_argument(
        "--timeout", type=float, default=5.0, metavar="S", help="Seconds to wait for the answer (default 5)."
    )


def _scale_parser(sub) -> None:
    """``asyncrl scale RUN_DIR --samplers N``: a live run's samplers grown or shrunk."""
    scale = sub.add_parser(
        "scale",
        help="Grow or shrink a live GRPO run's samplers (applied at its next weight sync).",
        description=(
            "Ask the run serving RUN_DIR to run N samplers: new ones are started and join the weight-sync group "
            "at the next sync with the current weights; drained ones leave it and exit (docs/elastic.md). "
            "Exit codes: 0 accepted, 1 no live run, 2 refused (the line says why) or a usage error, "
            "3 no valid answer in time."
        ),
    )
    scale.add_argument("run_dir", help="The run directory of a live run.")
    scale.add_argument("--samplers", type=int, required=True, metavar="N", help="How many samplers to run.")
    scale.add_argument(
        "--force",
        action="store_true",
        help="Start more CPU samplers than the run's node(s) have cores (refused otherwise).",
    )
    scale.add_argument(
        "--timeout", type=float, default=5.0, metavar="S", help="Seconds to wait for the run's answer (default 5)."
    )


def _show_parser(sub) -> None:
    """``asyncrl show RUN_DIR``: one recorded episode of a run."""
    show = sub.add_parser(
        "show",
        help="Print one trained episode of a run (RUN_DIR/episodes.jsonl): the model's tokens and an environment's.",
        description=(
            "Print the episode a run recorded for a step (the first one trained at that step): its prompt, then "
            "each piece as 'model' (in the loss: the tokens the policy wrote) or 'env' (context: an environment's "
            "reply, with no loss), quoted; with --ids, each piece's token ids and log-probs. A run keeps "
            "--run.episodes episodes a step (1), with their ids under --run.episode_ids true. "
            "Exit codes: 0 printed, 1 no such episode, 2 no such directory."
        ),
    )
    show.add_argument("run_dir", help="The run directory.")
    show.add_argument("--step", type=int, default=None, metavar="N", help="The step (default: the last recorded).")
    show.add_argument(
        "--episode",
        type=int,
        default=0,
        metavar="K",
        help="Which of the step's recorded episodes (default 0; a run keeps --run.episodes a step).",
    )
    show.add_argument(
        "--ids",
        action="store_true",
        help="Also print the token ids and sampling log-probs (a run that kept them: --run.episode_ids true).",
    )


def _plot_parser(sub) -> None:
    """``asyncrl plot RUN_DIR...``: the learning curves of runs, drawn into a PNG."""
    plot = sub.add_parser(
        "plot",
        help="Draw the learning curves of one or several runs (from their metrics.jsonl) into a PNG.",
        description=(
            "Draw reward, train and held-out solve rates, staleness and dropped groups, tokens/s and the time "
            "split of each step for every RUN_DIR, one colour per run (compare seeds, or async against sync). "
            "Needs matplotlib. Exit codes: 0 drawn, 1 a run has no metrics yet or matplotlib is missing, "
            "2 a usage error."
        ),
    )
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="Run directories (each holds metrics.jsonl).")
    plot.add_argument(
        "-o",
        "--output",
        default="",
        metavar="PNG",
        help="Where to write the picture (default: RUN_DIR/curves.png for one run, curves.png here for several).",
    )
