"""The deployment guide, the presets and the Kubernetes manifests agree with the code.

- every preset the guide names is a file in deploy/configs/, and every
  service it names is a Compose service and a Kubernetes workload;
- every section of every preset loads into its service's typed config
  (an unknown section fails, and so does a known one whose config class does not import);
- every TLT_<SECTION>__<FIELD> variable in Compose and the manifests names a
  real field;
- the manifests: each container command parses with the real `tlt` CLI,
  probes hit the ports the command binds, the ConfigMap's preset is a
  verbatim copy of deploy/configs/8gpu.toml, and the DeepSpeed hostfile
  matches the trainer Job (one line per pod, slots = GPUs per pod).

Slow: the manifests validate strictly against Kubernetes' OpenAPI schemas
(kubernetes-validate 1.37.0 in a throwaway venv). No cluster here: this
checks the files, not a running deployment (see the guide's "What was
verified").
"""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "DEPLOY.md"
CONFIGS = ROOT / "deploy" / "configs"
K8S = ROOT / "deploy" / "k8s"

SECTIONS = {
    "rollout": ("tlt.services.rollout.config", "RolloutConfig"),
    "trainer": ("tlt.services.trainer.config", "TrainerConfig"),
    "reward": ("tlt.services.reward.config", "RewardConfig"),
    "drafter": ("tlt.services.drafter.config", "DrafterServiceConfig"),
    "sglang": ("tlt.services.rollout.sglang_backend.config", "SGLangBackendConfig"),
    "run": ("tlt.services.trainer.run_config", "RunConfig"),
}


def config_class(section: str):
    assert section in SECTIONS, f"unknown preset section [{section}]; known: {sorted(SECTIONS)}"
    module, name = SECTIONS[section]
    return getattr(importlib.import_module(module), name)


def guide_table(heading: str) -> list[str]:
    """First-column backticked names of the first table under `## heading`."""
    text = GUIDE.read_text()
    part = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \|", part, flags=re.M)


def k8s_docs() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def containers(docs):
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                yield d, c


# -- the guide names only things that exist -------------------------------------------------


def test_guide_presets_exist():
    named = set(guide_table("Presets"))
    text = GUIDE.read_text()
    named |= set(re.findall(r"(?:--preset |PRESET=)([a-z0-9-]+)", text))
    named |= set(re.findall(r"deploy/configs/([a-z0-9-]+)\.toml", text))
    assert {"cpu-tiny", "1gpu", "8gpu"} <= named
    missing = sorted(n for n in named if not (CONFIGS / f"{n}.toml").exists())
    assert not missing, f"the guide names presets with no file: {missing}"
    undocumented = sorted(p.stem for p in CONFIGS.glob("*.toml") if p.stem not in guide_table("Presets"))
    assert not undocumented, f"document these presets in docs/DEPLOY.md: {undocumented}"


def test_guide_services_are_compose_services_and_k8s_workloads():
    named = set(guide_table("What runs"))
    compose = set(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]) - {"token"}  # a job
    assert named == compose == {"rollout", "reward", "drafter", "trainer"}
    workloads = {d["metadata"]["name"] for d in k8s_docs() if d["kind"] in ("Deployment", "StatefulSet", "Job")}
    assert workloads == {f"tlt-{n}" for n in named}


def test_guide_files_exist():
    for rel in set(re.findall(r"`((?:deploy|docs|services|tests)/[A-Za-z0-9_./-]+)`", GUIDE.read_text())):
        assert (ROOT / rel.rstrip("/")).exists(), f"docs/DEPLOY.md names {rel}, which does not exist"


# -- presets load into the real configs ------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(p.stem for p in CONFIGS.glob("*.toml")))
def test_preset_sections_load(preset):
    from tlt.services.common.config import load_config

    data = tomllib.loads((CONFIGS / f"{preset}.toml").read_text())
    assert data, f"{preset}: no section to check"
    for section in data:
        load_config(config_class(section), section, preset, environ={})


def _env_names() -> set[str]:
    names = set()
    for e in (yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][s].get("environment", [])
              for s in ("rollout", "reward", "drafter", "trainer")):
        names |= {x.split("=", 1)[0] for x in e}
    for _, c in containers(k8s_docs()):
        names |= {e["name"] for e in c.get("env", [])}
    return {n for n in names if re.fullmatch(r"TLT_[A-Z]+__[A-Z0-9_]+", n)}


def test_env_overrides_name_real_fields():
    """TLT_<SECTION>__<FIELD>, and TLT_<SECTION>__<SUB>__<FIELD> for a nested section ([rollout.spec])."""
    checked = 0
    for name in sorted(_env_names()):
        section, *path = name[4:].lower().split("__")
        cls = config_class(section)
        where = f"[{section}]"
        for i, part in enumerate(path):
            assert part in cls.model_fields, f"{name}: {where} has no field {part!r}"
            if i < len(path) - 1:
                cls = cls.model_fields[part].annotation
                assert isinstance(cls, type) and hasattr(cls, "model_fields"), f"{name}: {where} {part!r} is no section"
                where = f"[{where[1:-1]}.{part}]"
        checked += 1
    assert checked >= 10


# -- Kubernetes manifests ------------------------------------------------------------------------


def test_configmap_preset_is_the_8gpu_preset_and_hostfile_matches_the_job():
    docs = k8s_docs()
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert cm["data"]["preset.toml"] == (CONFIGS / "8gpu.toml").read_text()
    (job,) = [d for d in docs if d["kind"] == "Job"]
    gpus = job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    lines = cm["data"]["hostfile"].split("\n")
    hosts = [line.split() for line in lines if line.strip()]
    assert hosts == [[f"tlt-trainer-{i}.tlt-trainer", f"slots={gpus}"] for i in range(job["spec"]["completions"])]
    assert job["spec"]["template"]["spec"]["subdomain"] == "tlt-trainer"
    cmd = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--master_addr") + 1] == "tlt-trainer-0.tlt-trainer"
    assert cmd[cmd.index("--node_rank") + 1] == "$(JOB_COMPLETION_INDEX)"


def test_trainer_reaches_every_rollout_server():
    import json

    docs = k8s_docs()
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "tlt-rollout"]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    addresses = json.loads(env["TLT_TRAINER__ROLLOUT_ADDRESSES"])
    assert addresses == [f"tlt-rollout-{i}.tlt-rollout:50051" for i in range(sts["spec"]["replicas"])]


def _tlt_args(command: list[str]) -> list[str]:
    if command[0] == "tlt":
        return command[1:]
    i = command.index("--module")
    assert command[0] == "deepspeed" and command[i + 1] == "tlt.cli"
    return command[i + 2 :]


@pytest.mark.parametrize("workload", ["tlt-rollout", "tlt-reward", "tlt-drafter", "tlt-trainer"])
def test_k8s_commands_parse_and_probes_match_ports(workload):
    from tlt.cli import COMMANDS, _available, build_parser

    (d, c), = [(d, c) for d, c in containers(k8s_docs()) if d["metadata"]["name"] == workload]
    args = _tlt_args(c["command"])
    cmd = next(x for x in COMMANDS if x.path == tuple(args[: len(x.path)]))
    ports = {p["containerPort"] for p in c.get("ports", [])}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if probe in c:
            command = c[probe]["exec"]["command"]
            checks = command[2 : command.index("--when")] if "--when" in command else command[2:]
            targets = checks[1::2]
            for t in targets:
                assert int(re.search(r":(\d+)", t).group(1)) in ports, f"{workload} {probe} checks {t}, not a container port"
    assert "readinessProbe" in c or "livenessProbe" in c
    assert _available(cmd), f"`tlt {' '.join(cmd.path)}`: {cmd.module} is missing"
    parsed = build_parser((cmd,)).parse_args(args)
    preset = getattr(parsed, "preset", None) or getattr(parsed, "config", None)
    assert preset == "/etc/tlt/preset/preset.toml"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/etc/tlt/preset" in mounts and "/models" in mounts or workload == "tlt-reward"


@pytest.mark.slow
def test_manifests_validate_against_the_kubernetes_openapi_schemas(tmp_path):
    """kubernetes-validate 1.37.0 (Kubernetes' own OpenAPI schemas), strict: unknown fields are errors."""
    import subprocess
    import sys

    venv = tmp_path / "kv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "kubernetes-validate==1.37.0"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        pytest.skip(f"could not install kubernetes-validate here: {r.stderr[-500:]}")
    tool = str(venv / "bin" / "kubernetes-validate")
    files = [str(p) for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"]
    r = subprocess.run([tool, "--strict", "--quiet", *files], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text((K8S / "rollout.yaml").read_text().replace("podManagementPolicy", "podManagmentPolicy"))
    r = subprocess.run([tool, "--strict", "--quiet", str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "podManagmentPolicy" in r.stdout + r.stderr


def test_guide_preset_table_matches_the_presets():
    """The numbers the Presets table quotes (prompts x samples, replicas, ZeRO stage, dtype) are the presets'."""
    text = GUIDE.read_text().split("\n## Presets\n", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z0-9-]+)` \|.*$", text, flags=re.M)}
    assert set(rows) == {p.stem for p in CONFIGS.glob("*.toml")}
    for name, row in rows.items():
        preset = tomllib.loads((CONFIGS / f"{name}.toml").read_text())
        trainer, rollout = preset["trainer"], preset["rollout"]
        m = re.search(r"(\d+) prompts x (\d+) samples", row)
        assert m and (int(m.group(1)), int(m.group(2))) == (trainer["prompts_per_step"], trainer["n_samples"]), (
            f"{name}: the guide says {m and m.group(0)!r}, the preset "
            f"{trainer['prompts_per_step']} prompts x {trainer['n_samples']} samples")
        m = re.search(r"(\d+) (?:CPU )?replicas?\b", row)
        assert m and int(m.group(1)) == rollout.get("replicas", 1), f"{name}: replicas {m and m.group(0)!r}"
        m = re.search(r"ZeRO-(\d)", row)
        assert m is None or int(m.group(1)) == trainer.get("zero_stage", 0), f"{name}: {m.group(0)}"
        dtype = rollout.get("engine", {}).get("dtype")
        assert {"bfloat16": "bf16", "float32": "fp32"}[dtype] in row, f"{name}: rollout dtype {dtype}"


def test_the_trainer_pods_probe_checks_metrics_only_on_the_pod_that_serves_them(monkeypatch):
    """Only global rank 0 serves /metrics (loop.py), on pod 0 of the Indexed Job; pod 1 (ranks 8-15) never does,
    and a liveness probe that required it killed pod 1, and with backoffLimit 0 the whole Job, 23 minutes in."""
    import importlib.util

    (d, c), = [(d, c) for d, c in containers(k8s_docs()) if d["metadata"]["name"] == "tlt-trainer"]
    command = c["livenessProbe"]["exec"]["command"]
    assert command[:2] == ["python", "/app/deploy/healthcheck.py"]
    spec = importlib.util.spec_from_file_location("healthcheck", Path(__file__).parents[1] / "deploy" / "healthcheck.py")
    healthcheck = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(healthcheck)
    unserved = [a.replace("9460", "9") for a in command[2:]]  # port 9: nothing listens, as on pod 1
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    assert healthcheck.main(unserved + ["--timeout", "2"]) == 0
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")  # pod 0 is still checked
    assert healthcheck.main(unserved + ["--timeout", "2"]) == 1


@pytest.mark.parametrize("workload", ["tlt-rollout", "tlt-reward", "tlt-drafter", "tlt-trainer"])
def test_pods_run_as_the_image_user_and_own_the_volumes_they_mount(workload):
    """Every pod ran as uid 10001 with no fsGroup: a fresh ReadWriteMany volume owned by root (NFS, most CSI
    drivers) left the trainer and the drafter unable to write /runs and their checkpoints. The pods now set
    fsGroup to the image user's group, which the Dockerfile creates with that gid."""
    uid = re.search(r"^ARG UID=(\d+)$", (ROOT / "deploy" / "Dockerfile").read_text(), re.M).group(1)
    assert f"groupadd --gid ${{UID}} tlt" in (ROOT / "deploy" / "Dockerfile").read_text()
    (d, _), = [(d, c) for d, c in containers(k8s_docs()) if d["metadata"]["name"] == workload]
    ctx = d["spec"]["template"]["spec"]["securityContext"]
    assert ctx["runAsNonRoot"] and ctx["runAsUser"] == ctx["runAsGroup"] == ctx["fsGroup"] == int(uid), ctx
