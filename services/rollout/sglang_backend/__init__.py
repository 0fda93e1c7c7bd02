"""The `sglang` rollout backend: SGLang 0.5.23 behind the native engine's interface.

Optional (`pip install 'tlt[sglang]'`, GPU only, never installed by default).
Nothing here imports SGLang at import time; `client.EngineClient` does when a
replica starts with `--backend sglang`.

- config.py : `SGLangBackendConfig`, the [sglang] preset section
- launch.py : ServerArgs keyword arguments and the adaptive speculative JSON
- requests.py: typed calls with SGLang's field names; stream chunk parsing
- client.py : `SGLangClient` (the boundary tests fake) and the real `EngineClient`
- engine.py : `SGLangEngine`, the adapter (requests, streaming, weight sessions, release/resume)
"""
