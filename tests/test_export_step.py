"""The policy export says which step it holds, and a run folder's report says when it is older than the latest checkpoint.

A resumed run killed between its last checkpoint and its export left policy/ at the older step while
checkpoints/latest was newer, and nothing told the user: `tlt report` was silent and a plain `tlt run` took the
folder as finished (policy/ existed), so the newer policy was never exported. Real parts: a rollout server on
127.0.0.1 (native engine, one replica), the trainer's own loop on CPU, `tlt report`. The kill between the last
checkpoint and the export is the last checkpoint's save raising once it is written, as a SIGKILL there would stop
the trainer.
"""

from __future__ import annotations

import json

import pytest
import torch

from rollout_helpers import ServerThread
from tlt.cli import main
from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.loop import train
from tlt.services.trainer.run_folder import EXPORT_RECORD, finished, stale_export


def config(model_dir, address, out, **kw) -> TrainerConfig:
    base = dict(model_dir=str(model_dir), rollout_addresses=[address], output_dir=str(out), prompts_per_step=2,
                n_samples=2, max_tokens=8, mini_batch_size=4, micro_batch_size=4, steps=1, checkpoint_interval=1,
                synthetic_problems=16, torch_threads=1, connect_timeout_s=30)
    return TrainerConfig(**{**base, **kw})


class Killed(BaseException):
    """The trainer stopped between its last checkpoint and its export."""


def test_a_resumed_run_killed_before_its_export_is_reported(random_model_dir, tmp_path, monkeypatch, capsys) -> None:
    from tlt.services.trainer.checkpoint import CheckpointManager

    torch.set_num_threads(1)
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"preset": "cpu-tiny", "created": 1234.5}))
    (out / "config.toml").write_text("[trainer]\nsteps = 2\n")  # what `tlt run` continues the folder with
    with ServerThread(random_model_dir, replicas=1) as server:
        train(config(random_model_dir, server.grpc_address, out, steps=1))
        record = json.loads((out / "policy" / EXPORT_RECORD).read_text())
        assert (record["steps_done"], record["policy_version"]) == (1, 1)
        assert (record["run"], record["run_created"]) == ("run", 1234.5)
        assert stale_export(out) is None

        save = CheckpointManager.save

        def save_then_killed(self, policy, sampler, steps_done):  # noqa: ANN001, ANN202
            save(self, policy, sampler, steps_done)
            if steps_done == 2:
                raise Killed

        monkeypatch.setattr(CheckpointManager, "save", save_then_killed)
        with pytest.raises(Killed):  # resumed to 2 steps: step 2 checkpointed, then killed before the export
            train(config(random_model_dir, server.grpc_address, out, steps=2))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert (out / "policy" / "config.json").is_file()  # the step-1 export, still there
    why = stale_export(out)
    assert why is not None and "after 1 step" in why and "after 2 steps" in why and "--resume" in why, why
    assert not finished(out)  # a plain `tlt run` continues this folder (and exports), not a new one
    assert main(["report", str(out)]) == 0
    captured = capsys.readouterr()
    assert why in captured.err
    assert "after 1 step" in (out / "report.html").read_text()


def test_an_export_of_unknown_step_or_another_run_is_reported(tmp_path) -> None:
    """No record beside the HF files (an older TLT's export, or one an older TLT interrupted: it removed the record
    first), or a record of another run than run.json's: said, naming the latest checkpoint's step."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-00000003\n")
    (run / "policy").mkdir()
    (run / "policy" / "config.json").write_text("{}")
    assert "records no step" in stale_export(run) and "after 3 steps" in stale_export(run)
    (run / "run.json").write_text(json.dumps({"created": 2.0}))
    (run / "policy" / EXPORT_RECORD).write_text(json.dumps({"steps_done": 3, "policy_version": 3, "run": "run",
                                                            "run_created": 1.0}))
    assert "another run" in stale_export(run)
    (run / "run.json").write_text(json.dumps({"created": 1.0}))
    assert stale_export(run) is None
    # a record that names no run (`tlt train` exported into the folder before it had a run.json): this run's
    (run / "policy" / EXPORT_RECORD).write_text(json.dumps({"steps_done": 3, "policy_version": 3, "run": "run"}))
    assert stale_export(run) is None
    (run / "checkpoints" / "latest").unlink()  # nothing checkpointed: nothing to compare
    assert stale_export(run) is None


def test_an_export_cut_short_is_not_finished_and_is_redone(random_model_dir, tmp_path, monkeypatch, capsys) -> None:
    """An export killed half-way (model.safetensors partly written) left no record at all (the trainer removed it
    first), which finished() took for an older TLT's whole export: a plain `tlt run` opened a new folder and the
    half-written policy was never redone. The trainer now writes a record saying the export has begun and replaces
    it once the export ends: finished() is False, continues() True, `tlt report` says so, and continuing exports."""
    from tlt.services.trainer.policy import Policy
    from tlt.services.trainer.run_folder import continues

    torch.set_num_threads(1)
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"preset": "cpu-tiny", "created": 99.5}))
    (out / "config.toml").write_text("[trainer]\nsteps = 1\n")
    save = Policy.save_pretrained

    def save_cut_short(self, out_dir):  # noqa: ANN001, ANN202 - killed while model.safetensors is written
        save(self, out_dir)
        weights = next(iter(sorted((out / "policy").glob("*.safetensors"))))
        weights.write_bytes(weights.read_bytes()[:100])
        raise Killed

    with ServerThread(random_model_dir, replicas=1) as server:
        monkeypatch.setattr(Policy, "save_pretrained", save_cut_short)
        with pytest.raises(Killed):
            train(config(random_model_dir, server.grpc_address, out, steps=1))
        record = json.loads((out / "policy" / EXPORT_RECORD).read_text())
        assert record["exporting"] is True and record["steps_done"] == 1 and record["run_created"] == 99.5
        assert (out / "policy" / "config.json").is_file() and (out / "checkpoints" / "latest").is_file()
        assert not finished(out) and continues(out)  # a plain `tlt run` continues this folder
        why = stale_export(out)
        assert why is not None and "interrupted" in why and "--resume" in why, why
        assert main(["report", str(out)]) == 0
        assert why in capsys.readouterr().err
        monkeypatch.setattr(Policy, "save_pretrained", save)
        summary = train(config(random_model_dir, server.grpc_address, out, steps=1))  # continued: exports again
    assert summary.steps_done == 1
    record = json.loads((out / "policy" / EXPORT_RECORD).read_text())
    assert "exporting" not in record and record["steps_done"] == 1 and "exported_at" in record
    assert finished(out) and not continues(out) and stale_export(out) is None

    # each record that does not say this run's export ended: unfinished, continued, warned; never a crash
    good = (out / "policy" / EXPORT_RECORD).read_text()
    for text, said in [(json.dumps({**record, "steps_done": None}), "records no step"),
                       (json.dumps({**record, "steps_done": "1"}), "records no step"),
                       (json.dumps({**record, "run_created": 12.0}), "another run"),
                       (json.dumps({**record, "exporting": True}), "interrupted"),
                       ("[1, 2]", "cannot be read"), ("{not json", "cannot be read")]:
        (out / "policy" / EXPORT_RECORD).write_text(text)
        assert not finished(out) and continues(out), text
        why = stale_export(out)
        assert why is not None and said in why and "--resume" in why, (text, why)
    (out / "policy" / EXPORT_RECORD).unlink()  # no record at all: an older TLT's export, taken as finished (warned)
    assert finished(out) and not continues(out) and "records no step" in stale_export(out)
    (out / "policy" / EXPORT_RECORD).write_text(good)
    assert finished(out)


def test_steps_lowered_after_a_run_leave_finished_and_the_report_agreeing(tmp_path) -> None:
    """finished() compared the export's step with config.toml's `steps`, `tlt report` with checkpoints/latest: a run
    checkpointed after 4 steps but exported after 2 (killed before its last export), its `steps` then lowered to 2,
    was finished for a plain `tlt run` (a new folder; the step-4 policy never exported) while the report said the
    export was stale. Both now ask one rule: the export must hold the latest checkpoint's step."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-00000004\n")
    (run / "policy").mkdir()
    (run / "policy" / "config.json").write_text("{}")
    (run / "policy" / "model.safetensors").write_bytes(b"x")
    (run / "run.json").write_text(json.dumps({"created": 1.0}))
    (run / "config.toml").write_text("[trainer]\nsteps = 2\n")  # lowered from 4 after the run
    record = {"steps_done": 2, "policy_version": 2, "run": "run", "run_created": 1.0}
    (run / "policy" / EXPORT_RECORD).write_text(json.dumps(record))
    assert "after 2 steps" in (stale_export(run) or "") and not finished(run)
    (run / "policy" / EXPORT_RECORD).write_text(json.dumps({**record, "steps_done": 4}))  # exported after 4
    assert stale_export(run) is None and finished(run)
    (run / "config.toml").write_text("[trainer]\nsteps = 6\n")  # raised: steps left, whatever the export
    assert stale_export(run) is None and not finished(run)


def test_tlt_run_says_in_one_line_when_it_continues_a_folder_to_export_again(tmp_path) -> None:
    """Only `tlt report` said that a folder's export was older than its latest checkpoint (or cut short, another
    run's, unrecorded); a plain `tlt run` continuing it (or `--resume`) re-exported in silence. It now warns in one
    line (`export_redone`), with the report's reason (run_folder.export_doubt), and says nothing for a sound one."""
    from structlog.testing import capture_logs

    from test_run_plan import _checkpointed, _closed, _fake_model, _plan

    model, runs = _fake_model(tmp_path)
    first = _closed(_plan(runs, model, "--steps", "4"))
    _checkpointed(first.run_dir, 4, exported=True)
    record = {"steps_done": 2, "policy_version": 2, "run": first.run_dir.name,
              "run_created": json.loads((first.run_dir / "run.json").read_text())["created"]}
    (first.run_dir / "policy" / EXPORT_RECORD).write_text(json.dumps(record))  # stopped before its last export
    with capture_logs() as logs:
        again = _closed(_plan(runs, model))
    assert again.run_dir == first.run_dir and again.resumed
    warned = [e for e in logs if e["event"] == "export_redone"]
    assert len(warned) == 1 and warned[0]["log_level"] == "warning", logs
    assert "after 2 steps" in warned[0]["found"] and "after 4 steps" in warned[0]["found"], warned
    (first.run_dir / "policy" / EXPORT_RECORD).write_text(json.dumps({**record, "steps_done": 4}))
    with capture_logs() as logs:
        resumed = _closed(_plan(runs, model, "--resume", str(first.run_dir)))
    assert resumed.run_dir == first.run_dir and not [e for e in logs if e["event"] == "export_redone"], logs


def test_an_export_record_that_cannot_be_written_is_one_line(tmp_path) -> None:
    """write_export_record wrote its temporary file itself, so a full disk or a blocked path was an OSError traceback
    at the end of a run; it writes through run_folder.write_atomic now, one ServiceError naming the file."""
    from tlt.services.trainer.procs import ServiceError
    from tlt.services.trainer.run_folder import write_export_record

    (tmp_path / "policy" / f".{EXPORT_RECORD}.tmp").mkdir(parents=True)  # the temporary file's path is taken
    with pytest.raises(ServiceError, match=EXPORT_RECORD):
        write_export_record(tmp_path / "policy", 2, 2, tmp_path)
