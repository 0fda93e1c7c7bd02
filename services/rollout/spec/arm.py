"""The arm of speculative decoding: one draft shape `steps_topk_drafttokens` (e.g. "8_4_48"), or "plain".

No torch here: configs parse and validate arms (`[rollout.spec]`, `--spec-arms`) before a command loads torch.
How an arm's tree is drafted and masked: tree.py.
"""

from __future__ import annotations

from dataclasses import dataclass

PLAIN = "plain"


@dataclass(frozen=True, order=True)
class Arm:
    """One speculative shape: `steps` levels, `topk` children per expanded node, `draft_tokens` verified."""

    steps: int
    topk: int
    draft_tokens: int

    @classmethod
    def parse(cls, text: str) -> Arm:
        if text.strip() == PLAIN:
            return cls(0, 0, 1)
        parts = text.strip().split("_")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"arm {text!r} must look like steps_topk_drafttokens, e.g. 8_4_48, or be {PLAIN!r}")
        arm = cls(int(parts[0]), int(parts[1]), int(parts[2]))
        arm.validate()
        return arm

    @property
    def is_plain(self) -> bool:
        """No drafts: the step decodes plainly (the bandit's way of not speculating)."""
        return (self.steps, self.topk, self.draft_tokens) == (0, 0, 1)

    @property
    def name(self) -> str:
        return PLAIN if self.is_plain else f"{self.steps}_{self.topk}_{self.draft_tokens}"

    def __str__(self) -> str:
        return self.name

    @property
    def max_nodes(self) -> int:
        """Root plus every candidate EAGLE-2 drafting can produce: topk + (steps - 1) * topk^2."""
        return 1 + self.topk + (self.steps - 1) * self.topk * self.topk

    def validate(self) -> None:
        if self.is_plain:
            return
        if self.steps < 1 or self.topk < 1:
            raise ValueError(f"arm {self.name}: steps and topk must be >= 1")
        if self.draft_tokens < 2:
            raise ValueError(f"arm {self.name}: draft_tokens must be >= 2 (the root plus at least one draft)")
        if self.draft_tokens > self.max_nodes:
            raise ValueError(
                f"arm {self.name}: draft_tokens {self.draft_tokens} exceeds the {self.max_nodes} nodes that "
                f"{self.steps} steps with topk {self.topk} can draft; lower draft_tokens or raise steps/topk"
            )
