"""The native rollout engine: continuous batching over a paged KV cache.

    GenerationRequest -> Sequence (n per request) -> Scheduler batch
        -> ModelRunner (AttentionMetadata + tensors -> Transformer) -> Sampler -> StepOutput / CompletionOutput

Import the pieces from their modules (`engine.engine.LLMEngine`,
`engine.config.EngineConfig`); this file stays light.
"""
