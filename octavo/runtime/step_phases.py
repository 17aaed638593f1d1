"""Wall time of the phases of engine steps (schedule, inputs, model, sample, ...), for profiling.

The engine wraps each phase of a step in ``phases.time(name)``. While recording
is off (the default) that is a shared no-op context, so a step pays nothing
measurable; `octavo bench --profile` turns it on to split a step's time, and
while a torch.profiler records, every phase also shows up as a labelled range
in its trace.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

PHASE_LABEL_PREFIX = "octavo::"
"""torch.profiler ranges of phase NAME are labelled octavo::NAME."""

_NO_RECORDING = contextlib.nullcontext()


class StepPhases:
    """Accumulates seconds per phase name while `recording` is on."""

    def __init__(self) -> None:
        self.recording = False
        self.seconds: dict[str, float] = defaultdict(float)

    def time(self, name: str) -> contextlib.AbstractContextManager:
        """A context that adds its wall time to phase `name` (a no-op unless recording)."""
        if not self.recording:
            return _NO_RECORDING
        return self._timed(name)

    @contextlib.contextmanager
    def _timed(self, name: str):
        start = time.perf_counter()
        # A labelled range is a dispatcher call at each end (4-5 us a phase hot, more right after a step's
        # weights went through the caches): opened only while a profiler records, so that the steps timed
        # without one do not carry it in their phases.
        labelled = torch._C._autograd._profiler_enabled()
        with torch.profiler.record_function(PHASE_LABEL_PREFIX + name) if labelled else _NO_RECORDING:
            yield
        self.seconds[name] += time.perf_counter() - start

    @contextlib.contextmanager
    def record(self):
        """Record from now until the block ends; yields the dict of seconds per phase (reset first)."""
        self.seconds = defaultdict(float)
        self.recording = True
        try:
            yield self.seconds
        finally:
            self.recording = False
