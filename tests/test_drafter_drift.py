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


def test_the_figure_is_online_over_frozen_after_the_last_update(tmp_path, monkeypatch) -> None:
    """Each update scores the online drafter (trained on) and the frozen one (never trained after the warm-up);
    the headline ratio is online / frozen of the last update. The scorer is wrapped to return 1, 2, 3, 4 in call
    order and to record which drafter it scored, with its weights at that moment."""
    import torch

    from tlt.services.drafter import acceptance

    scored: list[tuple[object, list[torch.Tensor]]] = []

    def score(drafter, held, depth):  # noqa: ANN001, ANN202
        scored.append((drafter, [p.detach().clone() for p in drafter.parameters()]))
        return float(len(scored)), 5

    monkeypatch.setattr(acceptance, "mean_accept_length", score)
    res, _ = _run(tmp_path, monkeypatch, 0, "scored")
    assert [(h["online"], h["frozen"]) for h in res["history"]] == [(1.0, 2.0), (3.0, 4.0)]
    assert (res["online"], res["frozen"], res["ratio_online_over_frozen"]) == (3.0, 4.0, 0.75)
    (online1, w_on1), (frozen1, w_fr1), (online2, w_on2), (frozen2, w_fr2) = scored
    assert online1 is online2 and frozen1 is frozen2 and online1 is not frozen1
    assert all(torch.equal(a, b) for a, b in zip(w_fr1, w_fr2, strict=True))  # frozen: never trained again
    assert not all(torch.equal(a, b) for a, b in zip(w_on1, w_on2, strict=True))  # online: trained in between


def test_the_task_shifts_a_step_further_at_every_update(tmp_path, monkeypatch) -> None:
    """The policy's training sequences follow the shifted teacher table at a share k / K in update k (K updates):
    the start table alone at version 0, the end table alone at the last update. With a start table that always
    says 5 and an end table that always says 6, the tokens after each sequence's first tell which table ran."""
    import torch
    import transformers

    monkeypatch.setattr(drafter_drift, "_teacher", lambda vocab, lo, hi, seed: torch.full((vocab,), 5 if seed == 1 else 6))
    batches: list[torch.Tensor] = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def load(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        model = real(*a, **kw)
        forward = model.forward

        def recording(*fa, **fkw):  # noqa: ANN002, ANN003, ANN202
            if fkw.get("labels") is not None:  # a policy update's batch
                batches.append(fkw["input_ids"][:, 1:].clone())
            return forward(*fa, **fkw)

        model.forward = recording
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)
    _run(tmp_path, monkeypatch, 0, "shift", extra=["--updates", "2", "--policy-steps", "1"])
    assert len(batches) == 3 + 2  # three updates on version 0, then one per update
    assert all(bool((b == 5).all()) for b in batches[:3])  # version 0: the start task only
    assert bool((batches[3] == 5).any()) and bool((batches[3] == 6).any())  # update 1 of 2: half shifted
    assert bool((batches[4] == 6).all())  # the last update: the shifted task only
