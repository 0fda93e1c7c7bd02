"""The policy trainer: GRPO on a DeepSpeed-wrapped `transformers` model, fed by the rollout service.

    data.PromptSampler -> collect (rollout.BatchGenerate stream, rewards per completion as it arrives)
      -> step.grpo_step (grpo: advantages, PPO-clip token-mean loss, k3 KL; policy: DeepSpeed update)
      -> weight_sync (UpdateWeights to every rollout server, version check on the next rollout)
      -> checkpoint (atomic; kill -9 safe) -> loop.train / `tlt train`

One concept per module: grpo.py (pure maths), policy.py (model + DeepSpeed),
step.py (one update), data.py, rewards.py, collect.py, weight_sync.py,
checkpoint.py, loop.py, config.py (TrainerConfig), types.py (records).
"""
