"""`tlt drafter warmup` on a tiny random Qwen2: collects post-norm features of the model's own greedy
samples, trains, writes a loadable drafter folder with only its own weights and
a report with held-out acceptance lengths; trained beats the random start on held-out data."""

from __future__ import annotations

import json
import subprocess
import sys

from safetensors.torch import load_file

from tlt.cli import main
from tlt.model.drafter import load_drafter
from tlt.model.testing import random_checkpoint
from tlt.services.drafter.training import target_shared


def test_warmup_cli(tmp_path) -> None:
    # the command's `main` in this process: what is checked is what it wrote, not the process
    model = random_checkpoint(tmp_path / "m")
    out = tmp_path / "d"
    assert main(["drafter", "warmup", "--model", str(model), "--out", str(out), "--problems", "16", "--epochs", "6",
                 "--temperature", "0", "--max-new-tokens", "48", "--rows", "4", "--row-tokens", "128",
                 "--lr", "3e-3"]) == 0
    report = json.loads((out / "warmup.json").read_text())
    assert report["steps"] > 0 and report["heldout_steps"] > 0
    assert report["accept_len_after"] > report["accept_len_before"] >= 1.0
    names = set(load_file(str(out / "model.safetensors")))
    assert names and not any("embed" in n or "lm_head" in n for n in names)
    _, embed, head = target_shared(model)
    load_drafter(out, embed, head)  # loads with the target's shared tensors
    # --depth is the chain depth of both scores, the trained start's too: this drafter, scored before another epoch,
    # accepts less in a chain of 1 than in one of 6 (a "before" scored at the default 6 whatever --depth said passed)
    before = {}
    for depth in (1, 6):
        assert main(["drafter", "warmup", "--model", str(model), "--out", str(tmp_path / f"e{depth}"), "--init",
                     str(out), "--problems", "16", "--epochs", "1", "--temperature", "0", "--max-new-tokens", "48",
                     "--rows", "4", "--row-tokens", "128", "--depth", str(depth)]) == 0
        again = json.loads((tmp_path / f"e{depth}" / "warmup.json").read_text())
        assert again["depth"] == depth
        before[depth] = again["accept_len_before"]
    assert 1.0 < before[1] < before[6] and before[1] <= 2.0, before


def test_heldout_split_keeps_every_window_of_a_sequence_together() -> None:
    # 16 sequences, the odd ones cut into 3 windows: held-out and training windows never share a sequence
    from types import SimpleNamespace

    from tlt.services.drafter.warmup import split_heldout

    samples = [SimpleNamespace(seq_id=f"p{i}-0@{w * 100}") for i in range(16) for w in range(3 if i % 2 else 1)]
    train, held = split_heldout(samples)
    base = lambda xs: {s.seq_id.rsplit("@", 1)[0] for s in xs}  # noqa: E731
    assert base(held) == {"p7-0", "p15-0"} and not base(held) & base(train)
    assert len(held) == 6 and len(train) + len(held) == len(samples)


def test_drafter_commands_given_a_wrong_folder_fail_with_one_line_not_a_traceback(tmp_path, capfd) -> None:
    """`tlt drafter warmup --model` / `export --drafter` pointed at a folder that is not a checkpoint ended in a
    transformers traceback (rc 1) or one of our own errors as a traceback; now one log line naming the folder, rc 2.
    The first case is the real `tlt` process (its exit status and stderr); the others run `tlt.cli.main` here."""
    model = random_checkpoint(tmp_path / "m")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = {
        "warmup, no checkpoint": (["warmup", "--model", str(empty), "--out", str(tmp_path / "o1")], "no config.json"),
        "warmup, missing": (["warmup", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")],
                            "does not exist"),
        "export, no drafter": (["export", "--drafter", str(empty), "--model", str(model), "--out",
                                str(tmp_path / "o3")], "is not a drafter folder"),
        "export, no model": (["export", "--drafter", str(empty), "--model", str(empty), "--out",
                              str(tmp_path / "o4")], "no config.json"),
    }
    for i, (name, (cmd, needle)) in enumerate(cases.items()):
        if i == 0:
            r = subprocess.run([sys.executable, "-m", "tlt.cli", "drafter", *cmd], capture_output=True, text=True,
                               timeout=120)
            rc, out = r.returncode, r.stdout + r.stderr
        else:
            capfd.readouterr()
            try:
                rc = main(["drafter", *cmd])
            except Exception as e:  # noqa: BLE001 - what the user would have seen as a traceback
                rc = f"Traceback: {type(e).__name__}: {e}"
            out = "".join(capfd.readouterr())
        assert rc == 2 and needle in out and str(tmp_path) in out, (name, rc, out[-2000:])
        assert "Traceback" not in out, (name, out[-2000:])
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3", "o4"))  # nothing half-written
