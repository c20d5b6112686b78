"""Where the engine's host time goes, step by step: a running sum per part of the step loop.

The parts of a plain step, in order: `schedule` (the scheduler's decision), `inputs` (the step's metadata
built and copied into the captured graph's static buffers, or for an eager step its metadata and inputs),
`launch` (the graph's replay, or the eager forward's launches), `sample` (sampling, ending in the host's
wait for the sampled tokens: it holds the GPU's share of the step) and `outputs` (the scheduler's update,
stops, detokenizing and the request outputs). Everything but `sample` is host work the GPU waits on
while the step loop is serial; `glm5next bench` sets the sum beside the captured step's own time. With
asynchronous scheduling the wait for a step's tokens (in `sample`) comes after the next step's launch, and
the host work of one step overlaps the GPU's work on the step before.
"""

from __future__ import annotations

import time

PARTS = ("schedule", "inputs", "launch", "sample", "outputs")


class HostTimes:
    """Seconds per part summed over the steps since the last `reset`, and the step count."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.steps = 0
        self._mark = time.perf_counter()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.steps = 0

    def start(self) -> None:
        """Begin a part at the current time (the time since the last mark belongs to no part)."""
        self._mark = time.perf_counter()

    def lap(self, part: str) -> None:
        """Charge the time since the last mark to `part` and mark now."""
        now = time.perf_counter()
        self.seconds[part] += now - self._mark
        self._mark = now

    def per_step_ms(self) -> dict[str, float]:
        """Mean milliseconds per step of each part."""
        n = max(self.steps, 1)
        return {part: 1e3 * s / n for part, s in self.seconds.items()}
