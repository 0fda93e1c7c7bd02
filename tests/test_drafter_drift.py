"""`tlt bench drafter-drift` (frozen vs online drafter under policy updates), run for real at tiny settings.

The real policy, drafters and feature collection run; `sample_features` is wrapped (not replaced) only to
record which prompts each rollout set was drawn from and which policy version it was tagged with.
"""

from __future__ import annotations

import argparse
import json

import pytest

from tlt.bench import drafter_drift
from tlt.services.drafter import collect

REAL_SAMPLE_FEATURES = collect.sample_features
TINY = ["--updates", "2", "--policy-steps", "1", "--drafter-steps", "2", "--warmup-steps", "2",
        "--rollouts", "4", "--length", "8", "--depth", "2"]


def _run(tmp_path, monkeypatch: pytest.MonkeyPatch, seed: int, name: str,
         extra: list[str] | None = None) -> tuple[dict, list[tuple[str, int, list]]]:
    calls: list[tuple[str, int, list]] = []
    real = REAL_SAMPLE_FEATURES

    def spy(model, prompts, max_new_tokens, temperature=0.0, policy_version=0, *a, **kw):  # noqa: ANN001, ANN202
        calls.append((kw.get("prefix", ""), policy_version, [tuple(p) for p in prompts]))
        return real(model, prompts, max_new_tokens, temperature, policy_version, *a, **kw)

    monkeypatch.setattr(collect, "sample_features", spy)
    parser = argparse.ArgumentParser()
    drafter_drift.add_arguments(parser)
    out = tmp_path / f"{name}.json"
    assert drafter_drift.run(parser.parse_args([*TINY, *(extra or []), "--seed", str(seed), "--out", str(out)])) == 0
    return json.loads(out.read_text()), calls


def test_seed_draws_its_own_prompts_and_held_out_stays_disjoint(tmp_path, monkeypatch) -> None:
    res0, calls0 = _run(tmp_path, monkeypatch, 0, "s0")
    again, calls0b = _run(tmp_path, monkeypatch, 0, "s0b")
    _, calls1 = _run(tmp_path, monkeypatch, 1, "s1")
    assert calls0 == calls0b and res0["history"] == again["history"]  # one seed: one result
    # rollout sets: version 0 and each update's training set, then that update's held-out set
    assert [(v, p.split("-")[1]) for p, v, _ in calls0] == [(0, "0"), (1, "1"), (1, "10001"), (2, "2"), (2, "10002")]
    train = {p for pre, _, ps in calls0 if int(pre.split("-")[1]) < 10_000 for p in ps}
    held = {p for pre, _, ps in calls0 if int(pre.split("-")[1]) >= 10_000 for p in ps}
    assert held and train and not held & train
    # another seed is another experiment: its prompts differ too, not only the policy's init
    prompts0 = [ps for _, _, ps in calls0]
    prompts1 = [ps for _, _, ps in calls1]
    assert all(a != b for a, b in zip(prompts0, prompts1, strict=True))


def test_without_online_steps_both_drafters_score_the_same(tmp_path, monkeypatch) -> None:
    """Fairness: online and frozen start from one warmed-up drafter and are scored by one rule on one held-out
    set with the live policy's embedding / lm_head, so with no online micro-steps they can only tie."""
    res, _ = _run(tmp_path, monkeypatch, 0, "tie", extra=["--drafter-steps", "0"])
    assert [h["online"] for h in res["history"]] == [h["frozen"] for h in res["history"]]
    assert all(h["steps"] > 0 for h in res["history"]) and res["ratio_online_over_frozen"] == 1.0
