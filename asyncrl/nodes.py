"""Where this process sits in a cluster: from ``asyncrl launch``'s flags, else torchrun's variables
(``PET_NNODES`` then ``NNODES``, and so on), else Slurm's (inside an allocation), else defaults.

Kept free of heavy imports: the CLI resolves these before it imports the runtime.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass


class UsageError(ValueError):
    """A flag or variable the launcher cannot use; the CLI prints it and exits 2."""


@dataclass(frozen=True)
class NodeSettings:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    nproc_per_node: int
    """Devices this node offers (0: all found)."""
    min_nnodes: int = 0
    """With ``--nnodes MIN:MAX`` (an elastic cluster, as torchrun's): MIN, the nodes node 0 waits
    for at the start; ``nnodes`` is MAX. 0: a fixed size."""


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: ``"gpu[07-09,12],cpu1"`` gives ``"gpu07"``."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    if "[" not in first:
        return first
    prefix, rest = first.split("[", 1)
    ranges, _, suffix = rest.partition("]")
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def _slurm(environ: Mapping[str, str]) -> dict[str, str]:
    if "SLURM_JOB_ID" not in environ or "SLURM_NODEID" not in environ:
        return {}
    found = {"node_rank": environ["SLURM_NODEID"]}
    nnodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
    if nnodes:
        found["nnodes"] = nnodes
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist:
        found["master_addr"] = first_slurm_host(nodelist)
    return found


def _value(
    flag: str, given, environ: Mapping[str, str], names: list[str], slurm: dict, key: str, default
) -> tuple[object, str]:
    if given is not None:
        return given, flag
    for name in names:
        if environ.get(name):
            return environ[name], name
    if key in slurm:
        return slurm[key], f"Slurm's {key}"
    return default, f"{flag} (default)"


def _int(text, origin: str, flag: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise UsageError(f"{flag}: {origin}={text!r} is not an integer") from None


def _nnodes(text, origin: str) -> tuple[int, int]:
    """``N`` -> (0, N); ``MIN:MAX`` -> (MIN, MAX): an elastic range, as torchrun's."""
    if isinstance(text, str) and ":" in text:
        try:
            low, high = (int(part) for part in text.split(":"))
        except ValueError:
            raise UsageError(f"--nnodes: {origin}={text!r} is neither an integer nor a range MIN:MAX") from None
        if not 1 <= low <= high:
            raise UsageError(f"--nnodes {text}: an elastic range MIN:MAX needs 1 <= MIN <= MAX")
        return (0 if low == high else low), high
    return 0, _int(text, origin, "--nnodes")


def resolve(
    environ: Mapping[str, str],
    nnodes=None,
    node_rank=None,
    master_addr=None,
    master_port=None,
    nproc_per_node=None,
) -> NodeSettings:
    slurm = _slurm(environ)
    low, n = _nnodes(*_value("--nnodes", nnodes, environ, ["PET_NNODES", "NNODES"], slurm, "nnodes", 1))
    rank = _int(
        *_value("--node-rank", node_rank, environ, ["PET_NODE_RANK", "NODE_RANK"], slurm, "node_rank", 0), "--node-rank"
    )
    addr, _ = _value(
        "--master-addr", master_addr, environ, ["PET_MASTER_ADDR", "MASTER_ADDR"], slurm, "master_addr", "127.0.0.1"
    )
    port = _int(
        *_value("--master-port", master_port, environ, ["PET_MASTER_PORT", "MASTER_PORT"], {}, "", 29500),
        "--master-port",
    )
    procs, origin = _value("--nproc-per-node", nproc_per_node, environ, ["PET_NPROC_PER_NODE"], {}, "", "auto")
    if n < 1:
        raise UsageError(f"--nnodes must be >= 1, not {n}")
    if not 0 <= rank < n:
        raise UsageError(f"--node-rank must be in 0..{n - 1} for --nnodes {n}, not {rank}")
    if not 0 < port < 65536:
        raise UsageError(f"--master-port must be in 1..65535, not {port}")
    addr = str(addr).strip()
    if not addr or _is_wildcard(addr):
        raise UsageError(f"--master-addr {addr!r} is not an address the nodes can reach; give node 0's address")
    nproc = 0 if str(procs) in ("auto", "gpu") else _int(procs, origin, "--nproc-per-node")
    if nproc < 0:
        raise UsageError(f"--nproc-per-node must be >= 0, 'auto' or 'gpu', not {procs!r}")
    return NodeSettings(n, rank, addr, port, nproc, low)


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host == "*"
