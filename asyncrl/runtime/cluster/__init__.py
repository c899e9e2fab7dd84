"""A cluster of nodes: node 0's supervisor and the agents of the others.

    nodes.py    node 0's side: the cluster socket, node membership and loss, `RemoteProcess` (an
                actor process on another node, seen through its agent), `NodeStatus`
    agent.py    the node agent run by ``asyncrl launch --node-rank R`` (R > 0): joins, starts and
                stops workers, forwards their logs, reports exits, exits when the supervisor is gone
    auth.py     the cluster secret, the CURVE key pair derived from it, and `Gatekeeper` (the ZAP
                allow-list and its refusals)

See docs/runtime.md ("asyncrl launch") for multi-node runs.
"""
