"""TLT: adaptive speculative rollout and an elastic drafter trainer for RL of reasoning LLMs."""

__version__ = "0.1.0"
