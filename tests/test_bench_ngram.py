"""`tlt bench ngram`: the model-free drafter's host time per speculative step, on the engine's own call
(`NgramSource.draft`). Checks the figures' shape and that the timed calls draft real trees (with every token
copied from the shared text, siblings' matches give full-length chains)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_ngram_reports_every_case_as_json():
    r = subprocess.run([sys.executable, "-m", "tlt.cli", "bench", "ngram", "--groups", "2,4", "--vocab", "16",
                        "--arms", "3_1_4,2_2_5", "--steps", "20", "--repeats", "2", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["steps"] == 20 and out["repeats"] == 2
    cases = [(row["vocab"], row["group"], row["arm"]) for row in out["rows"]]
    assert cases == [(16, 2, "3_1_4"), (16, 2, "2_2_5"), (16, 4, "3_1_4"), (16, 4, "2_2_5")]
    for row in out["rows"]:
        assert row["ms_per_step"] > 0
        assert abs(row["us_per_sequence"] * row["group"] / 1e3 - row["ms_per_step"]) < 1e-6


def test_the_timed_call_drafts_real_chains_when_siblings_share_their_text(monkeypatch):
    from tlt.bench import ngram_host
    from tlt.services.rollout.spec.drafting import NgramSource

    sizes: list[int] = []
    real = NgramSource.draft

    def recording(self, seqs, arm):  # noqa: ANN001, ANN202
        tree, counts = real(self, seqs, arm)
        sizes.extend(counts.tolist())
        return tree, counts

    monkeypatch.setattr(NgramSource, "draft", recording)
    # a vocabulary so large that a random token never repeats: only text shared by the siblings can be matched
    assert ngram_host.measure(4, 10**9, "4_1_5", steps=40, copy=0.9, seed=0) > 0
    shared, longest = sum(sizes) / len(sizes), max(sizes)
    sizes.clear()
    ngram_host.measure(4, 10**9, "4_1_5", steps=40, copy=0.0, seed=0)
    alone = sum(sizes) / len(sizes)
    assert len(sizes) == 160 and alone == 1.0  # nothing to match: root-only trees
    # drafts from the siblings that ran ahead (by a few tokens: the drafts are as long as that lead)
    assert shared > 1.25 and longest >= 3, (shared, longest)


def test_each_repeat_has_its_own_seed_and_the_figure_is_their_median(monkeypatch, capsys):
    """`--repeats R`: run r on seed + r (R runs of one text would be one measurement R times), reported as the
    median of the R runs' seconds per step (not the fastest)."""
    import argparse

    from tlt.bench import ngram_host

    seeds: list[int] = []
    seconds = {7: 3.0, 8: 1.0, 9: 2.5}

    def measure(group, vocab, arm, steps, copy, seed):  # noqa: ANN001, ANN202
        seeds.append(seed)
        return seconds[seed]

    monkeypatch.setattr(ngram_host, "measure", measure)
    parser = argparse.ArgumentParser()
    ngram_host.add_arguments(parser)
    args = parser.parse_args(["--groups", "2", "--vocab", "16", "--arms", "3_1_4", "--steps", "10", "--repeats", "3",
                              "--seed", "7", "--json"])
    assert ngram_host.run(args) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert seeds == [7, 8, 9]
    assert abs(row["ms_per_step"] - 2.5 / 10 * 1e3) < 1e-9 and abs(row["us_per_sequence"] - 2.5 / 10 / 2 * 1e6) < 1e-6
