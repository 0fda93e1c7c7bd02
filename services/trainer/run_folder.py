"""A `tlt run`'s folder: which one a launch works in, its lock, and its files written whole.

    default_folder(runs, preset) -> (folder, lock, made)   no --run-id: `<preset>`, an interrupted one, or new
    claim(folder) -> lock                                   --run-id / --resume: ServiceError when in use
    read_run_file(folder), write_atomic(path, text)          run.json / config.toml
    write_export_record / export_doubt / stale_export        policy/tlt_export.json: the step the export holds
    finished(folder) / continues(folder)                     whether a plain `tlt run` works in it again
"""

from __future__ import annotations

import glob
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from tlt.services.common.config import load_config
from tlt.services.common.logging import get_logger
from tlt.services.trainer.procs import ServiceError

log = get_logger("run")
# Beside the exported policy's HF files: the steps it was trained for, its policy version and the run it came from.
# Written with "exporting": true before an export begins and replaced once it ends (write_export_record): a record
# that still says exporting is an export cut short; none at all, an older TLT's export (nothing tells which step).
EXPORT_RECORD = "tlt_export.json"


def finished(run_dir: Path) -> bool:
    """Whether the trainer of this run folder already did all its steps (its last checkpoint says so) and exported the
    policy: the last checkpoint is written before the export, and a run killed between them counted as finished (a
    plain `tlt run` took a new folder, and the policy was never exported; continued, the trainer exports it). The
    export is judged against the latest checkpoint (export_doubt, as `tlt report` does), not config.toml's `steps`:
    lowered after the run, those made a run stopped before its last export look finished."""
    from tlt.services.trainer.config import TrainerConfig

    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file() or not (run_dir / "config.toml").exists():
        return False
    steps = load_config(TrainerConfig, "trainer", run_dir / "config.toml", environ={}).steps  # the environment is in it
    from tlt.services.trainer.checkpoint import CheckpointManager

    if CheckpointManager.steps_of(pointer.read_text()) < steps:
        return False
    policy = run_dir / "policy"
    if not ((policy / "config.json").is_file() and any(policy.glob("*.safetensors"))):
        return False
    # the report's rule (export_doubt): the export holds the latest checkpoint's policy; an older TLT's export (no
    # record) cannot tell, and counts as done (`tlt report` warns); any other doubt: continued, and exported again
    doubt = export_doubt(run_dir)
    return doubt is None or doubt[0] == "unrecorded"


def continues(run_dir: Path) -> bool:
    """Whether a `tlt run` with no --run-id may work in this folder it holds the lock of: a new one, or an
    interrupted run (its trainer has steps left). One whose config.toml no longer loads (a field an older TLT
    wrote, a hand edit) is left alone, said so: its ConfigError refused every new plain `tlt run`, and the
    resume's own check of that file (run_resume.check_resume) would refuse it anyway."""
    from tlt.services.trainer.checkpoint import CheckpointManager
    from tlt.services.trainer.procs import ServiceError
    from tlt.services.trainer.run_resume import latest_state

    try:
        if finished(run_dir):
            return False
        CheckpointManager(run_dir / "checkpoints").latest()  # `latest` names a complete checkpoint (CheckpointError)
        latest_state(run_dir)  # and its state loads: a damaged one blocked every plain `tlt run`
        return True
    except (OSError, ValueError, ServiceError) as e:  # ConfigError is a ValueError; so is a `latest` naming no step
        log.warning("run_folder_skipped", run_dir=str(run_dir), reason=" ".join(str(e).split())[:240],
                    hint="this run takes another folder (--run-id ID names one)")
        return False


LOCK_FILE = ".lock"


def lock_run_dir(run_dir: Path) -> Any | None:
    """An exclusive lock on the run folder (held until the returned file is closed or this process dies,
    kill -9 included), or None when another `tlt run` holds it: two runs in one folder would share its
    checkpoints and files (the second one's trainer deleted the first one's metrics.jsonl)."""
    import fcntl

    path = run_dir / LOCK_FILE
    try:
        f = path.open("a+")
    except OSError as e:
        raise ServiceError(f"cannot lock the run folder {run_dir} ({e.strerror or e}); choose another runs_dir "
                           "(--set run.runs_dir=DIR)") from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    try:
        same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        same = False
    if not same:  # the folder was removed (a refused new run) after this file was opened: that lock guards nothing
        f.close()
        return None
    f.seek(0), f.truncate(), f.write(f"{os.getpid()}\n"), f.flush()
    return f


def make_dir(run_dir: Path, exist_ok: bool = True) -> None:
    """mkdir, with an OSError said in one line (a runs_dir under a file or on a read-only mount was a traceback)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=exist_ok)
    except FileExistsError:
        if not exist_ok:  # the caller takes another name
            raise
        raise ServiceError(f"cannot make the run folder {run_dir}: a file is in the way; choose another runs_dir "
                           "(--set run.runs_dir=DIR) or --run-id") from None
    except OSError as e:
        raise ServiceError(f"cannot make the run folder {run_dir} ({e.strerror or e}); choose another runs_dir "
                           "(--set run.runs_dir=DIR) or --run-id") from None


def claim(run_dir: Path) -> Any:
    """Make and lock the folder of a `--run-id` or `--resume`; ServiceError when another `tlt run` holds it."""
    make_dir(run_dir)
    lock = lock_run_dir(run_dir)
    if lock is None:
        try:
            holder = (run_dir / LOCK_FILE).read_text().strip()
        except OSError:
            holder = ""
        raise ServiceError(f"{run_dir} is in use by another `tlt run` (pid {holder or '?'}); wait for it, "
                           f"or start this one in another folder (--run-id)")
    return lock


def interrupted(runs: Path, stem: str, preset: str) -> list[Path]:
    """The `<stem>-<time>` folders (new folders of `default_folder`) of runs started from this very preset, the
    one launched last first (run.json is rewritten at every launch). Whether one is finished is judged once it
    is locked."""
    name = re.compile(re.escape(stem) + r"-\d{8}-\d{6}(-\d+)?")
    found = []
    for run_dir in runs.glob(f"{glob.escape(stem)}-*") if runs.is_dir() else ():
        if not name.fullmatch(run_dir.name):
            continue
        try:  # another preset's (same file name, another folder) or an unreadable run.json: not this one's run
            saved, launched = json.loads((run_dir / "run.json").read_text()), (run_dir / "run.json").stat().st_mtime
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(saved, dict) and saved.get("preset") == preset:
            found.append((launched, run_dir))
    return [run_dir for _, run_dir in sorted(found, reverse=True)]


def default_folder(runs: Path, preset: str) -> tuple[Path, Any, bool]:
    """The folder of a `tlt run` with no --run-id, locked, and whether this launch made it: `<stem>` (the preset's
    name) while no other `tlt run` holds it and its trainer has steps left, else the interrupted `<stem>-<time>` of
    this preset launched last (`tlt run` again continues it, as after an interruption in `<stem>`), else a new
    `<stem>-<time>`, `-2`, `-3`, ... Each folder is locked before it is judged, and a new one is taken with an
    mkdir that fails when it exists: judged first, then locked, the third of three `tlt run` started in one second
    was refused (the second held the one `<stem>-<time>` of that second)."""
    stem = Path(preset).stem
    for run_dir in (runs / stem, *interrupted(runs, stem, preset)):
        created = not run_dir.exists()
        if created:
            make_dir(run_dir)
        lock = lock_run_dir(run_dir)
        if lock is None:  # another `tlt run`'s
            continue
        if continues(run_dir):
            return run_dir, lock, created
        lock.close()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        run_dir = runs / (f"{stem}-{stamp}" if n == 1 else f"{stem}-{stamp}-{n}")
        try:
            make_dir(run_dir, exist_ok=False)
        except FileExistsError:  # another `tlt run` of this second made it first
            continue
        lock = lock_run_dir(run_dir)
        if lock is not None:
            return run_dir, lock, True
    raise ServiceError(f"no free run folder {runs / stem}-{stamp}-N; name one with --run-id")


def read_run_file(run_dir: Path) -> dict[str, Any]:
    """A run folder's run.json; ServiceError for one that cannot be read (it was a traceback at every launch)."""
    path = run_dir / "run.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ServiceError(f"{path} is not a valid run file ({e}); start a new run (another --run-id)") from None
    if not isinstance(saved, dict):
        raise ServiceError(f"{path} is not a valid run file (a JSON {type(saved).__name__}, not an object); start a "
                           "new run (another --run-id)")
    return saved


def write_atomic(path: Path, text: str) -> None:
    """Write `path` whole or not at all (a kill or a full disk left a truncated run.json: every later launch of
    the folder failed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as e:  # a full disk, a read-only folder: one line, not a traceback
        raise ServiceError(f"cannot write {path} ({e.strerror or e}); free space there, or choose another runs_dir "
                           "(--set run.runs_dir=DIR)") from None


def write_export_record(policy_dir: Path, steps_done: int, version: int, run_dir: Path,
                        exporting: bool = False) -> None:
    """Record in the export which policy it holds: after `steps_done` steps, `version`, of the run in `run_dir`
    (its folder name and run.json's `created` when there is one: `tlt run`). Written whole or not at all.
    exporting: written before the export begins ("exporting": true, finished() and stale_export take the folder as
    an export cut short), and replaced by the record without it once the export has ended."""
    policy_dir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"steps_done": steps_done, "policy_version": version, "run": run_dir.name}
    if (created := _created(run_dir)) is not None:
        record["run_created"] = created
    if exporting:
        record["exporting"], record["started_at"] = True, time.time()
    else:
        record["exported_at"] = time.time()
    write_atomic(policy_dir / EXPORT_RECORD, json.dumps(record, indent=2) + "\n")


def export_record(policy_dir: Path) -> dict[str, Any] | None:
    """The export's record (write_export_record); None when there is none or it cannot be read."""
    try:
        record = json.loads((policy_dir / EXPORT_RECORD).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def stale_export(run_dir: Path) -> str | None:
    """Why run_dir/policy is not the policy of the run's latest checkpoint, or None (it is, or there is no export or
    no checkpoint to compare): a resumed run killed between its last checkpoint and its export left the older one.
    With what to do: continue the run."""
    if (doubt := export_doubt(run_dir)) is None:
        return None
    return (f"{doubt[1]}: continue the run to export it (`tlt run --resume {run_dir}`, or `tlt train` with output_dir "
            f"{run_dir}): it resumes from the checkpoint and exports")


def export_doubt(run_dir: Path) -> tuple[str, str] | None:
    """The one rule of finished(), `tlt report` (stale_export) and `tlt run`'s warning: None when run_dir/policy
    holds the policy of the run's latest checkpoint (its record says this run's export of that step or a later one
    ended), or there is no export or no checkpoint to compare. Otherwise (kind, what was found): kind "unrecorded"
    (no record: an older TLT's export) or "stale" (another step, run, an export cut short, a record unreadable)."""
    from tlt.services.trainer.checkpoint import CheckpointManager

    run_dir, pointer = Path(run_dir), Path(run_dir) / "checkpoints" / "latest"
    policy = run_dir / "policy"
    if not pointer.is_file() or not (policy / "config.json").is_file():
        return None
    try:
        steps = CheckpointManager.steps_of(pointer.read_text())
    except ValueError:
        return None
    latest = f"the latest checkpoint is after {_steps(steps)}"
    if not (policy / EXPORT_RECORD).exists():
        return "unrecorded", (f"{policy} records no step (exported by an older TLT, which left none either when its "
                              f"export was interrupted); {latest}")
    record = export_record(policy)
    if record is None:
        return "stale", (f"{policy / EXPORT_RECORD} cannot be read (not a JSON object): which step {policy} holds is "
                         f"unknown; {latest}")
    if doubt := _record_doubt(record, run_dir):
        return "stale", f"{policy} {doubt}; {latest}"
    if record["steps_done"] < steps:
        return "stale", (f"{policy} holds the policy after {_steps(record['steps_done'])} but {latest}: the run "
                         "stopped before exporting it")
    return None


def _record_doubt(record: dict[str, Any], run_dir: Path) -> str | None:
    """Why an export's (readable) record does not say that this run's export ended, after how many steps; None when
    it does (its steps_done is then an int)."""
    steps = record.get("steps_done")
    if not isinstance(steps, int) or isinstance(steps, bool):
        return f"records no step (steps_done is {json.dumps(steps)[:40]} in {EXPORT_RECORD})"
    if record.get("exporting"):
        return f"may be partial: its export (after {_steps(steps)}) was interrupted"
    created = _created(run_dir)
    if created is not None and record.get("run_created") not in (None, created):
        return (f"was exported by another run (created {record.get('run_created')}, this one {created}), after "
                f"{_steps(steps)}")
    return None


def _created(run_dir: Path) -> Any:
    """run.json's `created` (a `tlt run` folder's identity: it survives every resume), or None."""
    try:
        return read_run_file(run_dir).get("created") if (run_dir / "run.json").exists() else None
    except ServiceError:
        return None


def _steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"
