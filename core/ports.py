"""A free local TCP port, without importing torch (the launchers and the Slurm job wrapper need one
before any rank starts)."""

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
