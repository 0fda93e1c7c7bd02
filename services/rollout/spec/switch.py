"""SD on/off by running batch size, with hysteresis.

Off at once when the batch exceeds the threshold (a big batch is compute-bound: verifying many draft
tokens would only slow it down); on again after `hysteresis_steps` consecutive decode steps with batch
<= threshold. The reference switched on after 10 steps under the threshold; flapping every step would
thrash the drafter's state for nothing. The hysteresis guards against a batch that was just above the
threshold: an engine that has not yet seen one (a fresh server's first small requests, a tail-only
workload) speculates from its first decode step, not after `hysteresis_steps` plain ones (10 of a
~150-step request's, a sixth of its speculation, at the 1gpu/8gpu presets' 10). A step with prefill in it (a prompt chunk, alone or beside decodes) never
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
        self._below = hysteresis_steps  # no step above the threshold yet: nothing to guard against
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
