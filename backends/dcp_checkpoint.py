"""Sharded checkpoints through torch.distributed.checkpoint, for the FSDP backends.

Each rank writes its own shards of the model and optimizer state (get_state_dict gives them with
the plain model's parameter names, wrapper prefixes removed); the LR schedule and the loss scaler,
the same on every rank, go to extra.pt. training/export.py consolidates the shards offline.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from core.owned import DCP_FORMAT


class DCPCheckpointMixin:
    checkpoint_format = DCP_FORMAT

    def save_checkpoint(self, directory: Path) -> None:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(directory / "dcp"))
        if self.env.is_main:
            torch.save({"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()},
                       directory / "extra.pt")

    def load_checkpoint(self, directory: Path) -> None:
        # get_state_dict initialises the optimizer's state, so the shapes to load into exist.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(directory / "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        extra = torch.load(directory / "extra.pt", map_location=self.env.device, weights_only=True)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.scaler.load_state_dict(extra["scaler"])
