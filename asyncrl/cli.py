"""``asyncrl`` command line. Parses its flags before importing anything heavy, so ``--help`` is
instant; ``launch`` then runs a user script's ``main`` under uvloop with signal handling that
turns SIGINT/SIGTERM into an orderly shutdown of every actor. With ``--nnodes N``, node 0 runs the
script (its supervisor is node 0 of the cluster) and every other node runs a node agent."""

from __future__ import annotations

import os
import sys

from asyncrl.cli_parser import EXIT_USAGE, build_parser


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
    from asyncrl.runtime.titles import set_title

    if node.node_rank > 0:
        from asyncrl.runtime.cluster.agent import run_agent

        set_title(f"node{node.node_rank} agent")
        return run_agent(node.node_rank, args.node_addr, config)
    from asyncrl.launch import run_script

    set_title(f"launch {os.path.basename(args.script)}")  # the driver: a run names itself later (rl/launch.py)
    return run_script(args.script, args.script_args)


def _configure(args):
    """Export the flags as the ``ASYNCRL_*`` variables that ``Supervisor()`` (and the node agent)
    read, and check them all."""
    from asyncrl.nodes import resolve

    node = resolve(os.environ, args.nnodes, args.node_rank, args.master_addr, args.master_port, args.nproc_per_node)
    if not os.path.isfile(args.script):
        raise ValueError(f"no such script: {args.script}")
    from asyncrl.runtime import net
    from asyncrl.runtime.cluster import auth
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
    from asyncrl.runtime.cluster.auth import write_secret

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
