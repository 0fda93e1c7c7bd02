"""A run with `eval_problems = 1` evaluates, reports and closes without a paired change.

A change paired by problem needs two problems at least (model.evaluate.paired_counts raises ValueError for one):
with a single eval problem `evaluate.change` gives no pairing, and the report (`write_report`, at the end of every
`tlt run`) and the closing line (`change_text`) state the accuracies without a paired s.e. A `>= 1` in change's
guard passed every test (the mutation audit's e7) and ended such a run's report in that ValueError.
"""

from __future__ import annotations

import json
from pathlib import Path

from report_helpers import write_metrics
from tlt.services.trainer.evaluate import EvalRecord, change, change_text, read_evals
from tlt.services.trainer.report import write_report


def test_one_eval_problem_gives_no_paired_change_and_no_error(tmp_path: Path) -> None:
    write_metrics(tmp_path, [{"reward_mean": 0.5, "accuracy": 0.4}] * 3)
    recs = [EvalRecord(0, 0, 0.5, 1, 2, 1.0, 9.0, greedy_accuracy=0.0, correct=(1,), greedy_correct=(0,)),
            EvalRecord(3, 3, 1.0, 1, 2, 1.0, 9.0, greedy_accuracy=1.0, correct=(2,), greedy_correct=(1,))]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r.as_dict()) + "\n" for r in recs))
    first, last = read_evals(tmp_path / "eval.jsonl")
    assert change(first, last) == {}
    assert change_text(first, last, "sampled") == change_text(first, last, "greedy") == ""
    page = write_report(tmp_path, threshold=16).read_text()
    assert "<b>0.500</b> after 0 steps &rarr; <b>1.000</b> after 3 steps" in page
    assert "a change of" not in page and "heldout.png" not in page
