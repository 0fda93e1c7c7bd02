"""`tlt drafter warmup` on a tiny random Qwen2: collects post-norm features of the model's own greedy
samples, trains, writes a loadable drafter folder with only its own weights and
a report with held-out acceptance lengths; trained beats the random start on held-out data."""

from __future__ import annotations

import json
import subprocess
import sys

from safetensors.torch import load_file

from tlt.model.drafter import load_drafter
from tlt.model.testing import random_checkpoint
from tlt.services.drafter.training import target_shared


def test_warmup_cli(tmp_path) -> None:
    model = random_checkpoint(tmp_path / "m")
    out = tmp_path / "d"
    subprocess.run([sys.executable, "-m", "tlt.cli", "drafter", "warmup", "--model", str(model), "--out", str(out),
                    "--problems", "16", "--epochs", "6", "--temperature", "0", "--max-new-tokens", "48", "--rows", "4",
                    "--row-tokens", "128",
                    "--lr", "3e-3"], check=True, capture_output=True)
    report = json.loads((out / "warmup.json").read_text())
    assert report["steps"] > 0 and report["heldout_starts"] > 0
    assert report["accept_len_after"] > report["accept_len_before"] >= 1.0
    names = set(load_file(str(out / "model.safetensors")))
    assert names and not any("embed" in n or "lm_head" in n for n in names)
    _, embed, head = target_shared(model)
    load_drafter(out, embed, head)  # loads with the target's shared tensors


def test_heldout_split_keeps_every_window_of_a_sequence_together() -> None:
    # 16 sequences, the odd ones cut into 3 windows: held-out and training windows never share a sequence
    from types import SimpleNamespace

    from tlt.services.drafter.warmup import split_heldout

    samples = [SimpleNamespace(seq_id=f"p{i}-0@{w * 100}") for i in range(16) for w in range(3 if i % 2 else 1)]
    train, held = split_heldout(samples)
    base = lambda xs: {s.seq_id.rsplit("@", 1)[0] for s in xs}  # noqa: E731
    assert base(held) == {"p7-0", "p15-0"} and not base(held) & base(train)
    assert len(held) == 6 and len(train) + len(held) == len(samples)
