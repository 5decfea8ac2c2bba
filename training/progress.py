"""Progress of a run on rank 0: a tqdm bar on a terminal, plain lines otherwise, nothing if quiet."""

from __future__ import annotations

import sys

from tqdm import tqdm


def runs_bar(total: int, desc: str):
    """A sweep's bar over its runs (or searches): on stderr, drawn only on a terminal."""
    return tqdm(total=total, desc=desc, unit="run", disable=not sys.stderr.isatty(), dynamic_ncols=True)


class Progress:
    def __init__(self, steps: int, enabled: bool):
        self.steps = steps
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stdout.isatty():
            self.bar = tqdm(total=steps, unit="step", dynamic_ncols=True)

    def update(self, step: int, line: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = step + 1
            self.bar.set_postfix(loss=f"{line['loss']:.4f}", sps=f"{line['samples_per_s']:.1f}", refresh=True)
            return
        val = f" | val {line['val_loss']:.4f}" if "val_loss" in line else ""
        print(f"step {step + 1}/{self.steps} | loss {line['loss']:.4f}{val} | lr {line['lr']:.2e} | "
              f"{line['step_time_s'] * 1e3:.0f} ms | {line['samples_per_s']:.1f} samples/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
