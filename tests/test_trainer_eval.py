"""The held-out eval's schedule, its resume bookkeeping and its data (services/trainer/evaluate.py).

The eval through a real rollout server is covered by
tests/test_trainer_loop.py::test_resume_continues_versions_and_data.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.evaluate import EvalRecord, due, eval_items, read_evals, trim_evals


def test_due_before_training_every_interval_and_at_the_end():
    cfg = TrainerConfig(eval_problems=8, eval_interval=4, steps=10)
    assert [k for k in range(11) if due(cfg, k)] == [0, 4, 8, 10]
    assert not any(due(TrainerConfig(eval_problems=0, steps=10), k) for k in range(11))


def test_synthetic_eval_set_is_the_model_eval_draw_and_independent_of_the_trainer_seed():
    from tlt.model.evaluate import eval_problems
    from tlt.task import format_prompt

    a = eval_items(TrainerConfig(eval_problems=5, seed=0))
    b = eval_items(TrainerConfig(eval_problems=5, seed=7))
    assert [(i.prompt, i.answer) for i in a] == [(i.prompt, i.answer) for i in b]
    assert [(i.prompt, i.answer) for i in a] == [(format_prompt(p), p.answer) for p in eval_problems(5, 0)]
    # ... and disjoint in seed from the training draw (synthetic_prompts(n, seed))
    from tlt.services.trainer.data import synthetic_prompts

    assert [i.prompt for i in a] != [i.prompt for i in synthetic_prompts(5, 0)]


def test_eval_data_path_rows_and_errors(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(3)))
    items = eval_items(TrainerConfig(eval_problems=2, eval_data_path=str(path)))
    assert [(i.prompt, i.answer) for i in items] == [("q0", "0"), ("q1", "1")]
    with pytest.raises(ValueError, match="eval_problems asks for 5"):
        eval_items(TrainerConfig(eval_problems=5, eval_data_path=str(path)))
    with pytest.raises(ValidationError, match="needs eval_data_path"):
        TrainerConfig(eval_problems=4, data_path=str(path))


def test_trim_keeps_evals_up_to_the_resumed_step(tmp_path):
    path = tmp_path / "eval.jsonl"
    recs = [EvalRecord(k, k, 0.1 * k, 4, 1, 0.0, 0.5) for k in (0, 2, 4)]
    path.write_text("".join(json.dumps(r.as_dict()) + "\n" for r in recs))
    trim_evals(path, 3)
    assert read_evals(path) == recs[:2]
    trim_evals(tmp_path / "missing.jsonl", 1)  # nothing to trim: no error


def test_an_eval_line_from_before_greedy_accuracy_still_loads_and_a_new_one_round_trips(tmp_path):
    # eval.jsonl of a run from before eval_greedy: its lines have no greedy_accuracy and must still read (a resumed or
    # re-reported old run); a line with it reads back as written
    old = {"after_steps": 0, "policy_version": 0, "accuracy": 0.25, "problems": 4, "samples": 2, "temperature": 1.0,
           "seconds": 1.5, "started_at": 100.0}
    new = EvalRecord(10, 10, 0.5, 4, 2, 1.0, 3.0, 200.0, greedy_accuracy=0.75)
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps(old) + "\n" + json.dumps(new.as_dict()) + "\n")
    first, second = read_evals(path)
    assert first == EvalRecord(0, 0, 0.25, 4, 2, 1.0, 1.5, 100.0) and first.greedy_accuracy is None
    assert second == new and second.greedy_accuracy == 0.75
    assert json.loads(path.read_text().splitlines()[1])["greedy_accuracy"] == 0.75


def test_the_trainers_metrics_export_the_last_greedy_accuracy(tmp_path, monkeypatch):
    """/metrics had only the sampled eval accuracy: a dashboard could not follow the greedy curve."""
    from types import SimpleNamespace

    from tlt.services.common.metrics import Metrics
    from tlt.services.trainer import evaluate, loop

    records = iter([EvalRecord(0, 0, 0.40, 4, 2, 1.0, 0.1, 0.0, 0.42), EvalRecord(10, 10, 0.39, 4, 2, 1.0, 0.1, 0.0, None)])
    monkeypatch.setattr(evaluate, "run_eval", lambda *a, **kw: next(records))
    prom = Metrics("trainer")
    services = SimpleNamespace(cfg=TrainerConfig(eval_problems=4, eval_greedy=True), eval_items=[], clients=[],
                               rewards=None, publisher=None, eval_path=tmp_path / "eval.jsonl",
                               g_eval=prom.gauge("eval_accuracy", "x"), g_eval_greedy=prom.gauge("eval_greedy_accuracy", "x"))
    loop._Services.evaluate(services, 0, 0)
    text = prom.render().decode()
    assert "trainer_eval_accuracy 0.4" in text and "trainer_eval_greedy_accuracy 0.42" in text
    loop._Services.evaluate(services, 10, 10)  # an eval without a greedy figure leaves the last one standing
    text = prom.render().decode()
    assert "trainer_eval_accuracy 0.39" in text and "trainer_eval_greedy_accuracy 0.42" in text
