"""``asyncrl`` command line. Parses its flags before importing anything heavy, so ``--help`` is
instant; ``launch`` then runs a user script's ``main`` under uvloop with signal handling that
turns SIGINT/SIGTERM into an orderly shutdown of every actor."""

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
    nodes = p.add_argument_group("nodes (torchrun's names; one node for now)")
    nodes.add_argument("--nnodes", type=int, default=os.environ.get("NNODES", "1"))
    nodes.add_argument("--node-rank", "--node_rank", type=int, default=os.environ.get("NODE_RANK", "0"))
    nodes.add_argument("--master-addr", "--master_addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    nodes.add_argument("--master-port", "--master_port", type=int, default=os.environ.get("MASTER_PORT", "29500"))
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if args.command != "launch":
        parser.print_help()
        return EXIT_USAGE
    if args.nnodes != 1 or args.node_rank != 0:
        print("asyncrl launch: only --nnodes 1 is supported so far (multi-node is planned)", file=sys.stderr)
        return EXIT_USAGE
    if not os.path.isfile(args.script):
        print(f"asyncrl launch: no such script: {args.script}", file=sys.stderr)
        return EXIT_USAGE
    from .runtime.config import ENV_PREFIX

    for flag in ("transport", "call_timeout_s", "start_timeout_s", "stop_timeout_s", "heartbeat_timeout_s"):
        value = getattr(args, flag)
        if value is not None:
            os.environ[ENV_PREFIX + flag.upper()] = str(value)
    from .runtime.config import SupervisorConfig

    try:
        SupervisorConfig.from_env()  # a bad flag value is a usage error, reported before anything starts
    except ValueError as e:
        print(f"asyncrl launch: {e}", file=sys.stderr)
        return EXIT_USAGE
    from .launch import run_script

    return run_script(args.script, args.script_args)


if __name__ == "__main__":
    sys.exit(main())
