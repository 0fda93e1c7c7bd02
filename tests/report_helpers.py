"""Helpers of the report tests (test_run_report.py, test_run_report_evals.py): a spy on each plot's axes as it is
saved, and a metrics.jsonl of hand-made rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def saved_axes(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Each plot's axes as it is saved, by file name (a spy: the real savefig still writes the PNG)."""
    from matplotlib.figure import Figure

    saved: dict[str, list] = {}
    real = Figure.savefig

    def spy(fig, fname, *args, **kwargs):  # noqa: ANN001, ANN202
        saved[Path(fname).name] = fig.axes
        return real(fig, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return saved


def write_metrics(tmp_path: Path, rows: list[dict]) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": k, "policy_version": k + 1, "started_at": 100.0 + 10 * k, "tokens": 100,
                    "times": {"step_s": 9.0, "rollout_s": 5.0}, **r}) + "\n" for k, r in enumerate(rows)))
