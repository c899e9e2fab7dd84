"""A launch target whose behaviour the test picks with argv[1]."""

import sys

from asyncrl import Supervisor


def main():
    mode = sys.argv[1]
    if mode == "sync-exit-code":
        return 3
    if mode == "raise":
        raise RuntimeError("the script failed on purpose")
    if mode == "args":
        print("args:", sys.argv[1:])
        return 0
    if mode == "config":
        cfg = Supervisor().config
        print("config:", cfg.transport, cfg.call_timeout_s, cfg.heartbeat_timeout_s)
        return 0
    return 4
