"""StepRecord: what an engine's last step ran (for debugging and tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.runtime.input_batch import StepInputs
from octavo.runtime.scheduler import SchedulerOutput


@dataclass
class StepRecord:
    """What the last step ran: the schedule, its inputs and the logits rows it produced."""

    schedule: SchedulerOutput
    inputs: StepInputs
    logits: torch.Tensor
