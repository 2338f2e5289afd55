"""reachable_ip: the one place that picks the address a TCP queue or a node's reply queues
advertise (SHARDSERVE_HOST_IP, else the route's source address)."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from shardserve.ipc import host_address
from shardserve.ipc.host_address import reachable_ip


def test_shardserve_host_ip_wins(monkeypatch) -> None:
    monkeypatch.setenv("SHARDSERVE_HOST_IP", "10.1.2.3")
    assert reachable_ip() == reachable_ip(("127.0.0.1", 9)) == "10.1.2.3"


def test_the_source_address_of_the_route(monkeypatch) -> None:
    monkeypatch.delenv("SHARDSERVE_HOST_IP", raising=False)
    assert reachable_ip(("127.0.0.1", 9)) == "127.0.0.1"  # loopback answers from loopback
    ipaddress.ip_address(reachable_ip())  # the default route's (or 127.0.0.1 without one)


class _NoRoute(socket.socket):
    def connect(self, address: object) -> None:
        raise OSError(101, "Network is unreachable")


def test_no_route_is_loopback_by_default_and_an_error_toward_a_peer(monkeypatch) -> None:
    monkeypatch.delenv("SHARDSERVE_HOST_IP", raising=False)
    monkeypatch.setattr(host_address.socket, "socket", _NoRoute)
    assert reachable_ip() == "127.0.0.1"
    with pytest.raises(OSError, match="unreachable"):  # a guess node 0 could not dial
        reachable_ip(("10.0.0.1", 29555))
