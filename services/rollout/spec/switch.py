"""SD on/off by running batch size, with hysteresis.

On after `hysteresis_steps` consecutive decode steps with batch <= threshold; off at once when the
batch exceeds it (a big batch is compute-bound: verifying many draft tokens would only slow it down).
The reference switched on after 10 steps under the threshold; flapping every step would thrash the
drafter's state for nothing. A step with prefill in it (a prompt chunk, alone or beside decodes) never
counts toward switching on, else a long chunked prompt met the hysteresis before its first decode step;
it does not break a run of decode steps either (it says nothing of the batch being big), and over the
threshold it switches SD off like any step.
"""

from __future__ import annotations


class SpecSwitch:
    def __init__(self, threshold: int, hysteresis_steps: int) -> None:
        self.threshold = threshold
        self.hysteresis_steps = hysteresis_steps
        self.on = False
        self._below = 0
        self.switches = 0

    def update(self, batch_size: int, decode: bool = True) -> bool:
        """Feed the running batch size of this step (decode: the step is decode-only); returns whether SD is on."""
        if batch_size > self.threshold:
            self._below = 0
            if self.on:
                self.on = False
                self.switches += 1
            return False
        if not decode:  # a step with prefill: no count toward switching on
            return self.on
        self._below += 1
        if not self.on and self._below >= self.hysteresis_steps:
            self.on = True
            self.switches += 1
        return self.on
