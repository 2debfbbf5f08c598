"""`free_port`: ports handed to one cluster file's servers are distinct."""

from __future__ import annotations

import socket

from lookup_table.ops.localcluster import free_port


def test_ports_handed_out_one_after_another_are_distinct() -> None:
    """The kernel offers a just-closed port again readily; a cluster file whose memcached
    node and replica got the same port could not start."""
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    for port in ports[-5:]:  # and each was free to bind
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
