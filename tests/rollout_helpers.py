"""Shared helpers for the rollout server tests: a tiny checkpoint and a real server on loopback.

`tiny_checkpoint(dir)` writes a seeded, randomly initialised Qwen2 checkpoint
with the task tokenizer (chat template included); `hermes_checkpoint(dir)` the same
with a small Hermes-style chat template that renders tools. `ServerThread` runs the
real `RolloutServer` (real replica processes with the real native engine,
real uvicorn, real grpc.aio) on an event loop in a background thread, on free
ports of 127.0.0.1. `ServeProcess` runs `tlt rollout serve` as a subprocess.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

# Small enough that a replica loads in seconds and a step takes milliseconds on one core.
ENGINE_TEST_SETTINGS = {"max_model_len": 256, "max_num_seqs": 64, "num_kv_blocks": 512, "block_size": 16}


def tiny_checkpoint(out_dir: Path, seed: int = 0, max_position_embeddings: int = 256) -> Path:
    import torch
    import transformers

    from tlt.model.tokenizer import build_tokenizer

    out_dir = Path(out_dir)
    tok = build_tokenizer(out_dir)
    cfg = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_position_embeddings, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(out_dir)
    return out_dir


# Renders the tools' JSON in a system block, an assistant's calls as <tool_call> blocks (arguments as the
# mapping HF templates expect: `tojson` of a string would render a quoted string), tool results as a user turn.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these tools:\n<tools>"
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls %}<tool_call>\n{{ {'name': tc.function.name, 'arguments': tc.function.arguments}"
    " | tojson }}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def hermes_checkpoint(out_dir: Path) -> Path:
    """`tiny_checkpoint` whose tokenizer's chat template is HERMES_TEMPLATE (the shipped tiny template does not
    render tools), with 1024 positions: the tiny tokenizer spends about a token per character of the tools' JSON."""
    d = tiny_checkpoint(out_dir, max_position_embeddings=1024)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = HERMES_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return d


def learned_drafter(model_dir: Path, folder: Path) -> tuple[dict, dict]:
    """A rollout drafting with a learned drafter of `model_dir` (seed 3) saved in `folder`, and the state dict of
    another (seed 4) to push to it: (the `spec` for `rollout_config`, that state dict)."""
    import safetensors.torch
    import torch

    from tlt.model.drafter import Drafter, DrafterConfig

    weights = safetensors.torch.load_file(str(model_dir / "model.safetensors"))
    cfg = DrafterConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    torch.manual_seed(3)
    Drafter(cfg, embed, head).save(folder)
    torch.manual_seed(4)
    pushed = Drafter(cfg, embed, head).state_dict()
    return {"mode": "adaptive", "drafter": "learned", "drafter_path": str(folder)}, pushed


def rollout_config(**overrides: Any) -> Any:
    from tlt.services.rollout.config import RolloutConfig
    from tlt.services.rollout.engine.config import EngineConfig

    engine = EngineConfig(**{**ENGINE_TEST_SETTINGS, **overrides.pop("engine", {})})
    # max_restarts=0: tests that kill a replica check the dead state; tests/reliability/ turns restarts on
    base = {"http_port": 0, "grpc_port": 0, "threads_per_replica": 1, "startup_timeout_s": 120.0, "max_restarts": 0}
    return RolloutConfig(**{**base, **overrides, "engine": engine})


class ServerThread:
    """`with ServerThread(model_dir, replicas=2) as s: s.base_url, s.grpc_address`."""

    def __init__(self, model_dir: Path, **overrides: Any) -> None:
        from tlt.services.rollout.server import RolloutServer

        self.server = RolloutServer(model_dir, rollout_config(**overrides))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-server", daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop)
        try:
            started.result(timeout=180)
        except BaseException:  # as `tlt rollout serve` does: what started goes (replicas, ports, the GC probe)
            started.cancel()  # a start still running (a timeout, Ctrl-C) ends before the stop
            try:
                started.result(timeout=60)
            except BaseException:  # noqa: S110 - its outcome is the error being raised below
                pass
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.loop.is_running():  # stopped already (a failed __enter__ cleans up), or never started
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def call(self, coro: Any, timeout: float = 60) -> Any:
        """Run a coroutine on the server's loop (e.g. pool.snapshot())."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.http_port}/v1"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    @property
    def model_name(self) -> str:
        return self.server.model_name


class ServeProcess:
    """`tlt rollout serve` in a subprocess on free ports; stopped with SIGTERM."""

    def __init__(self, model_dir: Path, workdir: Path, replicas: int = 1, extra: tuple[str, ...] = ()) -> None:
        self.ready_file = Path(workdir) / "ready.json"
        self.log_file = Path(workdir) / "serve.log"
        sets = [f"--set=engine.{k}={v}" for k, v in ENGINE_TEST_SETTINGS.items()]
        self.cmd = [sys.executable, "-m", "tlt.cli", "rollout", "serve", "--model", str(model_dir),
                    "--replicas", str(replicas), "--http-port", "0", "--grpc-port", "0",
                    "--ready-file", str(self.ready_file), "--set", "threads_per_replica=1", *sets, *extra]
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    def __enter__(self) -> "ServeProcess":
        self._log = self.log_file.open("w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ})
        deadline = time.monotonic() + 180
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"server did not start:\n{self.log_file.read_text()[-4000:]}")
            time.sleep(0.2)
        self.info = json.loads(self.ready_file.read_text())
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.info['http_port']}/v1"

    @property
    def pids(self) -> list[int]:
        return [self.info["pid"], *self.info["replica_pids"]]


def pid_gone(pid: int) -> bool:
    """The process has exited; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # the state field follows the ")" that ends the command name (which may hold spaces)
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def assert_all_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    """Every process in `pids` exits within `timeout_s` (a zombie counts as gone)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not all(pid_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(pid_gone(p) for p in pids), [p for p in pids if not pid_gone(p)]


def stream_then_kill(s: "ServerThread", body: dict, replica: Any) -> list[str]:
    """POST a streamed /v1/completions `body`; once its first chunk arrived, SIGKILL the replica `replica()` names
    (a process the test started); the non-empty SSE lines that follow it."""
    import signal

    import httpx

    with httpx.stream("POST", f"{s.base_url}/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert "error" not in first, first
        os.kill(s.server.replica_pids()[replica()], signal.SIGKILL)
        return [line for line in lines if line]


# Two function tools for the tool-calling tests (tests/test_rollout_tools.py, tests/test_rollout_scripted_tools.py)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
TOOLS = [WEATHER, ADD]


class RpcFailure(grpc.RpcError, grpc.Call):
    """A gRPC call's failure with the status code and details a server ended it with, raised by a scripted client."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__()
        self._code, self._details = code, details

    def code(self): return self._code  # noqa: E704
    def details(self): return self._details  # noqa: E704
    def initial_metadata(self): return None  # noqa: E704
    def trailing_metadata(self): return None  # noqa: E704
    def is_active(self): return False  # noqa: E704
    def time_remaining(self): return None  # noqa: E704
    def cancel(self): return False  # noqa: E704
    def add_callback(self, cb): return False  # noqa: E704


class ReplicaDied(RpcFailure):
    """The UNAVAILABLE error a rollout stream ends with when a replica died and its samples could not be
    re-dispatched (what the trainer's collect_retrying redoes a step on)."""

    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, "replica 0 died")


def kill_replica_once_busy(pool: Any, timeout_s: float = 120.0) -> threading.Thread:
    """A thread that kill -9s the pool's replica 0 as soon as it has sequences (a step's rollout is in it)."""
    pid = pool.replicas[0].process.pid

    def kill() -> None:
        deadline = time.monotonic() + timeout_s
        while pool.pending_sequences == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer
