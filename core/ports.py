"""A free local TCP port, without importing torch (the launchers and the Slurm job wrapper need one
before any rank starts)."""

import random
import socket
from pathlib import Path

EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
BELOW = 16384  # how far below the ephemeral range a port is drawn
TRIES = 64


def ephemeral_range() -> tuple[int, int] | None:
    """The ports the kernel hands out to bind(0) and to every outgoing connection (Linux), or None."""
    try:
        low, high = map(int, Path(EPHEMERAL).read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port nothing holds now, drawn at random below the kernel's ephemeral range where there is one.
    A port from bind(0) is one the kernel hands out again, to any process's bind(0) or outgoing
    connection, as soon as it is released: gloo opens dozens a run, and in a test run of two workers
    one took the port between this function and the launcher's own bind (torchrun's rendezvous
    failed with EADDRINUSE, CI 2026-11-28). Below the range only another launcher drawing the same
    port at random can collide, and one that is held now is not returned."""
    span = ephemeral_range()
    if span and span[0] > 2048:
        start = max(1024, span[0] - BELOW)
        for _ in range(TRIES):
            port = random.randrange(start, span[0])
            if bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
