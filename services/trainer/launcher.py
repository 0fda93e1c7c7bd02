"""The body of `tlt run`: plan a run folder, start the services, run the trainer, watch, stop.

    prepare_run(args) -> RunPlan   (run folder, resolved config.toml, run.json for resumes)
    Launcher(plan).run()           services and trainer start -> services ready -> table rows as metrics.jsonl grows
    Launcher.shutdown()            every child stopped, in reverse order of need
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tlt.cli import tlt_command
from tlt.services.common.config import (
    PRESETS_DIR,
    ConfigError,
    as_field_takes,
    cli_overrides,
    load_config,
    nested_section,
    preset_path,
    read_preset,
)
from tlt.services.common.config_cmd import SECTION_CLASSES, config_class, unknown_section
from tlt.services.common.logging import get_logger
from tlt.services.trainer.evaluate import trim_evals
from tlt.services.trainer.procs import ServiceError, ServiceProcess
from tlt.services.trainer.run_config import RunConfig, resolve_services, to_toml
from tlt.services.trainer.run_env import child_unset_env, environment_layer
from tlt.services.trainer.run_resume import check_resume, checkpoint_steps
from tlt.services.trainer.run_stats import trim_samples
from tlt.services.trainer.run_folder import claim, default_folder, export_doubt, read_run_file, write_atomic

log = get_logger("run")


@dataclass(frozen=True)
class RunPlan:
    run_dir: Path
    config_path: Path
    run: RunConfig
    services: dict[str, Any]  # the resolved per-service sections written to config_path
    switches: dict[str, bool]  # speculation / drafter as they really run
    tail_threshold: int
    steps: int
    resumed: bool
    lock: Any = field(default=None, compare=False, repr=False)  # the run folder's lock, held while this plan runs
    # TLT_<SECTION>__* variables the children must not see: folded into config.toml (`run_env.environment_layer`)
    child_unset_env: tuple[str, ...] = ()


SECTIONS = tuple(SECTION_CLASSES)  # what a `tlt run` preset's services read (`tlt config show` prints them)
def _apply_override(preset: dict[str, Any], key: str, value: Any) -> None:
    """'trainer.lr' -> preset['trainer']['lr']; 'rollout.engine.max_num_seqs' -> nested. A section no service
    reads is refused (it was silently ignored, and kept in run.json)."""
    parts = key.split(".")
    if len(parts) < 2:
        raise ServiceError(f"override {key!r} must name a section: SECTION.FIELD=VALUE (e.g. trainer.lr=3e-5)")
    if parts[0] not in SECTIONS:
        raise ServiceError(f"override {key!r}: "
                           + unknown_section(parts[0], note="nested: rollout.engine.FIELD, rollout.spec.FIELD"))
    node, cls = preset.setdefault(parts[0], {}), config_class(parts[0])
    for i, p in enumerate(parts[1:-1], 1):
        field = getattr(cls, "model_fields", {}).get(p)
        if p not in node:  # one key of a map the preset does not set: the others keep their defaults, as
            # TLT_<S>__<FIELD>__<KEY> and `tlt config show --set` keep them; a nested section starts empty
            node[p] = dict(field.get_default(call_default_factory=True)) if _is_map(field) else {}
        if not isinstance(node[p], dict):  # trainer.lr.x=1: lr is a value, not a section or a map
            raise ServiceError(f"override {key!r}: {'.'.join(parts[: i + 1])} is a value, not a section; set it "
                               f"as {'.'.join(parts[: i + 1])}=VALUE")
        node, cls = node[p], nested_section(field)
    field = getattr(cls, "model_fields", {}).get(parts[-1])
    if nested_section(field) is not None and not isinstance(value, dict):  # rollout.spec=3
        raise ServiceError(f"override {key!r}: {key} is a section ([{key}]); set one of its fields as "
                           f"{key}.FIELD=VALUE")
    if nested_section(field) is not None:  # a section given whole (TLT_ROLLOUT__SPEC='{"threshold": 8}') updates
        node[parts[-1]] = {**node.get(parts[-1], {}), **value}  # it field by field, as a service loads it
    else:
        node[parts[-1]] = as_field_takes(field, value)  # config.toml holds "1.10" for a name, not 1.1


def _is_map(field: Any) -> bool:
    """A dict-valued config field ([sglang] adaptive_steps), not a nested section."""
    return field is not None and typing.get_origin(field.annotation) is dict


def _key(override: str) -> str:
    """'trainer.lr=3e-5' -> 'trainer.lr' (as cli_overrides reads it)."""
    return override.split("=", 1)[0].strip()


# --set keys that name one value: [run] steps / torch_threads go over [trainer]'s (run_config.resolve_services)
SAME_VALUE = (frozenset({"trainer.steps", "run.steps"}), frozenset({"trainer.torch_threads", "run.torch_threads"}))


def _names(key: str) -> frozenset[str]:
    """Every --set key that sets what `key` sets."""
    return next((names for names in SAME_VALUE if key in names), frozenset({key}))


def _sets_steps(overrides: list[str]) -> bool:
    """Whether these --set options name the run's step count."""
    return any(_key(o) in SAME_VALUE[0] for o in overrides)


def _kept_overrides(saved: list[str], new: list[str]) -> list[str]:
    """The --set options a resumed run was started (or last resumed) with that this launch's `new` leaves in force:
    not those of a key `new` sets, under either of its names (a saved run.steps=6 went over this launch's
    trainer.steps=10, [run] being applied over [trainer])."""
    replaced = frozenset().union(*(_names(_key(o)) for o in new))
    return [o for o in saved if _key(o) not in replaced]


def _pinned_preset(preset: str) -> str:
    """A preset given as a file, as an absolute path (run.json keeps it: a resume from another folder read `my.toml`
    relative to that folder, and failed or silently took another my.toml found there); a preset name stays a name."""
    path = preset_path(preset)
    return preset if path == PRESETS_DIR / f"{preset}.toml" else os.path.abspath(path)


def _inputs(args: argparse.Namespace, saved: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], RunConfig]:
    """(what this launch was asked for, merged over a resumed run's run.json; the preset; RunConfig)."""
    inputs = {
        "preset": _pinned_preset(args.preset) if args.preset else saved.get("preset") or "cpu-tiny",
        # this launch's --set last, so that it wins over what the run was started (or last resumed) with
        "overrides": _kept_overrides(saved.get("overrides", []), args.overrides) + list(args.overrides),
        "baseline": bool(args.baseline or saved.get("baseline", False)),
        "seed": args.seed if args.seed is not None else saved.get("seed"),
        # a --set of the step count in this launch beats the --steps the run was started with (it was recorded
        # in run.json and silently lost to it)
        "steps": args.steps if args.steps is not None or _sets_steps(args.overrides) else saved.get("steps"),
        "model": os.path.abspath(args.model) if args.model else saved.get("model"),  # as _pinned_preset
    }
    path = preset_path(inputs["preset"])
    preset = read_preset(path)
    unknown = [name for name in preset if name not in SECTIONS]
    if unknown:  # a misspelt [trainr] was copied into config.toml and ignored: its service ran on defaults
        raise ServiceError(f"{preset_path(inputs['preset'])}: " + unknown_section(
            unknown[0], bracket=True, note="`tlt config check FILE` checks a preset file"))
    overrides = cli_overrides(inputs["overrides"])
    for key, value in [*environment_layer(), *overrides.items()]:  # preset -> environment -> --set
        _apply_override(preset, key, value)
    # [run]: the preset file's, then TLT_RUN__* (the environment layer: passing the preset's values as the
    # command-line layer made them beat it), then --set run.*, --steps, --model and --baseline
    run_over: dict[str, Any] = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("run.")}
    if inputs["steps"]:
        run_over["steps"] = inputs["steps"]
    if inputs["model"]:
        run_over["model_dir"] = inputs["model"]
    if inputs["baseline"]:
        run_over.update(speculation=False, drafter=False)
    return inputs, preset, load_config(RunConfig, "run", path, run_over)


def _validate(services: dict[str, Any], switches: dict[str, bool]) -> None:
    """Load every section a service of this run will load (ConfigError when one is invalid), before run.json
    records this launch's --set: a mistyped one failed only in its service, after the others had started, and
    run.json kept it for every later launch of the folder (an unknown field could never be set back)."""
    from tlt.services.reward.config import RewardConfig
    from tlt.services.rollout.config import RolloutConfig
    from tlt.services.trainer.config import TrainerConfig

    sections: list[tuple[type, str]] = [(RewardConfig, "reward"), (RolloutConfig, "rollout"),
                                        (TrainerConfig, "trainer")]
    if switches["drafter"]:
        from tlt.services.drafter.config import DrafterServiceConfig

        sections.append((DrafterServiceConfig, "drafter"))
    # environ={}: the environment is in `services` already (run_env.environment_layer), under --set
    origin = "the preset, TLT_* variables or --set"  # all three are in `services`
    loaded = {name: load_config(cls, name, None, services.get(name, {}), environ={}, overrides_origin=origin)
              for cls, name in sections}
    from tlt.services.common.config_cmd import context_problem, push_dtype_problem

    for check in (context_problem, push_dtype_problem):
        if (problem := check(loaded["trainer"], loaded["rollout"])) is not None:
            raise ConfigError(problem)


def _hint_drafter_beside(model: Path, init: str) -> None:
    """A new run from an earlier run's policy (runs/<id>/policy) whose online drafter is beside it (policy-drafter,
    drafter/export.py): said once, with the --set that starts from it instead of a `init` (random / warmup) one."""
    from tlt.services.drafter.export import RUN_DRAFTER

    beside = model.parent / RUN_DRAFTER
    if model.name != "policy" or not beside.is_dir():
        return
    from tlt.model.drafter import CONFIG_FILE

    if (beside / CONFIG_FILE).is_file():
        log.info("drafter_beside_policy", drafter=str(beside),
                 hint=f"--set run.drafter_init={beside} starts the online drafter from the one trained with this "
                      f"policy instead of a {init} one")


def _drafter_off_reason() -> str:
    """Why `[run] drafter = true` starts no drafter service, and what starts one (the GPU presets draft model-free
    until a learned drafter exists: `tlt run --preset 1gpu` ran without one and said only "or")."""
    from tlt.services.trainer.run_config import drafter_available

    if not drafter_available():
        return "this build has no drafter service (tlt.services.drafter)"
    return ("the rollout drafts model-free ([rollout.spec] drafter = 'ngram'): the online drafter trains a learned one; "
            "start from one with --set run.drafter_init=warmup (`tlt drafter warmup` on the model first), =random, "
            "or =DIR (a drafter folder)")


def prepare_run(args: argparse.Namespace) -> RunPlan:
    """The run folder and its config. `--resume DIR`, or a `--run-id` whose folder exists, continues that
    run with the options it was started with; without `--run-id` see default_folder (an interrupted run is
    continued, else a new folder is taken)."""
    saved: dict[str, Any] = {}
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "run.json").exists():
            raise ServiceError(f"{run_dir} is not a run folder (no run.json); start one with `tlt run`")
        saved = read_run_file(run_dir)
    inputs, preset, run_cfg = _inputs(args, saved)
    if args.resume or args.run_id:
        run_dir = Path(args.resume) if args.resume else Path(run_cfg.runs_dir) / args.run_id
        created = not run_dir.exists()
        lock = claim(run_dir)
    else:
        run_dir, lock, created = default_folder(Path(run_cfg.runs_dir), str(inputs["preset"]))
    try:
        return _plan_in(run_dir, lock, args, saved, (inputs, preset, run_cfg))
    except BaseException:
        if created:  # a new run refused: no folder holding only its .lock is left behind
            shutil.rmtree(run_dir, ignore_errors=True)  # before the lock goes: no other run takes it meanwhile
        lock.close()
        raise


def _plan_in(run_dir: Path, lock: Any, args: argparse.Namespace, saved: dict[str, Any],
             planned: tuple[dict[str, Any], dict[str, Any], RunConfig]) -> RunPlan:
    """prepare_run in the run folder it holds the lock of: its config.toml and run.json written."""
    inputs, preset, run_cfg = planned
    resumed = (run_dir / "run.json").exists()
    if resumed and not args.resume:  # continue it with the options it was started with
        saved = read_run_file(run_dir)
        inputs, preset, run_cfg = _inputs(args, saved)
        if not args.run_id:  # a folder this launch picked: say which, and that it continues
            log.info("run_continued", run_dir=str(run_dir), hint="a new run: --run-id ID")
    if resumed and (doubt := export_doubt(run_dir)):  # `tlt report`'s warning, where the export is about to be redone
        log.warning("export_redone", run_dir=str(run_dir), found=doubt[1],
                    then="this run resumes from the latest checkpoint and exports the policy again")
    preset_name, overrides, baseline = inputs["preset"], inputs["overrides"], inputs["baseline"]
    seed, steps_arg, model = inputs["seed"], inputs["steps"], inputs["model"]
    if seed is not None:
        preset.setdefault("trainer", {})["seed"] = seed
    if not Path(run_cfg.model_dir, "config.json").exists():
        raise ServiceError(f"no model in {run_cfg.model_dir}; build it with `make model` "
                           f"(tlt model build --preset tiny --out {run_cfg.model_dir})")
    services, switches = resolve_services(preset, run_cfg, run_dir)
    _validate(services, switches)
    if checkpoint_steps(run_dir):
        check_resume(run_dir, services["trainer"], run_cfg.model_dir)
    if run_cfg.speculation and not switches["speculation"]:
        log.warning("speculation_off", reason="this rollout build takes no [rollout.spec] section, or its mode is off")
    if run_cfg.drafter and switches["speculation"] and not switches["drafter"]:
        log.warning("drafter_off", reason=_drafter_off_reason())
    if switches["drafter"] and run_cfg.drafter_init in ("random", "warmup") and not (run_dir / "drafter-init").exists():
        _hint_drafter_beside(Path(run_cfg.model_dir), run_cfg.drafter_init)
    config_path = run_dir / "config.toml"
    write_atomic(config_path, f"# tlt run: resolved from {preset_name} for this run; rewritten on every (re)start"
                  "\n\n" + to_toml(services))
    steps, spec_threshold = _as_run(config_path)
    threshold = run_cfg.tail_threshold or spec_threshold
    write_atomic(run_dir / "run.json", json.dumps({
        "preset": str(preset_name), "overrides": overrides, "baseline": baseline, "seed": seed,
        "steps": steps_arg, "model": model, "switches": switches, "created": saved.get("created", time.time()),
        "tail_threshold": threshold,  # what report.html counts as tail (a regenerated report reads it)
    }, indent=2))
    return RunPlan(run_dir, config_path, run_cfg, services, switches, threshold, steps, resumed, lock,
                   child_unset_env(cli_overrides(overrides)))


def _as_run(config_path: Path) -> tuple[int, int]:
    """(the trainer's steps, the rollout's SD threshold) as the services load the run's config.toml, which holds the
    environment's values (TLT_TRAINER__STEPS, TLT_ROLLOUT__SPEC__THRESHOLD; read from the preset, the progress bar
    and report.html's tail missed them). 32 (SpecConfig's) for a rollout build with no [rollout.spec]."""
    from tlt.services.rollout.config import RolloutConfig
    from tlt.services.trainer.config import TrainerConfig

    steps = load_config(TrainerConfig, "trainer", config_path, environ={}).steps
    spec = getattr(load_config(RolloutConfig, "rollout", config_path, environ={}), "spec", None)
    return steps, spec.threshold if spec is not None else 32


class Launcher:
    def __init__(self, plan: RunPlan, quiet: bool = False) -> None:
        self.plan = plan
        self.quiet = quiet
        self.services: list[ServiceProcess] = []  # in start order; stopped in reverse
        self.trainer: ServiceProcess | None = None
        self.samplers: list[Any] = []
        self.ready: dict[str, dict] = {}  # each started service's ready file (ports, replica / worker pids)
        self._rows_shown = 0
        # A resumed trainer drops metrics.jsonl's lines of the steps after its checkpoint and runs them again;
        # until it has, those lines are the interrupted run's: shown, each of those steps would show twice.
        self._launched = time.time()
        self._resumes_at = checkpoint_steps(plan.run_dir)
        trim_evals(plan.run_dir / "eval.jsonl", self._resumes_at)  # as the trainer will: each eval shown once
        trim_samples(plan.run_dir, self._resumes_at)  # and what the interrupted launch's dropped steps did
        self._eval_size = -1  # size of eval.jsonl when last read
        # Control-plane token for this run (services/common/auth.py): the caller's TLT_AUTH_TOKEN if set, else a
        # fresh random one; every child gets it in its environment (never on a command line or in config.toml).
        from tlt.services.common.auth import TOKEN_ENV, new_token, resolve_token

        self.child_env = {TOKEN_ENV: resolve_token() or new_token()}

    # -- start ---------------------------------------------------------------------------------
    def _service(self, name: str, argv: list[str], ready: bool = True, env: dict[str, str] | None = None
                 ) -> ServiceProcess:
        logs = self.plan.run_dir / "logs"
        p = ServiceProcess(name, argv, logs / f"{name}.log", logs / f"{name}.ready" if ready else None,
                           env={**self.child_env, **(env or {})}, unset_env=self.plan.child_unset_env)
        self.services.append(p.start())
        return p

    def start_services(self) -> list[ServiceProcess]:
        """Launch reward, rollout and drafter (without waiting for them: `wait_services`)."""
        plan, cfg = self.plan, str(self.plan.config_path)
        model = plan.run.model_dir
        self.prepare_drafter()
        reward = self._service("reward", tlt_command("reward", "serve", "--preset", cfg, "--ready-file",
                                                     str(plan.run_dir / "logs" / "reward.ready")))
        rollout = self._service("rollout", tlt_command("rollout", "serve", "--model", model, "--preset", cfg,
                                                       "--ready-file", str(plan.run_dir / "logs" / "rollout.ready")))
        started = [reward, rollout]
        if plan.switches["drafter"]:
            workers = plan.run.drafter_workers or int(plan.services["rollout"].get("replicas", 1))
            started.append(self._service("drafter", tlt_command(
                "drafter", "serve", "--model", model, "--workers", str(workers), "--preset", cfg,
                "--ready-file", str(plan.run_dir / "logs" / "drafter.ready"))))
        return started

    def start_trainer(self) -> ServiceProcess:
        """`tlt train` as the services start: its own start-up (DeepSpeed, the policy and reference models, ~9 s on
        2 cores) overlaps theirs, and it waits for them as for any server (`connect_timeout_s`), given here the
        services' start-up time on top, as the launcher waits that long for them."""
        from tlt.services.common.config import env_prefix
        from tlt.services.trainer.config import TrainerConfig

        plan = self.plan
        key = f"{env_prefix('trainer')}CONNECT_TIMEOUT_S"
        env = {}
        if key not in os.environ:  # the caller's own setting stands
            connect = load_config(TrainerConfig, "trainer", plan.config_path, environ={}).connect_timeout_s
            env[key] = str(connect + plan.run.startup_timeout_s)
        return self._service("trainer", tlt_command("train", "--config", str(plan.config_path)), ready=False, env=env)

    def wait_services(self, started: list[ServiceProcess]) -> dict[str, dict]:
        """Each started service's ready file, within [run] startup_timeout_s; a service or the trainer that dies
        meanwhile ends the wait at once, with its log's tail (a trainer that exits 0 ends it without an error)."""
        deadline = time.monotonic() + self.plan.run.startup_timeout_s
        for p in started:
            info = p.wait_ready(deadline, self._trainer_done)
            if info is None:  # it had nothing left to do (a finished run resumed): watch() reports it
                return self.ready
            self.ready[p.name] = info
        self._write_pids()
        return self.ready

    def _trainer_done(self) -> bool:
        """While the services start: has the trainer exited 0? A failed trainer raises ServiceError."""
        rc = self.trainer.poll() if self.trainer is not None else None
        if rc not in (None, 0):
            raise ServiceError(f"trainer exited with code {rc} while the services started "
                               f"(log {self.trainer.log_path}):\n{self.trainer.tail()}")
        return rc == 0

    def prepare_drafter(self) -> None:
        """The learned drafter the rollout starts with (run_dir/drafter-init), made once per run folder."""
        init, run_dir = self.plan.run.drafter_init, self.plan.run_dir
        path = run_dir / "drafter-init"
        if not self.plan.switches["speculation"] or init not in ("random", "warmup") or path.exists():
            return
        tmp = run_dir / "drafter-init.tmp"
        if init == "random":  # the same seeded init the drafter coordinator starts from without init_drafter
            from tlt.services.drafter.training import new_drafter

            new_drafter(self.plan.run.model_dir, seed=0).save(tmp)
        else:
            p = ServiceProcess("drafter-warmup", tlt_command("drafter", "warmup", "--model", self.plan.run.model_dir,
                                                             "--out", str(tmp),
                                                             "--problems", str(self.plan.run.drafter_warmup_problems),
                                                             "--epochs", str(self.plan.run.drafter_warmup_epochs)),
                               run_dir / "logs" / "drafter-warmup.log", env=self.child_env,
                               unset_env=self.plan.child_unset_env).start()
            log.info("drafter_warmup", log=str(p.log_path))
            if p.proc.wait() != 0:  # type: ignore[union-attr]
                raise p.died()
            p.stop(1)
        tmp.rename(path)

    def _write_pids(self) -> None:
        """pids.json: every child's pid, and the replicas' and workers' as they started (rewritten with the
        trainer's). A replica or worker that dies is started again by its service (the rollout front's pool,
        `tlt drafter serve`), not here: its new pid is not in this file, and the listed one may be dead or
        reused. `process_groups` is what stays true: each service leads its own group (ServiceProcess.start),
        which holds every process it starts, restarted ones included, and not the launcher."""
        info = self.ready
        groups = {p.name: p.pid for p in self.services}  # a new session each: group id = its pid
        pids = dict(groups)
        pids["launcher"] = os.getpid()
        pids["rollout_replicas"] = info.get("rollout", {}).get("replica_pids", [])
        pids["drafter_workers"] = info.get("drafter", {}).get("worker_pids", [])
        pids["process_groups"] = groups
        tmp = self.plan.run_dir / "pids.json.tmp"
        tmp.write_text(json.dumps(pids))
        tmp.replace(self.plan.run_dir / "pids.json")

    def start_samplers(self) -> None:
        from tlt.services.trainer.run_monitor import DrafterSampler, RolloutSampler

        grpc_addr = self.plan.services["trainer"]["rollout_addresses"][0]
        self.samplers.append(RolloutSampler(grpc_addr, self.plan.run_dir / "timeline.jsonl", self.plan.run.poll_interval_s,
                                            since_step=self._resumes_at))
        if self.plan.switches["drafter"]:
            d = self.plan.services["drafter"]
            self.samplers.append(DrafterSampler(f"{d['host']}:{d['status_port']}", self.plan.run_dir))
        for s in self.samplers:
            s.start()

    # -- run -----------------------------------------------------------------------------------
    def run(self) -> int:
        plan = self.plan
        log.info("run_starting", run_dir=str(plan.run_dir), resumed=plan.resumed, steps=plan.steps, **plan.switches)
        started = self.start_services()
        self.trainer = self.start_trainer()
        self.wait_services(started)
        if self.trainer.alive():
            self.start_samplers()
        return self.watch()

    def _rows(self) -> list:  # StepRow
        """This run's step rows, less the interrupted run's lines a resumed trainer is about to drop."""
        from tlt.services.trainer.run_stats import step_rows

        return [r for r in step_rows(self.plan.run_dir, self.plan.tail_threshold)
                if r.step < self._resumes_at or r.started_at >= self._launched]

    def _windows_known_at(self) -> float:
        """Until when drafter.jsonl holds every drafter window (see run_stats.settled)."""
        from tlt.services.trainer.run_monitor import DrafterSampler

        drafters = [s for s in self.samplers if isinstance(s, DrafterSampler)]
        # an earlier launch's rows ended before this one started: their windows are on file for good
        return max(self._launched, drafters[0].quiet_since) if drafters else math.inf

    def watch(self) -> int:
        from tlt.services.trainer.run_stats import HEADER, format_row, log_fields, settled, table_line

        bar = None
        if not self.quiet:
            from tqdm import tqdm

            bar = tqdm(total=self.plan.steps, desc="RL steps", unit="step", file=sys.stderr, dynamic_ncols=True)
            bar.write(table_line(HEADER))
        metrics = self.plan.run_dir / "metrics.jsonl"
        seen_size = -1
        evals_shown = 0
        rows: list = []
        if bar is None and self._resumes_at:  # logs: a resume logs this launch's steps and evals, not again the
            self._rows_shown = self._resumes_at  # earlier launches' under this launch's time stamps (the table
            evals_shown = self._evals_kept()  # shows the whole run)
        try:
            while True:
                rc = self.trainer.poll()  # type: ignore[union-attr]
                evals_shown = self._show_evals(evals_shown, bar)
                size = metrics.stat().st_size if metrics.exists() else 0
                if size != seen_size:  # a new step line (or the trainer trimmed lines on resume)
                    seen_size = size
                    rows = self._rows()
                    self._rows_shown = min(self._rows_shown, len(rows))
                    if bar is not None:  # the bar counts a step at once; its table row waits until settled
                        bar.n = len(rows)
                        bar.refresh()
                ready = len(rows) if rc is not None else settled(rows, self._windows_known_at())
                if ready > self._rows_shown:
                    rows = self._rows()  # read again: the drafter windows of the settled rows are on file now
                    for r in rows[self._rows_shown:ready]:
                        if bar is not None:
                            bar.write(table_line(format_row(r)))
                        else:
                            log.info("step_done", **log_fields(r))
                    self._rows_shown = min(ready, len(rows))
                if rc is not None:
                    if rc != 0:
                        raise ServiceError(f"trainer exited with code {rc} (log {self.trainer.log_path}):\n"
                                           f"{self.trainer.tail()}")
                    return 0
                for p in self.services:
                    if p is not self.trainer and not p.alive():
                        raise p.died()
                time.sleep(0.5)
        finally:
            if bar is not None:
                bar.close()

    def _evals_kept(self) -> int:
        from tlt.services.trainer.evaluate import read_evals

        return sum(e.after_steps <= self._resumes_at for e in read_evals(self.plan.run_dir / "eval.jsonl"))

    def _show_evals(self, shown: int, bar) -> int:  # noqa: ANN001 - tqdm or None
        """Print held-out evals the trainer wrote since the last call; returns how many are shown."""
        from tlt.services.trainer.evaluate import read_evals

        path = self.plan.run_dir / "eval.jsonl"
        size = path.stat().st_size if path.exists() else 0
        if size == self._eval_size:  # polled every 0.5 s: read the file only when it changed
            return shown
        self._eval_size = size
        evals = read_evals(path)
        for e in evals[min(shown, len(evals)):]:
            greedy = "" if e.greedy_accuracy is None else f", greedy {e.greedy_accuracy:.3f}"
            line = (f"held-out accuracy after {e.after_steps} steps: {e.accuracy:.3f} "
                    f"({e.problems} problems x {e.samples}, T={e.temperature:g}{greedy}, {e.seconds:.1f} s)")
            if bar is not None:
                bar.write(line)
            else:
                extra = {} if e.greedy_accuracy is None else {"greedy_accuracy": round(e.greedy_accuracy, 4)}
                log.info("eval", after_steps=e.after_steps, accuracy=round(e.accuracy, 4), **extra)
        return len(evals)

    # -- stop ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        for s in self.samplers:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001 - a sampler's file (a full disk) must not leave the services running
                log.error("sampler_stop_failed", sampler=type(s).__name__, error=repr(e)[:300])
        self.samplers = []
        for p in reversed(self.services):
            try:
                rc = p.stop(self.plan.run.stop_timeout_s)
            except Exception as e:  # one service that will not stop must not leave the others running
                log.error("service_stop_failed", service=p.name, error=repr(e)[:300])
                continue
            log.debug("service_stopped", service=p.name, rc=rc)
        self.services = []
