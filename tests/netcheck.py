"""Which TCP addresses processes listen on, as ``ss -ltnp`` shows them (psutil reads /proc; no root needed)."""

from __future__ import annotations

import ipaddress

import psutil


def listening(pids) -> list[tuple[int, str, str, int]]:
    """``(pid, process name, address, port)`` of every listening TCP socket of ``pids`` (gone processes skipped)."""
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            name = p.name()
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        out += [(pid, name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4 loopback address mapped into IPv6 (``::ffff:127.0.0.1``)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def beyond_loopback(pids) -> list[tuple[int, str, str, int]]:
    """The listening sockets of ``pids`` reachable from other hosts (``0.0.0.0``, ``::``, a real address)."""
    return [s for s in listening(pids) if not is_loopback(s[2])]
