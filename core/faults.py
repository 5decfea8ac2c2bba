"""Fault injection for tests of failure handling: GPTLITE_FAULT="kind=K,step=S[,rank=R][,backend=B]".

At the start of step S, on rank R (default: every rank), when the run's backend is B (default:
any), the run
- kind=error: raises RuntimeError, as a bug would;
- kind=oom:   raises torch.OutOfMemoryError, as CUDA does when memory runs out;
- kind=exit:  exits at once with code 1, skipping all cleanup, as a crashed process;
- kind=kill:  sends itself SIGKILL;
- kind=hang:  sleeps forever, as a rank stuck outside any collective;
- kind=interrupt: sends itself SIGINT, as Ctrl-C in a terminal does.

Unset (the normal case), nothing is checked beyond one comparison per step.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

from gptlite.errors import ConfigError

KINDS = ("error", "oom", "exit", "kill", "hang", "interrupt")
ENV = "GPTLITE_FAULT"


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    backend: str | None = None

    @classmethod
    def from_environment(cls, backend: str, rank: int) -> "Fault | None":
        spec = os.environ.get(ENV)
        if not spec:
            return None
        try:
            fields = dict(part.split("=", 1) for part in spec.split(","))
            fault = cls(fields.pop("kind"), int(fields.pop("step")),
                        int(fields["rank"]) if "rank" in fields else None, fields.get("backend"))
            fields.pop("rank", None)
            fields.pop("backend", None)
        except (KeyError, ValueError):
            raise ConfigError(f"{ENV} must look like kind=error,step=3[,rank=1][,backend=ddp] (got {spec!r})") from None
        if fields or fault.kind not in KINDS:
            raise ConfigError(f"{ENV}: kind must be one of {', '.join(KINDS)}; keys kind, step, rank, backend "
                              f"(got {spec!r})")
        if (fault.rank is not None and fault.rank != rank) or (fault.backend not in (None, backend)):
            return None
        return fault

    def maybe_fire(self, step: int) -> None:
        if step != self.step:
            return
        message = f"injected fault ({ENV}) at step {step}"
        if self.kind == "error":  # on two lines, as many libraries' messages are
            raise RuntimeError(f"{message}\n(the rest of a message on several lines)")
        if self.kind == "oom":
            raise torch.OutOfMemoryError(message)
        if self.kind == "exit":
            os._exit(1)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "interrupt":
            os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt, raised in the sleep below
        while True:  # hang
            time.sleep(3600)
