"""``asyncrl`` command line. Parses its flags before importing anything heavy, so ``--help`` is
instant; ``launch`` then runs a user script's ``main`` under uvloop with signal handling that
turns SIGINT/SIGTERM into an orderly shutdown of every actor. With ``--nnodes N``, node 0 runs the
script (its supervisor is node 0 of the cluster) and every other node runs a node agent."""

from __future__ import annotations

import argparse
import os
import sys

EXIT_USAGE = 2


def _launch_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "launch",
        help="run a script's main() with a supervisor configured from these flags",
        description=(
            "Run SCRIPT's main() (sync or async) on this host. Supervisor() created inside the script "
            "takes its defaults from these flags. SIGINT/SIGTERM stop every actor and exit with 128+signal."
        ),
    )
    nodes = p.add_argument_group(
        "nodes (torchrun's flags; defaults from PET_<NAME> or <NAME> variables, then Slurm's, e.g. NNODES, MASTER_ADDR)"
    )
    nodes.add_argument("--nnodes", help="number of nodes (default 1)")
    nodes.add_argument("--node-rank", "--node_rank", help="this node's rank; 0 runs the script, others run a node agent")
    nodes.add_argument("--master-addr", "--master_addr", help="node 0's address as the other nodes reach it (default 127.0.0.1)")
    nodes.add_argument("--master-port", "--master_port", help="node 0's cluster port (default 29500)")
    nodes.add_argument("--nproc-per-node", "--nproc_per_node", help="accelerator devices this node offers (default: all found)")
    nodes.add_argument("--node-addr", help="address the other nodes reach this one at (default: the interface that routes to the master)")
    nodes.add_argument("--secret-file", help="file holding the cluster secret (else $ASYNCRL_CLUSTER_SECRET[_FILE]); see `asyncrl secret`")
    nodes.add_argument("--join-timeout-s", type=float, help="deadline for every node to join (default 300)")
    nodes.add_argument("--node-timeout-s", type=float, help="a node silent this long is lost (default 5)")
    sup = p.add_argument_group("supervisor")
    sup.add_argument("--transport", choices=["ipc", "tcp"], help="control-plane transport (default ipc)")
    sup.add_argument("--call-timeout-s", type=float, help="default deadline of one call")
    sup.add_argument("--start-timeout-s", type=float, help="deadline for an actor to start")
    sup.add_argument("--stop-timeout-s", type=float, help="graceful stop deadline before SIGTERM")
    sup.add_argument("--heartbeat-timeout-s", type=float, help="silence after which an actor counts dead")
    p.add_argument("script", help="path of a Python file defining main()")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script as sys.argv[1:]")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Fully-asynchronous RL runtime.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    _launch_parser(sub)
    secret = sub.add_parser("secret", help="write a new cluster secret to a file (mode 0600) for multi-node runs")
    secret.add_argument("path", help="where to write it; an existing file is not overwritten")
    status = sub.add_parser(
        "status",
        help="show a live run's actors (state, restarts, last heartbeat) and progress, asked of its supervisor",
        description=(
            "Ask the supervisor serving RUN_DIR (found through RUN_DIR/supervisor.json) for each actor's state, "
            "pid, restarts and last heartbeat, and the run's progress. Exit codes: 0 answered, 1 no live "
            "supervisor (not started, finished, or gone), 2 no such directory, 3 no valid answer in time."
        ),
    )
    status.add_argument("run_dir", help="the run directory (e.g. runs/grpo-20261122-063000)")
    status.add_argument("--json", action="store_true", help="print the whole reply as JSON")
    status.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds to wait for the answer (default 5)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if args.command == "secret":
        return _write_secret(args.path)
    if args.command == "status":
        return _status(args.run_dir, args.json, args.timeout)
    if args.command != "launch":
        parser.print_help()
        return EXIT_USAGE
    try:
        config, node = _configure(args)
    except ValueError as e:  # a bad flag or variable is a usage error, reported before anything starts
        print(f"asyncrl launch: {e}", file=sys.stderr)
        return EXIT_USAGE
    if node.node_rank > 0:
        from .runtime.agent import run_agent

        return run_agent(node.node_rank, args.node_addr, config)
    from .launch import run_script

    return run_script(args.script, args.script_args)


def _configure(args):
    """Export the flags as the ``ASYNCRL_*`` variables that ``Supervisor()`` (and the node agent)
    read, and check them all."""
    from .nodes import resolve

    node = resolve(os.environ, args.nnodes, args.node_rank, args.master_addr, args.master_port, args.nproc_per_node)
    if not os.path.isfile(args.script):
        raise ValueError(f"no such script: {args.script}")
    from .runtime import auth, net
    from .runtime.config import ENV_PREFIX, SupervisorConfig

    for flag in ("transport", "call_timeout_s", "start_timeout_s", "stop_timeout_s", "heartbeat_timeout_s",
                 "join_timeout_s", "node_timeout_s"):
        value = getattr(args, flag)
        if value is not None:
            os.environ[ENV_PREFIX + flag.upper()] = str(value)
    if node.nnodes > 1:
        for field in ("nnodes", "master_addr", "master_port", "nproc_per_node"):
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
            f"`asyncrl secret PATH` and pass --secret-file PATH (or set {auth.ENV_SECRET_FILE} or {auth.ENV_SECRET})"
        )
    return config, node


def _write_secret(path: str) -> int:
    from .runtime.auth import write_secret

    try:
        write_secret(path)
    except OSError as e:
        print(f"asyncrl secret: cannot create {path}: {e}", file=sys.stderr)
        return 1
    print(f"asyncrl secret: wrote a new cluster secret to {path} (mode 0600); copy it to every node")
    return 0


def _status(run_dir: str, as_json: bool, timeout_s: float) -> int:
    from .runtime.status import StatusUnavailableError, format_status, query_status, reply_json

    if not timeout_s > 0:
        print(f"asyncrl status: --timeout must be > 0, not {timeout_s:g}", file=sys.stderr)
        return EXIT_USAGE
    try:
        reply = query_status(run_dir, timeout_s)
    except StatusUnavailableError as e:
        print(f"asyncrl status: {e}", file=sys.stderr)
        return e.exit_code
    print(reply_json(reply) if as_json else format_status(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main())
