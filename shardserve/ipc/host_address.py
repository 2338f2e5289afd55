"""This host's address as other machines reach it: where a TCP queue or a node's reply queues
listen, so that the address in a handle is one the reader can dial."""

from __future__ import annotations

import socket

from shardserve import envs

# Off this host and unlikely to be routed specially: the source address of the route to it is
# the default route's.
_ANY_REMOTE = ("10.255.255.255", 1)


def reachable_ip(toward: tuple[str, int] | None = None) -> str:
    """SHARDSERVE_HOST_IP when set; else this host's source address on the route toward
    `toward` (host, port), e.g. node 0's link; else, with no `toward`, on the default route
    (127.0.0.1 without one). No packet is sent: connecting a UDP socket only picks the route.

    With `toward`, no route raises (OSError): a guessed address there would be unreachable."""
    if ip := envs.host_ip():
        return ip
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(toward or _ANY_REMOTE)
            return s.getsockname()[0]
    except OSError:
        if toward is not None:
            raise
        return "127.0.0.1"
