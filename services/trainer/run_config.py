"""`RunConfig` ([run] section) and the per-run config file that `tlt run` hands every service.

    preset TOML (deploy/configs/cpu-tiny.toml) + --steps / --set run.x=... / --baseline
      -> RunConfig (what the launcher itself does)
      -> runs/<id>/config.toml: the preset's service sections with this run's loopback
         ports, paths (checkpoints, drafter state under the run folder) and switches filled in;
         every child is started with `--preset/--config runs/<id>/config.toml`, so each
         service still loads its own typed config the ordinary way.

Ports are picked free on 127.0.0.1 when the run starts (a restart picks new ones;
everything that must survive a restart lives in files under the run folder).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import Field

from tlt.services.common.config import ServiceConfig
from tlt.services.common.config_cmd import toml_value
from tlt.services.common.ports import free_ports


class RunConfig(ServiceConfig):
    """The [run] section: how `tlt run` launches and watches the services."""

    runs_dir: str = Field("runs", min_length=1, description="parent folder of run folders (runs/<id>/); not empty "
                          "(that put the run in the current folder)")
    model_dir: str = Field("artifacts/tiny", min_length=1, description="the policy checkpoint every service loads")
    steps: int = Field(0, ge=0, description="RL steps; 0: the [trainer] section's steps")
    speculation: bool = Field(True, description="speculative decoding in the rollout as the [rollout.spec] section says; False: off")
    drafter: bool = Field(True, description="start the online drafter service (needs a rollout with a learned drafter)")
    drafter_workers: int = Field(0, ge=0, description="drafter worker processes; 0: one per rollout replica")
    drafter_init: str = Field(
        "", description="learned drafter to start from: '' keeps [rollout.spec] as it is; 'random': a seeded random "
        "drafter; 'warmup': `tlt drafter warmup` on the model first; or a drafter folder")
    drafter_warmup_problems: int = Field(
        1024, ge=8, description="drafter_init = 'warmup': problems the model samples for it (1 in 8 held out); the "
        "warm-up runs on the CPU at float32 before the run starts: for a large model, warm up once with `tlt drafter "
        "warmup` (or fewer problems) and give drafter_init its folder")
    drafter_warmup_epochs: int = Field(
        40, ge=1, description="drafter_init = 'warmup': training passes (the tiny model: ~50 s on 2 cores with 1,024 "
        "problems, held-out accept length 3.4; 32 x 2 left it at 1.15: BENCHMARKS.md, Session 42)")
    poll_interval_s: float = Field(0.1, gt=0, description="how often the rollout's status is sampled for the timeline")
    tail_threshold: int = Field(0, ge=0, description="running batch at or below which rollout time counts as tail; 0: the SD threshold (32 without one)")
    startup_timeout_s: float = Field(300.0, gt=0, description="how long services may take to become ready")
    stop_timeout_s: float = Field(20.0, gt=0, description="how long a service may take to stop after SIGTERM before SIGKILL")
    torch_threads: int = Field(0, ge=0, description="torch threads of the trainer; 0: the [trainer] section's")


def rollout_has_spec() -> bool:
    """Whether this build's rollout config takes a [rollout.spec] section (speculative decoding)."""
    from tlt.services.rollout.config import RolloutConfig

    return "spec" in RolloutConfig.model_fields


def drafter_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tlt.services.drafter.serve") is not None


def spec_section(preset: dict[str, Any]) -> dict[str, Any]:
    rollout = preset.get("rollout", {})
    return dict(rollout.get("spec", rollout.get("engine", {}).get("spec", {})))


def resolve_services(preset: dict[str, Any], run: RunConfig, run_dir: Path) -> tuple[dict[str, Any], dict[str, bool]]:
    """This run's service sections (ports, paths, switches) and which optional services run.

    Returns (sections, switches) where switches = {"speculation": ..., "drafter": ...} as they
    will really be (a switch the build cannot honour is off, and the caller says so).
    """
    cfg = copy.deepcopy(preset)
    host = "127.0.0.1"
    rollout = cfg.setdefault("rollout", {})
    reward = cfg.setdefault("reward", {})
    trainer = cfg.setdefault("trainer", {})
    # every port this run listens on, distinct, drawn below the ephemeral range (services/common/ports.py)
    http, grpc_port, reward_port, cap_pub, cap_snap, feats, coord, status = free_ports(8)
    rollout.update(host=host, http_port=http, grpc_port=grpc_port)
    reward.update(host=host, port=reward_port)
    trainer.update(model_dir=run.model_dir, output_dir=str(run_dir), rollout_addresses=[f"{host}:{grpc_port}"],
                   reward_address=f"{host}:{reward_port}")
    if run.steps:
        trainer["steps"] = run.steps
    if run.torch_threads:
        trainer["torch_threads"] = run.torch_threads

    has_spec = rollout_has_spec()
    spec = spec_section(cfg) if has_spec else {}
    speculation = has_spec and run.speculation and spec.get("mode", "adaptive") != "off"
    if has_spec:
        rollout["spec"] = {**spec, "mode": spec.get("mode", "adaptive") if speculation else "off"}
        rollout.get("engine", {}).pop("spec", None)
    if speculation and run.drafter_init:
        path = run_dir / "drafter-init" if run.drafter_init in ("random", "warmup") else Path(run.drafter_init)
        spec = {**spec, "drafter": "learned", "drafter_path": str(path)}
        rollout["spec"] = {**rollout["spec"], "drafter": "learned", "drafter_path": str(path)}
    learned = speculation and spec.get("drafter", "ngram") == "learned"
    drafter = run.drafter and learned and drafter_available()
    if drafter:
        rollout.update(capacity_pub=f"tcp://{host}:{cap_pub}", capacity_snapshot=f"tcp://{host}:{cap_snap}",
                       features_push=f"tcp://{host}:{feats}")
        d = cfg.setdefault("drafter", {})
        d.update(capacity_pub=f"tcp://{host}:{cap_pub}", capacity_snapshot=f"tcp://{host}:{cap_snap}",
                 features_bind=f"tcp://{host}:{feats}", coordinator_bind=f"tcp://{host}:{coord}",
                 rollout_grpc=f"{host}:{grpc_port}", host=host, status_port=status,
                 checkpoint_dir=str(run_dir / "drafter"))
        if spec.get("drafter_path") and not d.get("init_drafter"):
            d["init_drafter"] = spec["drafter_path"]
        if d.get("source", "rollout") == "trainer":  # the old-logprob pass feeds the drafter, not the rollout
            trainer["drafter_features_address"] = d["features_bind"]
            rollout.pop("features_push", None)
    else:
        for key in ("capacity_pub", "features_push"):
            rollout.pop(key, None)
    cfg.pop("run", None)
    return cfg, {"speculation": speculation, "drafter": drafter}


# -- a minimal TOML writer for the resolved config (tomllib only reads) ---------------------------

def to_toml(data: dict[str, Any], prefix: str = "") -> str:
    """Tables of scalars / arrays, nested tables as [a.b]; enough for service configs."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    # toml_value, not JSON: json.dumps wrote a character outside the BMP (an emoji in a --run-id) as a UTF-16
    # surrogate pair, which TOML refuses: every service then failed to read config.toml
    out = [f"{k} = {toml_value(v)}" for k, v in scalars.items() if v is not None]
    text = "\n".join(out) + ("\n" if out else "")
    for name, table in tables.items():
        full = f"{prefix}.{name}" if prefix else name
        text += f"\n[{full}]\n" + to_toml(table, full)
    return text
