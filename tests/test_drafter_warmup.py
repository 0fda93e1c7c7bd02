"""`tlt drafter warmup` on a tiny random Qwen2: collects post-norm features of the model's own greedy
samples, trains, writes a loadable drafter folder with only its own weights and
a report with held-out acceptance lengths; trained beats the random start on held-out data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
                                str(tmp_path / "o3")], "is neither a drafter folder"),
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


def _recorded_warmup(monkeypatch, capfd, argv: list[str]) -> tuple[dict, dict]:
    """Run `tlt drafter warmup` here with the real split, packing, step and scoring, each recorded as it is called."""
    from tlt.services.drafter import acceptance, packing, training, warmup

    seen: dict = {"samples": None, "split": None, "scored": [], "packed": [], "steps": []}
    real_split, real_score, real_pack, real_step = (warmup.split_heldout, acceptance.mean_accept_length, packing.pack,
                                                    training.micro_step)

    def split(samples, *a, **k):
        seen["samples"], seen["split"] = list(samples), real_split(samples, *a, **k)
        return seen["split"]

    def score(drafter, samples, depth, *a, **k):
        seen["scored"].append((list(samples), depth))
        return real_score(drafter, samples, depth, *a, **k)

    def pack(samples, rows, row_tokens):
        batch, used = real_pack(samples, rows, row_tokens)
        seen["packed"].extend(used)
        return batch, used

    def step(drafter, opt, batch, *a, **k):
        seen["steps"].append(dict(k, sequences=batch.sequences))
        return real_step(drafter, opt, batch, *a, **k)

    monkeypatch.setattr(warmup, "split_heldout", split)
    monkeypatch.setattr(acceptance, "mean_accept_length", score)
    monkeypatch.setattr(packing, "pack", pack)
    monkeypatch.setattr(training, "micro_step", step)
    capfd.readouterr()
    assert main(["drafter", "warmup", *argv]) == 0
    out = argv[argv.index("--out") + 1]
    return json.loads((Path(out) / "warmup.json").read_text()), seen


def test_warmup_trains_every_epoch_on_the_training_windows_and_scores_only_the_held_out_ones(
        tmp_path, monkeypatch, capfd) -> None:
    """The report's figures are those of what ran: both acceptance lengths over the held-out windows alone, every
    training window packed once per epoch for --epochs epochs, the step's noise, TTT depth and TLT.md's clip of 1.0,
    windows cut to --row-tokens (answers of 48 tokens in rows of 16), and the bar counting epochs from 1."""
    model = random_checkpoint(tmp_path / "m")
    report, seen = _recorded_warmup(monkeypatch, capfd, [
        "--model", str(model), "--out", str(tmp_path / "d"), "--problems", "16", "--epochs", "2", "--temperature", "0",
        "--max-new-tokens", "48", "--rows", "4", "--row-tokens", "16", "--noise", "0.05", "--ttt-steps", "2",
        "--depth", "3"])
    err = capfd.readouterr().err
    train, held = seen["split"]
    assert held and train and max(len(s) for s in seen["samples"]) <= 16
    assert len({s.seq_id.rsplit("@", 1)[0] for s in seen["samples"]}) < len(seen["samples"])  # answers span windows
    assert [([id(s) for s in xs], d) for xs, d in seen["scored"]] == [([id(s) for s in held], 3)] * 2
    counts = {id(s): 0 for s in train}
    for s in seen["packed"]:
        counts[id(s)] += 1  # a held-out window here is a KeyError
    assert set(counts.values()) == {2} and sum(k["sequences"] for k in seen["steps"]) == 2 * len(train)
    order = [id(s) for s in seen["packed"]]  # epoch 1's windows, then epoch 2's: each epoch is shuffled anew
    assert order[:len(train)] != order[len(train):]
    assert report["steps"] == len(seen["steps"]) > 0 and report["epochs"] == 2
    assert {(k["noise"], k["ttt_steps"], k["grad_clip"]) for k in seen["steps"]} == {(0.05, 2, 1.0)}
    assert (report["train_windows"], report["heldout_windows"], report["train_tokens"]) == (
        len(train), len(held), sum(len(s) for s in train))
    assert "epoch 1/2" in err and "epoch 2/2" in err and "epoch 0/2" not in err


def test_reference_data_windows_start_at_the_prompts_last_token(tmp_path, monkeypatch, capfd) -> None:
    """--data reference teacher-forces the task's solutions: each answer's first window starts at the prompt's last
    token (h there predicts the first answer token), not one token into the answer."""
    from tlt.model.tokenizer import load_tokenizer
    from tlt.task.problems import format_prompt, generate_problems

    model = random_checkpoint(tmp_path / "m")
    _, seen = _recorded_warmup(monkeypatch, capfd, [
        "--model", str(model), "--out", str(tmp_path / "d"), "--problems", "8", "--epochs", "1", "--data",
        "reference", "--rows", "2", "--row-tokens", "128", "--seed", "3"])
    tok = load_tokenizer(model)
    first = {s.seq_id.rsplit("@", 1)[0]: s for s in reversed(seen["samples"])}
    assert sorted(first) == sorted(f"p{i}" for i in range(8))
    for i, prob in enumerate(generate_problems(8, seed=1003)):  # --seed 3's problems
        p = tok(format_prompt(prob), add_special_tokens=False)["input_ids"]
        answer = tok(prob.solution + "<|im_end|>", add_special_tokens=False)["input_ids"]
        assert first[f"p{i}"].tokens.tolist() == [p[-1], *answer] and first[f"p{i}"].response_start == 1, i
