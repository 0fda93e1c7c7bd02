"""docker-compose.yml checked without a Docker engine (none runs on this machine).

1. Schema: the file, raw and after variable interpolation (1gpu defaults and
   deploy/8gpu.env), validates against the published compose-spec JSON schema
   vendored in deploy/compose-spec.json (the one shipped in the
   docker-compose 1.29.2 wheel as compose/config/compose_spec.json), and the
   validator does reject a misspelt key and a wrong type.
2. Semantics: every service has a command and a health check; the model is
   mounted read-only from a required MODEL_PATH; named volumes are declared;
   GPU reservations follow the placement modes (colocated by default,
   disaggregated with deploy/8gpu.env); every ${VARIABLE} is documented in
   docs/DEPLOY.md; each command parses with the real `tlt` CLI parser.
3. Slow: `docker-compose config -q` from docker-compose 1.29.2 in a throwaway
   venv (needs the package registry; skipped when it cannot be installed).
4. Compose equivalence: each server's exact compose command and environment,
   run as a local process with only the container-specific parts mapped
   (`1gpu` -> `cpu-tiny`, /models/policy -> a seeded random checkpoint,
   0.0.0.0 -> 127.0.0.1, container ports -> free loopback ports, service
   names -> 127.0.0.1), must pass its own compose health check. A command
   whose module is missing or does not import fails (it is not skipped).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
SCHEMA = ROOT / "deploy" / "compose-spec.json"
ENV_8GPU = ROOT / "deploy" / "8gpu.env"
GUIDE = ROOT / "docs" / "DEPLOY.md"

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a dev dependency (pip install -e '.[dev]')")

# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}; $$ is a literal $.
_VAR = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)")


class MissingVariable(ValueError):
    pass


def interpolate_str(text: str, env: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group("name") or m.group("bare")
        op, arg = m.group("op"), m.group("arg")
        value = env.get(name)
        unset_or_empty = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-") and (value is None if op == "-" else unset_or_empty):
            return arg
        if op in (":?", "?") and (value is None if op == "?" else unset_or_empty):
            raise MissingVariable(f"{name}: {arg}")
        return value or ""

    return _VAR.sub(sub, text)


def interpolate(node, env):
    if isinstance(node, str):
        return interpolate_str(node, env)
    if isinstance(node, list):
        return [interpolate(x, env) for x in node]
    if isinstance(node, dict):
        return {k: interpolate(v, env) for k, v in node.items()}
    return node


def variables(node) -> set[str]:
    if isinstance(node, str):
        return {m.group("name") or m.group("bare") for m in _VAR.finditer(node) if m.group(0) != "$$"}
    if isinstance(node, list):
        return set().union(*(variables(x) for x in node)) if node else set()
    if isinstance(node, dict):
        return set().union(*(variables(v) for v in node.values())) if node else set()
    return set()


def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


@pytest.fixture(scope="module")
def raw():
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def validator():
    schema = json.loads(SCHEMA.read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def errors(validator, doc) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


BASE_ENV = {"MODEL_PATH": "/srv/models/qwen2.5-7b"}


def test_schema_raw_and_interpolated(raw, validator):
    assert errors(validator, raw) == []
    assert errors(validator, interpolate(raw, BASE_ENV)) == []
    assert errors(validator, interpolate(raw, {**BASE_ENV, **read_env_file(ENV_8GPU)})) == []


def test_schema_catches_mistakes(raw, validator):
    typo = copy.deepcopy(raw)
    typo["services"]["rollout"]["shm_sise"] = "16gb"
    assert any("shm_sise" in e for e in errors(validator, typo))
    wrong = copy.deepcopy(raw)
    wrong["services"]["reward"]["healthcheck"]["retries"] = "many"
    assert errors(validator, wrong)
    gpu = copy.deepcopy(raw)
    gpu["services"]["rollout"]["deploy"]["resources"]["reservations"]["devices"][0]["gpus"] = 1
    assert errors(validator, gpu)


def test_model_path_is_required(raw):
    with pytest.raises(MissingVariable, match="set MODEL_PATH"):
        interpolate(raw, {})


TOKEN_FILE = "/run/tlt/token"


def test_every_service_has_command_healthcheck_and_volumes(raw):
    doc = interpolate(raw, BASE_ENV)
    assert set(doc["services"]) == {"token", "rollout", "reward", "drafter", "trainer"}
    declared = set(doc.get("volumes") or {})
    for name, svc in doc["services"].items():
        if name == "token":  # the one-shot job that writes the control token (test below)
            continue
        assert svc.get("command"), f"{name} has no command"
        hc = svc.get("healthcheck")
        assert hc and hc["test"][0] == "CMD" and not hc.get("disable"), f"{name} has no health check"
        assert hc["test"][1:3] == ["python", "/app/deploy/healthcheck.py"]
        mounts = svc["volumes"]
        model = [m for m in mounts if isinstance(m, dict) and m["target"] == "/models/policy"]
        assert model and model[0]["read_only"] and model[0]["source"] == BASE_ENV["MODEL_PATH"], name
        for m in mounts:
            if isinstance(m, str):
                source = m.split(":")[0]
                if not source.startswith((".", "/")):
                    assert source in declared, f"{name} uses undeclared volume {source}"
        assert svc["shm_size"] == "16gb"
        assert "TLT_PRESET=1gpu" in svc["environment"]


def test_a_control_token_is_made_once_and_read_by_every_control_plane_service(raw):
    """`MODEL_PATH=... docker compose up` alone used to leave TLT_AUTH_TOKEN empty: the rollout (bound to
    0.0.0.0) refused every weight push, and the trainer failed after its first RL step. The `token` job
    writes one into a volume first; the rollout, the drafter and the trainer read it (an exported
    TLT_AUTH_TOKEN still wins: services/common/auth.py)."""
    doc = interpolate(raw, BASE_ENV)
    token = doc["services"]["token"]
    assert token["command"] == ["python", "/app/deploy/make_token.py", TOKEN_FILE] and token["restart"] == "no"
    assert token["volumes"] == [f"tlt-auth:{TOKEN_FILE.rsplit('/', 1)[0]}"]  # writable, nothing else mounted
    assert "tlt-auth" in doc["volumes"]
    for name in ("rollout", "drafter", "trainer"):
        svc = doc["services"][name]
        assert f"TLT_AUTH_TOKEN_FILE={TOKEN_FILE}" in svc["environment"], name
        assert "tlt-auth:/run/tlt:ro" in svc["volumes"], name
        assert svc["depends_on"]["token"] == {"condition": "service_completed_successfully"}, name
    reward = doc["services"]["reward"]  # no control plane: needs no token
    assert not any("TOKEN" in e for e in reward["environment"])


def test_make_token_writes_once_and_keeps_the_token_across_restarts(tmp_path):
    import stat
    import subprocess
    import sys

    path = tmp_path / "auth" / "token"
    cmd = [sys.executable, str(ROOT / "deploy" / "make_token.py"), str(path)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0 and "written" in first.stdout
    token = path.read_text().strip()
    assert len(token) >= 43 and stat.S_IMODE(path.stat().st_mode) == 0o600
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "kept" in again.stdout and path.read_text().strip() == token
    path.write_text("\n")  # an empty file (a crash before the rename cannot leave one, a person can)
    subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    assert path.read_text().strip() not in ("", token)
    assert [p.name for p in path.parent.iterdir()] == ["token"]  # no temp file left behind


def _gpus(doc, service):
    devices = doc["services"][service]["deploy"]["resources"]["reservations"]["devices"]
    (dev,) = devices
    assert dev["capabilities"] == ["gpu"] and dev["driver"] == "nvidia"
    return {g for ids in dev["device_ids"] for g in ids.split(",")}


def test_gpu_placement_colocated_by_default_and_disaggregated_on_8gpu(raw):
    one = interpolate(raw, BASE_ENV)
    assert _gpus(one, "rollout") == _gpus(one, "trainer") == _gpus(one, "drafter") == {"0"}
    assert "deploy" not in one["services"]["reward"]  # the verifier needs no GPU
    env8 = read_env_file(ENV_8GPU)
    eight = interpolate(raw, {**BASE_ENV, **env8})
    rollout, trainer = _gpus(eight, "rollout"), _gpus(eight, "trainer")
    assert rollout == {"0", "1", "2", "3", "4", "5"} and trainer == {"6", "7"} and not rollout & trainer
    assert _gpus(eight, "drafter") <= rollout  # the drafter trains on idle rollout GPUs only
    assert int(env8["TRAINER_NUM_GPUS"]) == len(trainer)
    assert int(env8["DRAFTER_WORKERS"]) == len(rollout)  # one worker per rollout replica / GPU
    assert variables(raw) >= set(env8), "deploy/8gpu.env sets variables the compose file never reads"


def test_openai_port_published_and_health_checks_match_ports(raw):
    doc = interpolate(raw, BASE_ENV)
    assert doc["services"]["rollout"]["ports"] == ["8000:8000"]
    assert "ports" not in doc["services"]["reward"] and "ports" not in doc["services"]["trainer"]
    cmd = doc["services"]["rollout"]["command"]
    hc = " ".join(doc["services"]["rollout"]["healthcheck"]["test"])
    assert f"127.0.0.1:{cmd[cmd.index('--http-port') + 1]}/health" in hc
    assert f"127.0.0.1:{cmd[cmd.index('--grpc-port') + 1]}" in hc
    reward = doc["services"]["reward"]["command"]
    assert f"127.0.0.1:{reward[reward.index('--port') + 1]}" in " ".join(doc["services"]["reward"]["healthcheck"]["test"])


def test_every_variable_is_documented(raw):
    guide = GUIDE.read_text()
    missing = sorted(v for v in variables(raw) if f"`{v}`" not in guide)
    assert not missing, f"document these compose variables in docs/DEPLOY.md: {missing}"


def tlt_args(command: list[str]) -> list[str]:
    """The `tlt` arguments of a service command (plain, or under the DeepSpeed launcher)."""
    if command[0] == "tlt":
        return command[1:]
    assert command[0] == "deepspeed" and "--module" in command
    i = command.index("--module")
    assert command[i + 1] == "tlt.cli"
    return command[i + 2 :]


@pytest.mark.parametrize("service", ["rollout", "reward", "drafter", "trainer"])
def test_commands_parse_with_the_real_cli(raw, service):
    from tlt.cli import COMMANDS, build_parser

    args = tlt_args(interpolate(raw, BASE_ENV)["services"][service]["command"])
    path = tuple(a for a in args[:2] if not a.startswith("-"))
    cmd = next((c for c in COMMANDS if c.path == path[: len(c.path)]), None)
    assert cmd is not None, f"{service}: `tlt {' '.join(path)}` is not a tlt command"
    parser = build_parser((cmd,))
    assert parser._subparsers._group_actions[0].choices, f"`tlt {' '.join(cmd.path)}`: {cmd.module} is missing"
    parsed = parser.parse_args(args)
    assert parsed._command == cmd
    preset = getattr(parsed, "preset", None) or getattr(parsed, "config", None)
    assert preset == "1gpu" and (ROOT / "deploy" / "configs" / "1gpu.toml").exists()


def service_config(doc: dict, service: str, shell: dict[str, str], monkeypatch):
    """`service`'s config as the container builds it: its compose command through the real parser and
    the service's own config builder, with the container's environment (entries with a value, plus the
    bare names passed through from `shell`) as the only TLT_* variables."""
    import os

    from tlt.cli import COMMANDS, build_parser

    svc = doc["services"][service]
    args = tlt_args(svc["command"])
    cmd = next(c for c in COMMANDS if c.path == tuple(args[: len(c.path)]))
    ns = build_parser((cmd,)).parse_args(args)
    for k in [k for k in os.environ if k.startswith("TLT_")]:
        monkeypatch.delenv(k)
    for e in svc.get("environment", []):
        k, sep, v = e.partition("=")
        if sep:
            monkeypatch.setenv(k, v)
        elif k in shell:
            monkeypatch.setenv(k, shell[k])
    if service == "rollout":
        from tlt.services.rollout.serve import build_config

        return ns, build_config(ns)
    if service == "reward":
        from tlt.services.reward.serve import build_config

        return ns, build_config(ns)
    if service == "drafter":
        from tlt.services.drafter.serve import build_config

        return ns, build_config(ns.preset, ns.overrides)
    from tlt.services.common.config import cli_overrides, load_config
    from tlt.services.trainer.config import TrainerConfig

    return ns, load_config(TrainerConfig, "trainer", ns.config, cli_overrides(ns.overrides))


def _port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def _host(endpoint: str) -> str:
    return endpoint.split("://")[-1].rsplit(":", 1)[0]


def _check_ports(hc: list[str]) -> set[int]:
    return {_port(t.split("/")[2] if t.startswith("http") else t) for t in hc[3:][1::2]}


@pytest.mark.parametrize("variant", ["1gpu", "8gpu"])
def test_service_configs_from_compose_agree_on_addresses_and_ports(raw, variant, monkeypatch):
    """Every service's resolved config (preset + compose environment + command) binds where its health
    check and its peers look: a port typo or a preset without a field would leave a service unreachable."""
    pytest.importorskip("pydantic")
    env = {**BASE_ENV, **(read_env_file(ENV_8GPU) if variant == "8gpu" else {})}
    doc = interpolate(raw, env)
    _, rollout = service_config(doc, "rollout", env, monkeypatch)
    _, reward = service_config(doc, "reward", env, monkeypatch)
    dns, drafter = service_config(doc, "drafter", env, monkeypatch)
    _, trainer = service_config(doc, "trainer", env, monkeypatch)
    hc = {s: _check_ports(v["healthcheck"]["test"]) for s, v in doc["services"].items() if "healthcheck" in v}

    assert rollout.host == reward.host == drafter.host == "0.0.0.0"  # reachable from the other containers
    assert hc["rollout"] == {rollout.http_port, rollout.grpc_port}
    assert doc["services"]["rollout"]["ports"] == [f"8000:{rollout.http_port}"]
    assert trainer.rollout_addresses == [f"rollout:{rollout.grpc_port}"]
    assert drafter.rollout_grpc == f"rollout:{rollout.grpc_port}"
    # capacity events: the rollout binds, the drafter connects by service name
    for bound, used in ((rollout.capacity_pub, drafter.capacity_pub),
                        (rollout.capacity_snapshot, drafter.capacity_snapshot)):
        assert _host(bound) == "0.0.0.0" and _host(used) == "rollout" and _port(bound) == _port(used)
    # features: the drafter binds, every rollout replica pushes to it
    assert _host(drafter.features_bind) == "0.0.0.0" and _host(rollout.features_push) == "drafter"
    assert _port(drafter.features_bind) == _port(rollout.features_push)
    assert hc["reward"] == {reward.port} and trainer.reward == "grpc"
    assert trainer.reward_address == f"reward:{reward.port}"
    assert hc["drafter"] == {drafter.status_port}
    assert hc["trainer"] == {trainer.metrics_port}  # 0 (the default) would mean no exporter: never healthy
    # the drafter's coordinator stays inside its container (workers connect over loopback)
    assert _host(drafter.coordinator_bind) == "127.0.0.1"
    # one engine replica per rollout GPU, one drafter worker per replica (worker i trains on cuda:i)
    rollout_gpus = _gpus(doc, "rollout")
    assert rollout.engine.device == "cuda" and rollout.replicas == len(rollout_gpus) == dns.workers
    assert drafter.device == "cuda" and _gpus(doc, "drafter") == rollout_gpus
    # weights cross containers over gRPC (the shm shortcut needs one /dev/shm, and each container has its own)
    assert trainer.weight_push == "grpc"
    assert trainer.model_dir == "/models/policy" and trainer.output_dir.startswith("/runs/")
    assert drafter.checkpoint_dir.startswith("/checkpoints/")


def test_compose_rollout_keeps_nested_env_overrides_and_the_drafter_choice(raw, monkeypatch):
    """TLT_ROLLOUT__SPEC__* / __ENGINE__* set for the rollout container reach its config (a `--set spec.*`
    in the compose command used to re-apply the preset's whole [rollout.spec] over them), and
    ROLLOUT_DRAFTER / ROLLOUT_DRAFTER_PATH reach both the rollout and the online drafter."""
    doc = interpolate(raw, BASE_ENV)
    doc["services"]["rollout"]["environment"] += ["TLT_ROLLOUT__SPEC__THRESHOLD=8",
                                                  "TLT_ROLLOUT__ENGINE__KV_CACHE_MB=4096"]
    _, cfg = service_config(doc, "rollout", BASE_ENV, monkeypatch)
    assert cfg.spec.threshold == 8 and cfg.engine.kv_cache_mb == 4096
    assert cfg.spec.mode == "adaptive" and cfg.spec.drafter == "ngram" and not cfg.spec.drafter_path

    env = {**BASE_ENV, "ROLLOUT_DRAFTER": "learned", "ROLLOUT_DRAFTER_PATH": "/checkpoints/drafter"}
    doc = interpolate(raw, env)
    _, cfg = service_config(doc, "rollout", env, monkeypatch)
    assert (cfg.spec.drafter, cfg.spec.drafter_path) == ("learned", "/checkpoints/drafter")
    _, drafter = service_config(doc, "drafter", env, monkeypatch)
    assert drafter.init_drafter == "/checkpoints/drafter"
    assert "/checkpoints" in {m.split(":")[1] for m in doc["services"]["rollout"]["volumes"] if isinstance(m, str)}


# -- 4. compose equivalence: the real commands as local processes -------------------------------

CONTAINER_PORTS = (8000, 50051, 50061, 50071, 9460, 5701, 5702, 5703, 5704)
SERVICE_HOSTS = ("rollout", "reward", "drafter", "trainer")


class LocalMap:
    """Container names, paths and ports -> this machine's."""

    def __init__(self, model_dir: Path, scratch: Path):
        import sys

        from tlt.services.common.ports import free_ports

        self.scratch = scratch
        self.bin = Path(sys.executable).parent
        self.model_dir = str(model_dir)
        self.ports = dict(zip(CONTAINER_PORTS, free_ports(len(CONTAINER_PORTS))))  # distinct, below the ephemeral range

    def arg(self, a: str) -> str:
        if a in ("tlt", "deepspeed", "python"):
            return str(self.bin / a)
        if a.startswith("/app/deploy/"):
            return str(ROOT / a.removeprefix("/app/"))
        if a.startswith("/run/tlt/"):
            return str(self.scratch / a.removeprefix("/"))
        if a == "/models/policy":
            return self.model_dir
        if a == "1gpu":
            return "cpu-tiny"
        if a == "0.0.0.0":
            return "127.0.0.1"
        if a.isdigit() and int(a) in self.ports:
            return str(self.ports[int(a)])
        # in one pass: replaced one port after another, a local port's text could be rewritten again ("406119")
        hosts = "|".join(re.escape(h) for h in ("127.0.0.1", "0.0.0.0", *SERVICE_HOSTS))
        return re.sub(rf"\b({hosts}):(\d+)\b",
                      lambda m: f"127.0.0.1:{self.ports[int(m[2])]}" if int(m[2]) in self.ports else m[0], a)

    def env(self, entries: list[str]) -> dict[str, str]:
        import os

        env = {k: v for k, v in os.environ.items() if not k.startswith("TLT_")}
        for e in entries:
            if "=" in e:  # bare names pass the host's value through; unset here
                k, v = e.split("=", 1)
                env[k] = self.arg(v).replace("/models/policy", self.model_dir)
                for container_dir in ("/runs", "/checkpoints"):
                    if env[k].startswith(container_dir + "/"):
                        env[k] = str(self.scratch) + env[k]
        env["TLT_PRESET"] = "cpu-tiny"
        return env

    def run_token_job(self, doc: dict) -> None:
        """What `depends_on: token: service_completed_successfully` does before the other services start."""
        import subprocess

        job = doc["services"]["token"]
        subprocess.run([self.arg(a) for a in job["command"]], env=self.env(job.get("environment", [])), check=True,
                       capture_output=True, timeout=60)


def _start(cmd: list[str], env: dict[str, str], log: Path):
    import subprocess

    with log.open("wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


def _stop(proc) -> None:
    import os
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the group this test created for this child only
        try:
            proc.wait(timeout=30)
        except Exception:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _healthy(check: list[str], proc, deadline_s: float) -> bool:
    import subprocess
    import time

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        if subprocess.run(check, capture_output=True, timeout=30).returncode == 0:
            return True
        time.sleep(1.0)
    return False


@pytest.mark.parametrize("service", ["rollout", "reward", "drafter"])
def test_compose_command_runs_locally_and_passes_its_health_check(raw, service, random_model_dir, tmp_path):
    from tlt.cli import COMMANDS, _available

    doc = interpolate(raw, BASE_ENV)
    svc = doc["services"][service]
    args = tlt_args(svc["command"])
    cmd_entry = next(c for c in COMMANDS if c.path == tuple(args[: len(c.path)]))
    assert _available(cmd_entry), f"`tlt {' '.join(cmd_entry.path)}`: {cmd_entry.module} is missing"
    m = LocalMap(random_model_dir, tmp_path)
    m.run_token_job(doc)
    proc = _start([m.arg(a) for a in svc["command"]], m.env(svc["environment"]), tmp_path / f"{service}.log")
    try:
        check = [m.arg(a) for a in svc["healthcheck"]["test"][1:]]
        ok = _healthy(check, proc, deadline_s=180)
        log = (tmp_path / f"{service}.log").read_text(errors="replace")[-3000:]
        assert ok, f"{service} never passed its compose health check {check}; exit={proc.poll()}\n{log}"
    finally:
        _stop(proc)


# -- 3. the reference implementation's own check (slow: installs docker-compose 1.29.2) ------------


@pytest.mark.slow
def test_docker_compose_v1_config_accepts_the_file(tmp_path):
    """`docker-compose config -q` of docker-compose 1.29.2 (its PyYAML 5.4.1 needs Cython < 3 to build)."""
    import os
    import subprocess
    import sys

    venv = tmp_path / "dc"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "pip"), "install", "-q"]
    steps = [
        pip + ["cython<3", "wheel", "setuptools<70"],
        pip + ["--no-build-isolation", "pyyaml==5.4.1"],
        pip + ["docker-compose==1.29.2"],
    ]
    for step in steps:
        r = subprocess.run(step, capture_output=True, text=True, timeout=600)
        if r.returncode:
            pytest.skip(f"could not install docker-compose 1.29.2 here: {r.stderr[-500:]}")
    dc = str(venv / "bin" / "docker-compose")
    env = {k: v for k, v in os.environ.items() if k != "MODEL_PATH"}
    base = [dc, "-f", str(COMPOSE), "--project-directory", str(ROOT)]
    missing = subprocess.run(base + ["config", "-q"], env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "set MODEL_PATH" in missing.stderr
    env["MODEL_PATH"] = str(tmp_path)
    for extra in ([], ["--env-file", str(ENV_8GPU)]):
        r = subprocess.run(base + extra + ["config", "-q"], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_compose_stack_trains_one_step_locally(raw, random_model_dir, tmp_path):
    """rollout + reward (+ drafter) + the trainer's DeepSpeed-launched command, one RL step on CPU."""
    from tlt.cli import COMMANDS, _available

    doc = interpolate(raw, BASE_ENV)
    m = LocalMap(random_model_dir, tmp_path)
    needed = [("train",), ("rollout", "serve"), ("reward", "serve")]
    for path in needed:
        cmd = next(c for c in COMMANDS if c.path == path)
        if not _available(cmd):
            pytest.skip(f"`tlt {' '.join(path)}` is not implemented yet")
    servers = ["rollout", "reward"] + (["drafter"] if _available(next(c for c in COMMANDS if c.path == ("drafter", "serve"))) else [])
    procs = {}
    m.run_token_job(doc)
    try:
        for name in servers:
            svc = doc["services"][name]
            procs[name] = _start([m.arg(a) for a in svc["command"]], m.env(svc["environment"]), tmp_path / f"{name}.log")
        for name in servers:
            check = [m.arg(a) for a in doc["services"][name]["healthcheck"]["test"][1:]]
            assert _healthy(check, procs[name], 240), (tmp_path / f"{name}.log").read_text(errors="replace")[-3000:]
        trainer = doc["services"]["trainer"]
        env = m.env(trainer["environment"])
        env.update(TLT_TRAINER__STEPS="1", TLT_TRAINER__CHECKPOINT_INTERVAL="0")
        proc = _start([m.arg(a) for a in trainer["command"]], env, tmp_path / "trainer.log")
        procs["trainer"] = proc
        rc = proc.wait(timeout=900)
        assert rc == 0, (tmp_path / "trainer.log").read_text(errors="replace")[-4000:]
        # The step went through the rollout server: it now serves the trained policy (version 1).
        import grpc

        from tlt.v1 import rollout_pb2, rollout_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{m.ports[50051]}") as ch:
            status = rollout_pb2_grpc.RolloutStub(ch).GetStatus(rollout_pb2.StatusRequest(), timeout=30)
        assert status.versions.policy == 1
    finally:
        for p in procs.values():
            _stop(p)
