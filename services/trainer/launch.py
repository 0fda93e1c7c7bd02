"""`tlt run`: launch every service on this machine as separate processes and train end to end.

    tlt run [--preset cpu-tiny] [--steps N] [--run-id ID | --resume runs/ID] [--baseline]

    preset -> RunConfig + runs/<id>/config.toml (free loopback ports, run paths)   run_config.py
              the environment folded in under --set, out of the children's       run_env.py
    start   reward (`tlt reward serve`), rollout (`tlt rollout serve`, its replicas),
            drafter (`tlt drafter serve`, its workers; when the rollout drafts with a learned drafter)
    ready   each writes its --ready-file once serving; the rollout also answers GetStatus
    train   `tlt train --config runs/<id>/config.toml` (resumes from runs/<id>/checkpoints)
    watch   progress bar + one table row per step (run_stats.py), the rollout's running batch
            sampled into timeline.jsonl, drafter windows into drafter.jsonl     run_monitor.py
    end     stop every child (trainer, drafter, rollout, reward), write report.html   report.py

Every child's output goes to runs/<id>/logs/<service>.log and their pids to
runs/<id>/pids.json, with each service's process group (`process_groups`: the
service and everything it started). A replica or drafter worker that dies is
restarted by its service, which does not own pids.json: the replica and worker
pids there are the ones they started with, and `kill -- -<group>` is what reaches
a restarted one (tests/test_run_pids.py). A run folder that already exists is resumed: the trainer
continues from its last checkpoint (no step lost or repeated; loop.py) and the
drafter from its own checkpoint; services restart on fresh ports. `--baseline`
is the same run with speculative decoding off and no drafter (`tlt bench e2e`).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, help="config preset name or .toml path (default cpu-tiny)")
    from tlt.cli_args import at_least, non_empty  # 0 was taken for "not given": `--steps 0` ran the preset's steps

    parser.add_argument("--steps", type=at_least(1), default=None, help="RL steps (default: the preset's)")
    parser.add_argument("--run-id", type=run_id, default=None, help="run folder name under runs_dir (default: <preset>, continued if it was "
                        "interrupted; if that one is finished or in use, the interrupted <preset>-<time> of this "
                        "preset launched last, continued, else a new <preset>-<time>)")
    parser.add_argument("--resume", type=non_empty, default=None, metavar="RUN_DIR", help="continue the run in this folder")
    parser.add_argument("--model", type=non_empty, default=None, help="policy checkpoint folder (default: [run] model_dir)")
    parser.add_argument("--baseline", action="store_true", help="speculative decoding off and no drafter")
    parser.add_argument("--seed", type=int, default=None,
                        help="trainer seed (data order, torch RNG); a resume from a checkpoint keeps the run's")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a preset value, e.g. trainer.lr=3e-5 or run.poll_interval_s=0.2; repeatable")
    parser.add_argument("--no-report", action="store_true", help="do not write report.html at the end")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or table (logs only)")


def run_id(text: str) -> str:
    """argparse `type` of --run-id: one folder name under runs_dir ('' meant the default run; '../x' escaped
    runs_dir)."""
    if not text.strip() or text in (".", "..") or "/" in text:
        raise argparse.ArgumentTypeError(f"must be a folder name under runs_dir (no '/', not '.' or '..'), got {text!r}")
    return text


def report(run_dir: Path, threshold: int) -> Path | None:
    """Write the run's report.html; a report that fails is logged, never the run's end (its `run_done` line and
    exit code were lost to a traceback). The services are stopped already; `tlt report DIR` writes it later."""
    from tlt.services.common.logging import get_logger
    from tlt.services.trainer.report import write_report

    log = get_logger("run")
    try:
        path = write_report(run_dir, threshold)
    except KeyboardInterrupt:
        log.warning("report_skipped", hint=f"write it with: tlt report {run_dir}")
        return None
    except Exception as e:  # noqa: BLE001 - the run is over either way; say why and how to retry
        log.error("report_failed", error=f"{type(e).__name__}: {e}", hint=f"write it with: tlt report {run_dir}")
        return None
    log.info("report_written", path=str(path))
    return path


def run(args: argparse.Namespace) -> int:
    import signal
    import time

    from tlt.services.common.logging import get_logger
    from tlt.services.trainer.procs import ServiceError

    log = get_logger("run")
    from tlt.services.trainer.launcher import Launcher, prepare_run

    from tlt.services.common.config import ConfigError

    try:
        plan = prepare_run(args)
    except (ServiceError, ConfigError) as e:
        log.error("run_not_started", error=str(e))
        return 2
    from tlt.services.trainer.run_folder import finished

    if plan.resumed and finished(plan.run_dir):  # every service started, the policy exported again, for nothing
        log.info("run_already_finished", run_dir=str(plan.run_dir), steps=plan.steps,
                 hint=f"every step is done and the policy exported; --steps N (over {plan.steps}) trains it further")
        try:
            return _finish(args, plan, 0, time.monotonic())
        finally:
            if plan.lock is not None:
                plan.lock.close()
    launcher = Launcher(plan, quiet=args.quiet)

    def stop(signum: int, frame: object) -> None:  # SIGTERM / SIGHUP: stop the children like Ctrl-C does
        raise KeyboardInterrupt

    # restored on return: called in-process (a test, a script), a later SIGTERM must not raise KeyboardInterrupt
    given = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    t0 = time.monotonic()
    try:
        rc = launcher.run()
    except ServiceError as e:
        log.error("run_failed", error=str(e), run_dir=str(plan.run_dir))
        rc = 1
    except KeyboardInterrupt:
        log.warning("run_interrupted", run_dir=str(plan.run_dir), hint=f"continue with: tlt run --resume {plan.run_dir}")
        rc = 130
    finally:
        # a second Ctrl-C / SIGTERM raised KeyboardInterrupt inside the orderly stop: a traceback, services left to
        # the parent-death signal, no report; now it is said and the stop goes on
        def stopping(signum: int, frame: object) -> None:
            log.warning("run_stopping", hint="the services are being stopped in order; kill -9 the launcher to end "
                                             "at once (its children die with it)")

        previous = {sig: signal.signal(sig, stopping) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        launcher.shutdown()
        for sig, handler in previous.items():  # stopped: a signal interrupts what is left (the report) again
            signal.signal(sig, handler)
    try:
        return _finish(args, plan, rc, t0)
    finally:
        for sig, handler in given.items():
            signal.signal(sig, handler)


def _greedy_change(first, last) -> str:  # noqa: ANN001 - EvalRecord
    """The greedy change ("; greedy 0.430 -> 0.465 (+0.035, paired s.e. 0.020)") when the first and last evals both
    scored it (eval_greedy)."""
    from tlt.services.trainer.evaluate import change_text

    if first.greedy_accuracy is None or last.greedy_accuracy is None:
        return ""
    return f"; greedy {first.greedy_accuracy:.3f} -> {last.greedy_accuracy:.3f}{change_text(first, last, 'greedy')}"


def _finish(args: argparse.Namespace, plan, rc: int, t0: float) -> int:  # noqa: ANN001 - RunPlan
    """The report and the closing log line of a run that ended with `rc`."""
    import time

    from tlt.services.common.logging import get_logger

    log = get_logger("run")
    drafter_out = _export_drafter(plan) if rc == 0 else {}
    if not args.no_report:
        report(plan.run_dir, plan.tail_threshold)
    from tlt.services.trainer.evaluate import change_text, read_evals

    evals = read_evals(plan.run_dir / "eval.jsonl")
    held_out = ({"eval_accuracy": f"{evals[0].accuracy:.3f} (after {evals[0].after_steps} steps) -> "
                                  f"{evals[-1].accuracy:.3f} (after {evals[-1].after_steps})"
                                  + change_text(evals[0], evals[-1], "sampled")
                                  + _greedy_change(evals[0], evals[-1])} if evals else {})
    from tlt.services.trainer.report import sharper_check

    check = sharper_check(plan.run_dir, evals)
    if check:  # the sampled change is within the run's own eval noise: say how to measure it more sharply
        held_out["sharper_check"] = check
    log.info("run_done", rc=rc, run_dir=str(plan.run_dir), seconds=round(time.monotonic() - t0, 1), **held_out,
             **drafter_out)
    return rc


def _export_drafter(plan) -> dict[str, str]:  # noqa: ANN001 - RunPlan
    """runs/<id>/policy-drafter: the online drafter beside the policy it was trained for ({} without a drafter
    service). A failure is logged, not raised: the run's policy and the drafter checkpoint are what matter, and
    `tlt drafter export --format tlt` can be run again by hand."""
    from tlt.services.common.logging import get_logger
    from tlt.services.drafter.export import RUN_DRAFTER, export_run_drafter

    ckpt = (plan.services.get("drafter") or {}).get("checkpoint_dir")
    if not ckpt or not plan.switches.get("drafter"):
        return {}
    try:
        done = export_run_drafter(plan.run_dir, ckpt)
    except Exception as e:  # deliberate boundary: the run itself succeeded
        get_logger("run").error("drafter_export_failed", error=repr(e)[:300], checkpoint_dir=ckpt,
                                fix=f"tlt drafter export --drafter {ckpt} --model {plan.run_dir / 'policy'} "
                                    f"--format tlt --out {plan.run_dir / RUN_DRAFTER}")
        return {}
    return {} if done is None else {"drafter": str(done[0]), "drafter_version": done[1]}
