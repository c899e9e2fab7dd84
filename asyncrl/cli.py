"""``asyncrl`` command line. Parses its flags before importing anything heavy, so ``--help`` is
instant; ``launch`` then runs a user script's ``main`` under uvloop with signal handling that
turns SIGINT/SIGTERM into an orderly shutdown of every actor. With ``--nnodes N``, node 0 runs the
script (its supervisor is node 0 of the cluster) and every other node runs a node agent."""

from __future__ import annotations

import argparse
import os
import re
import sys

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

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, formatter_class=FlagHelp, add_help=False, **kwargs)
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
    sub.add_parser(  # listed here; its line is parsed by asyncrl.rl.policy_eval (see main)
        "eval",
        help="The held-out solve rates and task metrics of a saved policy (RUN_DIR/final, best/, a "
        "checkpoint), greedy and sampled; asyncrl eval --help for its flags.",
    ).add_argument("args", nargs=argparse.REMAINDER)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["eval"]:  # a run's --section.key flags besides its own, as a script takes them
        return _eval(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from asyncrl import __version__

        print(__version__)
        return 0
    if args.command == "secret":
        return _write_secret(args.path)
    if args.command == "status":
        if args.endpoint:
            return _endpoints(args.run_dir, args.json, args.timeout)
        return _status(args.run_dir, args.json, args.timeout)
    if args.command == "scale":
        return _scale(args.run_dir, args.samplers, args.timeout, args.force)
    if args.command == "plot":
        return _plot(args.run_dirs, args.output)
    if args.command == "show":
        return _show(args.run_dir, args.step, args.episode, args.ids)
    if args.command != "launch":
        parser.print_help()
        return EXIT_USAGE
    try:
        config, node = _configure(args)
    except ValueError as e:  # a bad flag or variable is a usage error, reported before anything starts
        print(f"asyncrl launch: {e}", file=sys.stderr)
        return EXIT_USAGE
    if node.node_rank > 0:
        from asyncrl.runtime.agent import run_agent

        return run_agent(node.node_rank, args.node_addr, config)
    from asyncrl.launch import run_script

    return run_script(args.script, args.script_args)


def _configure(args):
    """Export the flags as the ``ASYNCRL_*`` variables that ``Supervisor()`` (and the node agent)
    read, and check them all."""
    from asyncrl.nodes import resolve

    node = resolve(os.environ, args.nnodes, args.node_rank, args.master_addr, args.master_port, args.nproc_per_node)
    if not os.path.isfile(args.script):
        raise ValueError(f"no such script: {args.script}")
    from asyncrl.runtime import auth, net
    from asyncrl.runtime.config import ENV_PREFIX, SupervisorConfig

    for flag in (
        "transport",
        "call_timeout_s",
        "start_timeout_s",
        "stop_timeout_s",
        "heartbeat_timeout_s",
        "join_timeout_s",
        "node_timeout_s",
    ):
        value = getattr(args, flag)
        if value is not None:
            os.environ[ENV_PREFIX + flag.upper()] = str(value)
    if node.nnodes > 1:
        for field in ("nnodes", "min_nnodes", "master_addr", "master_port", "nproc_per_node"):
            os.environ[ENV_PREFIX + field.upper()] = str(getattr(node, field))
    elif node.nproc_per_node:
        os.environ[ENV_PREFIX + "NPROC_PER_NODE"] = str(node.nproc_per_node)
    if args.secret_file:
        os.environ[auth.ENV_SECRET_FILE] = os.path.abspath(args.secret_file)
    if args.node_addr:
        os.environ[net.ENV_NODE_ADDR] = args.node_addr
    config = SupervisorConfig.from_env()
    if node.nnodes > 1 and auth.load_secret() is None:
        raise ValueError(
            f"--nnodes {node.nnodes} needs a cluster secret, the same on every node: make one with "
            f"`asyncrl secret PATH` and pass --secret_file PATH (or set {auth.ENV_SECRET_FILE} or {auth.ENV_SECRET})"
        )
    return config, node


def _eval(argv: list[str]) -> int:
    from asyncrl.errors import UsageError
    from asyncrl.rl.policy_eval import main as eval_main

    try:
        return eval_main(argv)
    except UsageError as e:  # a path without a policy, a key or a value: one line, before anything loads
        print(f"asyncrl eval: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("asyncrl eval: stopped by SIGINT", file=sys.stderr)
        return 130


def _write_secret(path: str) -> int:
    from asyncrl.runtime.auth import write_secret

    try:
        write_secret(path)
    except OSError as e:
        print(f"asyncrl secret: cannot create {path}: {e}", file=sys.stderr)
        return 1
    print(f"asyncrl secret: wrote a new cluster secret to {path} (mode 0600); copy it to every node")
    return 0


def _status(run_dir: str, as_json: bool, timeout_s: float) -> int:
    from asyncrl.runtime.status import StatusUnavailableError, format_status, query_status, reply_json

    if not timeout_s > 0:
        print(f"asyncrl status: --timeout must be > 0, not {timeout_s:g}", file=sys.stderr)
        return EXIT_USAGE
    try:
        reply = query_status(run_dir, timeout_s)
    except StatusUnavailableError as e:
        if not as_json:  # a finished or stopped run still has its history to show
            _print_history(run_dir)
        print(f"asyncrl status: {_unavailable(run_dir, e)}", file=sys.stderr)
        return e.exit_code
    print(reply_json(reply) if as_json else format_status(reply))
    if not as_json:
        print()
        _print_history(run_dir)
    return 0


def _endpoints(run_dir: str, as_json: bool, timeout_s: float) -> int:
    """``asyncrl status RUN_DIR --endpoint``: each sampler's root OpenAI endpoint and token."""
    import json

    from asyncrl.runtime.status import CommandRefusedError, StatusUnavailableError, send_command

    if not timeout_s > 0:
        print(f"asyncrl status: --timeout must be > 0, not {timeout_s:g}", file=sys.stderr)
        return EXIT_USAGE
    try:
        answer = send_command(run_dir, "endpoint", {}, timeout_s)  # as rl.driver.fleet.endpoints
    except CommandRefusedError as e:
        print(f"asyncrl status: no endpoint: {e}", file=sys.stderr)
        return 1
    except StatusUnavailableError as e:
        print(f"asyncrl status: {_unavailable(run_dir, e)}", file=sys.stderr)
        return e.exit_code
    if as_json:
        print(json.dumps(answer, indent=2))
        return 0
    for one in answer["endpoints"]:
        if "error" in one:
            print(f"{one['sampler']}: no endpoint: {one['error']}")
        else:
            print(f"{one['sampler']}: base_url {one['base_url']}  token {one['token']}")
    print(
        "Use them as openai.OpenAI(base_url=..., api_key=token); requests at the root are served with the "
        "sampler's current weights and trained on by no one (docs/agents.md)."
    )
    return 0


def _scale(run_dir: str, samplers: int, timeout_s: float, force: bool = False) -> int:
    from asyncrl.rl.view.fleet import fleet_text
    from asyncrl.runtime.status import CommandRefusedError, StatusUnavailableError, send_command

    if not timeout_s > 0:
        print(f"asyncrl scale: --timeout must be > 0, not {timeout_s:g}", file=sys.stderr)
        return EXIT_USAGE
    args = {"samplers": samplers} | ({"force": True} if force else {})
    try:
        answer = send_command(run_dir, "scale", args, timeout_s)  # as rl.driver.scaling.scale
    except CommandRefusedError as e:
        print(f"asyncrl scale: refused: {e}", file=sys.stderr)
        return EXIT_USAGE
    except StatusUnavailableError as e:
        print(f"asyncrl scale: {_unavailable(run_dir, e)}", file=sys.stderr)
        return e.exit_code
    if "running" in answer:
        now = fleet_text(answer["running"], answer["restarting"], answer["starting"], answer["previous_target"])
    else:  # a run of an earlier version: its count of samplers, starting ones included
        now = str(answer["samplers"])
    print(
        f"asyncrl scale: {now} -> {answer['target']} sampler(s) accepted at step "
        f"{answer['step']}; applied at the next weight sync (asyncrl status shows samplers_target)"
    )
    return 0


def _unavailable(run_dir: str, error: Exception) -> str:
    """Why no live run answered: a run stopped (Ctrl-C, a signal, an error) says so, with how to
    resume it, where the generic reason would read as a run not started yet."""
    from asyncrl.rl.view.history import stopped_text

    if getattr(error, "reason", "") == "not_started":
        return stopped_text(run_dir) or str(error)
    return str(error)


def _print_history(run_dir: str) -> None:
    """The latest metrics and the sparklines of metrics.jsonl, when the directory has one."""
    from asyncrl.rl.view.history import RunHistoryError
    from asyncrl.rl.view.sparkline import status_lines

    try:
        print("\n".join(status_lines(run_dir)))
    except (RunHistoryError, OSError):
        pass  # not a run directory, or no step yet: the status line says what there is


def _show(run_dir: str, step: int | None, episode: int = 0, ids: bool = False) -> int:
    from asyncrl.rl.view.episodes import episode_text
    from asyncrl.rl.view.history import RunHistoryError

    if not os.path.isdir(run_dir):
        print(f"asyncrl show: no such run directory: {run_dir}", file=sys.stderr)
        return EXIT_USAGE
    try:
        print(episode_text(run_dir, step, episode, ids))
    except RunHistoryError as e:
        print(f"asyncrl show: {e}", file=sys.stderr)
        return 1
    return 0


def _plot(run_dirs: list[str], output: str) -> int:
    from asyncrl.rl.view.curves import CurvesUnavailableError, draw_curves
    from asyncrl.rl.view.history import RunHistoryError

    for run_dir in run_dirs:
        if not os.path.isdir(run_dir):
            print(f"asyncrl plot: no such run directory: {run_dir}", file=sys.stderr)
            return EXIT_USAGE
    output = output or (os.path.join(run_dirs[0], "curves.png") if len(run_dirs) == 1 else "curves.png")
    try:
        path = draw_curves(run_dirs, output)
    except (CurvesUnavailableError, RunHistoryError) as e:
        print(f"asyncrl plot: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"asyncrl plot: cannot write {output}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"asyncrl plot: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
