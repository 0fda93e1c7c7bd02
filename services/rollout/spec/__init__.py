"""Speculative decoding for the native rollout engine: the pure parts.

    arm (steps_topk_drafttokens) -> draft tree (tree.py; learned drafter or n-gram, ngram.py)
      -> one target forward over the tree (engine) -> exact acceptance (accept.py) -> emit
    bucketed epsilon-greedy bandit picks the arm per batch size (bandit.py); SpecConfig (config.py).

Everything here is a function of tensors; the engine owns the KV cache and the model calls.
"""
