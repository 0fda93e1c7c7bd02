"""The rollout service: one front process serving N engine replica processes.

    clients --HTTP /v1 (http_api.py) or gRPC tlt.v1.Rollout (grpc_api.py)--> server.py (one asyncio loop)
        -> replicas.py: ReplicaPool, least-loaded spreading, weight pushes validated then applied everywhere
        --pipe (ipc.py messages)--> replica.py: one engine per process (backends.py: native engine/ or SGLang)
        -> StepOutputs / CompletionOutputs (types.py) back up, stamped with the weight versions

`serve.py` is `tlt rollout serve`; `client.py` is the trainer's gRPC client;
`config.py` holds [rollout] (with [rollout.engine] and [rollout.spec] nested).
"""
