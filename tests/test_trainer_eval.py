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
                               rewards=None, publisher=None, guard=None, eval_path=tmp_path / "eval.jsonl",
                               g_eval=prom.gauge("eval_accuracy", "x"), g_eval_greedy=prom.gauge("eval_greedy_accuracy", "x"))
    loop._Services.evaluate(services, 0, 0)
    text = prom.render().decode()
    assert "trainer_eval_accuracy 0.4" in text and "trainer_eval_greedy_accuracy 0.42" in text
    loop._Services.evaluate(services, 10, 10)  # an eval without a greedy figure leaves the last one standing
    text = prom.render().decode()
    assert "trainer_eval_accuracy 0.39" in text and "trainer_eval_greedy_accuracy 0.42" in text


def test_the_change_between_two_evals_is_paired_by_problem_by_hand(tmp_path):
    """`change`: last minus first, per problem, with the s.e. of the mean difference. 4 problems x 2 samples:
    sampled per-problem accuracies 0, .5, 1, .5 -> .5, .5, 1, 1: differences .5, 0, 0, .5, mean .25,
    sd sqrt(1/12) = 0.288675, s.e. 0.144338; greedy 0, 1, 1, 0 -> 1, 1, 1, 0: differences 1, 0, 0, 0, mean .25,
    sd 0.5, s.e. 0.25. The records round-trip through eval.jsonl with their counts."""
    from tlt.services.trainer.evaluate import change, change_text

    first = EvalRecord(0, 0, 0.5, 4, 2, 1.0, 1.0, 0.0, 0.5, (0, 1, 2, 1), (0, 1, 1, 0))
    last = EvalRecord(10, 10, 0.75, 4, 2, 1.0, 1.0, 0.0, 0.75, (1, 1, 2, 2), (1, 1, 1, 0))
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(r.as_dict()) + "\n" for r in (first, last)))
    assert read_evals(path) == [first, last]
    d = change(*read_evals(path))
    assert d["sampled"].mean == pytest.approx(0.25) and d["sampled"].se == pytest.approx(0.144338, abs=1e-6)
    assert d["greedy"].mean == pytest.approx(0.25) and d["greedy"].se == pytest.approx(0.25)
    assert change_text(first, last, "sampled") == " (+0.250, paired s.e. 0.144)"
    # a record from before the counts were kept: no paired figure, not a wrong one
    old = EvalRecord(0, 0, 0.5, 4, 2, 1.0, 1.0)
    assert change(old, last) == {} and change_text(old, last, "greedy") == ""
    # greedy only where both scored it
    assert set(change(EvalRecord(0, 0, 0.5, 4, 2, 1.0, 1.0, correct=(0, 1, 2, 1)), last)) == {"sampled"}
    # evals not scored alike (a resumed run with another eval temperature or samples per problem): no pairing
    import dataclasses

    assert change(dataclasses.replace(first, temperature=0.0), last) == {}
    assert change(dataclasses.replace(first, samples=4, correct=(0, 2, 4, 2)), last) == {}
    # other problems of the same count (a resumed run's changed eval data): no pairing; the same ones, or a record
    # from before the digest was kept: paired
    assert change(dataclasses.replace(first, eval_set="aa"), dataclasses.replace(last, eval_set="bb")) == {}
    assert set(change(dataclasses.replace(first, eval_set="aa"), dataclasses.replace(last, eval_set="aa"))) == {
        "sampled", "greedy"}
    assert set(change(first, dataclasses.replace(last, eval_set="bb"))) == {"sampled", "greedy"}


def test_an_eval_counts_correct_completions_per_problem_in_eval_set_order(monkeypatch):
    """run_eval's per-problem counts come from each completion's prompt_index, whatever order the completions
    arrive in (a stub rollout here: the real path is tests/test_trainer_loop.py's eval tests); at eval_temperature 0
    the sampled pass is greedy already: no second pass, greedy_accuracy = accuracy even where a problem's greedy
    samples disagree (speculative and plain argmaxes can differ in the last bits), no greedy counts of their own."""
    from types import SimpleNamespace

    from tlt.services.trainer import collect, weight_sync
    from tlt.services.trainer.evaluate import run_eval
    from tlt.services.trainer.types import PromptItem, ScoredCompletion

    right = {(0, 1), (2, 0), (2, 1), (1, 0)}  # (problem, sample) completions that are correct
    calls = []

    def stub(items, clients, rewards, n, params, label, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append((n, params.temperature))
        assert params.reproducible  # plain decoding's tokens for the eval's uniforms, whatever speculation does
        done = [ScoredCompletion(p, s, (1,), (2,), float((p, s) in right), (p, s) in right)
                for p in reversed(range(len(items))) for s in range(n)]  # arrival order is not the eval set's
        return SimpleNamespace(samples=done)

    monkeypatch.setattr(collect, "collect_retrying", stub)
    monkeypatch.setattr(weight_sync, "check_versions", lambda versions, expected: None)
    items = [PromptItem(i, f"q{i}", str(i)) for i in range(3)]
    cfg = TrainerConfig(eval_problems=3, eval_samples=2, eval_temperature=1.0, eval_greedy=True)
    r = run_eval(items, [], None, cfg, 0, 0)
    assert r.correct == (1, 1, 2) and r.accuracy == pytest.approx(4 / 6)
    from tlt.services.trainer.evaluate import eval_set_digest

    assert r.eval_set == eval_set_digest(items) != eval_set_digest([*items[:2], PromptItem(2, "q2", "3")])
    assert eval_set_digest(items) != eval_set_digest(items[::-1])
    assert r.greedy_correct == (0, 1, 1) and r.greedy_accuracy == pytest.approx(2 / 3)  # the n = 1 pass: sample 0
    assert calls == [(2, 1.0), (1, 0.0)]
    # a resumed run's policy version runs ahead of its steps (sync_version raises it past the servers'): the record is
    # the eval after 2 steps, of version 5, and the report draws it after step 2
    late = run_eval(items, [], None, cfg, 2, 5)
    assert (late.after_steps, late.policy_version) == (2, 5)
    calls.clear()
    right = {(0, 0), (0, 1), (2, 0)}  # problem 2's two greedy samples disagree
    r = run_eval(items, [], None, TrainerConfig(eval_problems=3, eval_samples=2, eval_temperature=0.0,
                                                eval_greedy=True), 0, 0)
    assert calls == [(2, 0.0)] and r.correct == (2, 0, 1) and r.greedy_correct is None
    assert r.greedy_accuracy == r.accuracy == pytest.approx(3 / 6)


def test_a_resumed_trainers_metrics_start_where_the_run_stands(tmp_path) -> None:
    """The trainer's /metrics read step 0, reward 0 and eval accuracy 0 after a resume from step 2 until its first
    new step ended (a dashboard dropped to zero at every restart). They start from the kept steps and evals.
    A real _Services over the run's files (its clients connect lazily; nothing is called)."""
    import json

    from tlt.services.trainer import loop

    out = tmp_path / "run"
    out.mkdir()
    rows = [{"step": k, "reward_mean": 0.25 * (k + 1), "times": {"step_s": 10.0 + k}} for k in range(3)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [EvalRecord(k, k, 0.3 + 0.1 * k, 4, 2, 1.0, 0.1, 0.0, 0.5 if k == 0 else None) for k in (0, 2, 3)]
    (out / "eval.jsonl").write_text("".join(json.dumps(e.as_dict()) + "\n" for e in evals))
    cfg = TrainerConfig(output_dir=str(out), rollout_addresses=["127.0.0.1:1"], eval_problems=0)
    services = loop._Services(cfg, out, 2)  # resumes from the checkpoint after 2 steps: step 2's line is dropped
    try:
        text = services.prom.render().decode()
    finally:
        services.close()
    assert "trainer_step 2.0" in text and "trainer_reward_mean 0.5" in text  # step 1's reward
    assert 'trainer_step_seconds{phase="step_s"} 11.0' in text
    assert "trainer_eval_accuracy 0.5" in text and "trainer_eval_greedy_accuracy 0.5" in text  # the eval after 2
