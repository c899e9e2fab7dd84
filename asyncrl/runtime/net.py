"""Addresses across hosts: which local interface reaches a peer, and how to write a TCP endpoint.

A socket that other hosts must reach binds to the address of the interface that routes to them,
never to a wildcard by default: a wildcard also listens on interfaces nobody meant to expose.
"""

from __future__ import annotations

import ipaddress
import socket

ENV_NODE_ADDR = "ASYNCRL_NODE_ADDR"
"""Set in every actor's environment: this node's address as its peers reach it (bind a
``TCPStore`` or any other listener there so actors on other nodes can connect)."""
ENV_NODE_RANK = "ASYNCRL_NODE_RANK"
ENV_NNODES = "ASYNCRL_NNODES"


def reachable_address(peer_host: str) -> str:
    """The local IP address this host uses to reach ``peer_host`` (a name or an address).

    A UDP socket is "connected" to the peer: the kernel picks the route and the source address,
    and no packet is sent. Raises ``OSError`` naming the peer when the name does not resolve or no
    route leads there."""
    try:
        infos = socket.getaddrinfo(peer_host, 9, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve peer host {peer_host!r}: {e}") from None
    errors = []
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.connect(sockaddr)
            except OSError as e:
                errors.append(str(e))
                continue
            return s.getsockname()[0]
    raise OSError(f"no route from this host to {peer_host!r}: {'; '.join(errors) or 'no address'}")


def resolve(host: str) -> str:
    """``host`` as an IP address literal (the first address its name resolves to)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(f"cannot resolve host {host!r}: {e}") from None
    return str(infos[0][4][0])  # an address: str (the stub allows the int of an AF_CAN one)


def is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host in ("*", "")


def tcp_endpoint(host: str, port: int | str) -> str:
    """``tcp://host:port``, with an IPv6 literal in brackets as ZeroMQ wants it."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"
