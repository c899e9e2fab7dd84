"""Run a command in a named network namespace, as ``ip netns exec NAME CMD...`` does, on a host
without iproute2 (the GPU machines' image): ``setns(2)`` into /var/run/netns/NAME through libc, the
files of /etc/netns/NAME bind-mounted over /etc's in a mount namespace of the command's own (so
its resolver is the namespace's), then ``exec``.

    python netns_exec.py NAME CMD [ARGS...]
"""

from __future__ import annotations

import ctypes
import os
import sys

CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
MS_BIND, MS_REC, MS_SLAVE = 4096, 16384, 1 << 19
NETNS_RUN = "/var/run/netns"
NETNS_ETC = "/etc/netns"


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: netns_exec.py NAME CMD [ARGS...]")
    name, argv = sys.argv[1], sys.argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            sys.exit(f"netns_exec: {what}: {os.strerror(ctypes.get_errno())}")

    fd = os.open(os.path.join(NETNS_RUN, name), os.O_RDONLY)
    check(libc.setns(fd, CLONE_NEWNET), f"setns into {name}")
    os.close(fd)
    etc = os.path.join(NETNS_ETC, name)
    if os.path.isdir(etc) and os.listdir(etc):
        check(libc.unshare(CLONE_NEWNS), "unshare the mount namespace")
        # Our mounts must not propagate back to the host's namespace.
        check(libc.mount(None, b"/", None, MS_SLAVE | MS_REC, None), "make / a slave mount")
        for entry in os.listdir(etc):
            source, target = os.path.join(etc, entry), os.path.join("/etc", entry)
            if os.path.exists(target):
                check(libc.mount(source.encode(), target.encode(), None, MS_BIND, None), f"bind {source}")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
