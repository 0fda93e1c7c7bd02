"""`reward = "task"` on a user's own data: it is the synthetic task's integer `answer:` reader, not a math verifier.

A GSM8K / MATH file with references such as `\\frac{1}{2}` trained with it: its correct `\\boxed{}` answers scored 0
and a completion writing `answer: 3` failed the step with int()'s ValueError. `tlt data check` and the trainer's
start (trainer_prompts) now refuse such a file in one line naming the fix. Real files and the real tiny
checkpoint (tests/rollout_helpers.py), run through `tlt.cli.main`; nothing is faked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tlt.cli import main


pytestmark = pytest.mark.usefixtures("no_tlt_environment")  # the caller's TLT_* variables: conftest.py


@pytest.fixture(scope="module")
def preset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout_helpers import tiny_checkpoint

    root = tmp_path_factory.mktemp("task_refs")
    model = tiny_checkpoint(root / "policy")
    p = root / "my.toml"
    p.write_text(f'[trainer]\nmodel_dir = "{model}"\nmax_tokens = 16\neval_problems = 0\n\n'
                 "[rollout.engine]\nmax_model_len = 64\n")
    return p


def _data(tmp_path: Path, answers: list[object]) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": a}) + "\n" for i, a in enumerate(answers)))
    return path


def _trainer_prompts(preset: Path, data: Path, reward: str) -> list:
    from tlt.services.common.config import load_config
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.data import trainer_prompts

    return trainer_prompts(load_config(TrainerConfig, "trainer", str(preset), {"data_path": str(data), "reward": reward}))


def test_non_integer_references_with_the_task_reward_are_refused_at_start_and_by_data_check(
        tmp_path, preset, capsys) -> None:
    from tlt.services.trainer.data import DataError

    data = _data(tmp_path, [72, "\\frac{1}{2}", "3.5"])
    with pytest.raises(DataError) as refused:
        _trainer_prompts(preset, data, "task")
    says = str(refused.value)
    assert "reward = 'task'" in says and "'\\\\frac{1}{2}'" in says and "2 of 3" in says, says
    assert "reward = 'grpc'" in says and "tlt reward serve --kind math" in says, says  # the fix
    rc = main(["--log-json", "data", "check", "--data", str(data), "--preset", str(preset),
               "--set", "trainer.reward=task"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and json.loads(lines[0])["error"] == says, lines


def test_the_same_file_with_the_math_server_or_integer_references_with_task_pass(tmp_path, preset) -> None:
    assert len(_trainer_prompts(preset, _data(tmp_path, [72, "\\frac{1}{2}"]), "grpc")) == 2
    assert len(_trainer_prompts(preset, _data(tmp_path, [72, "-3", " 007 "]), "task")) == 3


def test_the_task_verifier_names_a_non_integer_reference_whatever_the_completion_wrote() -> None:
    from tlt.task.verify import verify

    assert verify("answer: 72", "72") and not verify("\\boxed{72}", "72")  # `answer: <int>` only
    for completion in ("answer: 3", "no marker at all"):  # it raised only when the completion wrote an integer
        with pytest.raises(ValueError, match=r"not an integer.*reward = 'task' reads"):
            verify(completion, "\\frac{1}{2}")


def test_a_resume_check_names_the_references_not_a_data_change(tmp_path, preset) -> None:
    """A resumed run (`tlt run`'s resume check, run_resume.data_file_change) on the very file of its checkpoint
    with reward = 'task' was told its data file had changed ("a resume keeps the data it was trained on (...);
    restore that file"), where the reason is the references the task reward cannot read."""
    from tlt.services.common.config import load_config
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.data import PromptSampler, load_prompts
    from tlt.services.trainer.procs import ServiceError
    from tlt.services.trainer.run_resume import data_file_change

    data = _data(tmp_path, [72, "\\frac{1}{2}"])
    cfg = load_config(TrainerConfig, "trainer", str(preset), {"data_path": str(data), "reward": "task"})
    sampler = PromptSampler(load_prompts(data, cfg.answer_field, cfg.model_dir), cfg.seed)
    state = (tmp_path / "step-1", {"sampler": {"size": len(sampler.items), "fingerprint": sampler.fingerprint}})
    with pytest.raises(ServiceError) as refused:
        data_file_change(cfg, state)
    says = str(refused.value)
    assert "1 of 2 reference answers are not integers" in says and "reward = 'grpc'" in says, says
    grpc = load_config(TrainerConfig, "trainer", str(preset), {"data_path": str(data), "reward": "grpc"})
    assert data_file_change(grpc, state) is None
    data.write_text(data.read_text() + '{"prompt": "q2", "answer": 3}\n')
    assert "now holds 3 prompts, 2 at the checkpoint" in data_file_change(grpc, state)


def test_an_eval_file_the_task_reward_cannot_read_is_refused_at_start_and_by_data_check(
        tmp_path, preset, capsys) -> None:
    """eval_data_path is scored by the same reward: its non-integer references failed the run at its first eval
    (after the first eval_every steps), not at start with the data file's message."""
    from tlt.services.common.config import load_config
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.data import DataError
    from tlt.services.trainer.evaluate import eval_items

    data = _data(tmp_path, [72, 3])
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"e{i}", "answer": a}) + "\n"
                                for i, a in enumerate([5, "x = 5", 6])))
    overrides = {"data_path": str(data), "eval_data_path": str(held_out), "eval_problems": 3}
    cfg = load_config(TrainerConfig, "trainer", str(preset), {**overrides, "reward": "task"})
    with pytest.raises(DataError) as refused:
        eval_items(cfg)
    says = str(refused.value)
    assert str(held_out) in says and "1 of 3 reference answers are not integers" in says, says
    assert "'x = 5'" in says and "reward = 'grpc'" in says, says
    rc = main(["--log-json", "data", "check", "--data", str(data), "--preset", str(preset),
               "--set", "trainer.reward=task", "--set", f"trainer.eval_data_path={held_out}",
               "--set", "trainer.eval_problems=3"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and json.loads(lines[0])["error"] == says, lines
    grpc = load_config(TrainerConfig, "trainer", str(preset), {**overrides, "reward": "grpc"})
    assert len(eval_items(grpc)) == 3


def test_the_trainer_refuses_a_bad_eval_file_before_it_loads_the_policy(tmp_path, preset, monkeypatch) -> None:
    """The eval file's refusal came after the policy (and a resumed checkpoint) had loaded, minutes for a large model;
    the data file's came before. Both now come before: the policy load is recorded here, and must not happen."""
    from tlt.services.common.config import load_config
    from tlt.services.trainer import loop, policy
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.data import DataError

    loaded: list[str] = []

    class Recorded:  # Policy(cfg): the first thing of the trainer that loads the model
        def __init__(self, cfg: TrainerConfig) -> None:
            loaded.append(cfg.model_dir)
            raise RuntimeError("the policy was loaded before the eval file was checked")

    monkeypatch.setattr(policy, "Policy", Recorded)
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"e{i}", "answer": a}) + "\n"
                                for i, a in enumerate([5, "x = 5", 6])))
    cfg = load_config(TrainerConfig, "trainer", str(preset),
                      {"data_path": str(_data(tmp_path, [72, 3])), "eval_data_path": str(held_out), "eval_problems": 3,
                       "reward": "task", "output_dir": str(tmp_path / "out"), "rollout_addresses": ["127.0.0.1:1"]})
    with pytest.raises(DataError, match="1 of 3 reference answers are not integers"):
        loop.train(cfg)
    assert loaded == []
    cfg = load_config(TrainerConfig, "trainer", str(preset), {"data_path": str(_data(tmp_path, [72, 3])),
                                                              "output_dir": str(tmp_path / "out")})
    with pytest.raises(RuntimeError, match="policy was loaded"):  # a good file: the policy is what comes next
        loop.train(cfg)
    assert loaded == [cfg.model_dir]


def test_the_refusal_names_the_file_line_and_value(tmp_path, preset) -> None:
    """The start-up refusal named the file and a value but not where it is: in a large eval or data file the user had
    to search for it. It now opens with the first bad reference's file:line (JSONL; a Parquet file's row) and value,
    and says where the next ones are."""
    from tlt.services.common.config import load_config
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.data import DataError
    from tlt.services.trainer.evaluate import eval_items

    held_out = tmp_path / "eval.jsonl"  # a blank line: lines are the file's, not the rows'
    held_out.write_text(json.dumps({"prompt": "e0", "answer": 5}) + "\n\n"
                        + "".join(json.dumps({"prompt": f"e{i}", "answer": a}) + "\n"
                                  for i, a in enumerate(["x = 5", 6, "7/2"], 1)))
    cfg = load_config(TrainerConfig, "trainer", str(preset), {"data_path": str(_data(tmp_path, [72, 3])),
                                                              "eval_data_path": str(held_out), "eval_problems": 4,
                                                              "reward": "task"})
    with pytest.raises(DataError) as refused:
        eval_items(cfg)
    says = str(refused.value)
    assert says.startswith(f"{held_out}:3: reference answer 'x = 5' is not an integer"), says
    assert f"{held_out}:5 ('7/2')" in says and "2 of 4 reference answers are not integers" in says, says
    with pytest.raises(DataError) as refused:
        _trainer_prompts(preset, _data(tmp_path, [72, 3, "\\frac{1}{2}"]), "task")
    assert str(refused.value).startswith(f"{tmp_path / 'd.jsonl'}:3: reference answer '\\\\frac{{1}}{{2}}'"), refused
