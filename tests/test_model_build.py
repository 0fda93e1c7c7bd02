"""`tlt model build` and `tlt model eval`: a very short real build loads offline in transformers and generates.

Nothing is faked: a real tokenizer is trained, a real Qwen2 model is trained
for a few steps, saved, reloaded with `HF_HUB_OFFLINE=1` and run. The
accuracy and length-tail figures of the full build are checked by the slow
test on artifacts/tiny (the `tiny_model_dir` fixture builds it when missing).
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from tlt.model.build import build_model, lr_at, packed_batches
from tlt.model.evaluate import _bucket, eval_problems, evaluate, percentile
from tlt.model.tokenizer import test_tokenizer
from tlt.task import format_prompt, generate_problems


def test_lr_schedule_hand_values():
    kw = dict(lr=1.0, warmup=4, total=14, min_ratio=0.1)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == pytest.approx(1.0)  # cosine starts at the peak
    assert lr_at(9, **kw) == pytest.approx(0.55)  # half way: 0.1 + 0.9 * 0.5
    assert lr_at(14, **kw) == pytest.approx(0.1)
    assert lr_at(20, **kw) == pytest.approx(0.1)


def test_packed_rows_keep_problem_boundaries():
    tok = test_tokenizer()
    batch = next(packed_batches(tok, seq_len=320, batch_size=3, seed=0))
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    assert ids.shape == labels.shape == pos.shape == (3, 320)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    docs = []
    for r in range(3):
        starts = [c for c in range(320) if pos[r, c] == 0]
        for a, b in zip(starts, starts[1:] + [320]):
            seg = ids[r, a:b].tolist()
            assert pos[r, a:b].tolist() == list(range(b - a))  # positions restart at every problem
            if seg[0] == im_start:
                docs.append((tok.decode(seg), tok.decode([t for t in labels[r, a:b].tolist() if t != -100])))
            else:  # the padding tail of a row: never trained on
                assert set(seg) == {tok.pad_token_id} and set(labels[r, a:b].tolist()) == {-100}
    assert len(docs) >= 6
    # The packed problems are the seeded training draw, in order, with loss on the assistant turn only.
    from tlt.model.build import TRAIN_SEED_OFFSET

    expected = generate_problems(len(docs), seed=0 + TRAIN_SEED_OFFSET)
    for (text, trained), p in zip(docs, expected):
        assert text == format_prompt(p) + p.solution + "<|im_end|>"
        assert trained == p.solution + "<|im_end|>"


def test_percentile_and_buckets():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert [_bucket(k) for k in (1, 2, 3, 4, 5, 8, 9, 32)] == ["1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "17-32"]


def test_short_build_loads_offline_and_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "tiny"
    facts = build_model("tiny", out, seed=0, max_steps=3, eval_n=0)
    assert facts["steps"] == 3 and facts["preset"] == "tiny" and facts["seed"] == 0
    assert json.loads((out / ".complete").read_text()) == facts
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temp folder was renamed away
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    # the weights are readable like the config beside them (safetensors wrote them 0600 whatever the umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == (out / "config.json").stat().st_mode & 0o777

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2"
    assert model.config.num_hidden_layers == 12 and model.config.num_key_value_heads == 2
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.config.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.config.vocab_size >= len(tok)
    p = generate_problems(2, seed=1)
    chat = tok.apply_chat_template([{"role": "user", "content": p[0].prompt}], tokenize=False, add_generation_prompt=True)
    assert chat == format_prompt(p[0])
    enc = tok([format_prompt(x) for x in p], return_tensors="pt", padding=True)
    assert (enc["input_ids"][:, -1] != tok.pad_token_id).all()  # left padding
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] > enc["input_ids"].shape[1]


def test_build_evaluates_on_the_native_engine(tmp_path):
    facts = build_model("tiny", tmp_path / "m", seed=0, max_steps=1, eval_n=3)
    assert facts["eval_engine"] == "native" and facts["eval_n"] == 3
    assert 0.0 <= facts["accuracy"] <= 1.0 and facts["p99_len"] >= facts["p50_len"] > 0
    assert facts["eval_seconds"] <= facts["build_seconds"]


def test_build_is_seeded(tmp_path):
    a = build_model("tiny", tmp_path / "a", seed=3, max_steps=1, eval_n=0)
    b = build_model("tiny", tmp_path / "b", seed=3, max_steps=1, eval_n=0)
    assert a["final_loss"] == b["final_loss"]
    sa = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert sa == (tmp_path / "b" / "model.safetensors").read_bytes()
    # the report names what else the weights depend on, and a digest that tells two builds apart
    assert a["weights_sha256"] == b["weights_sha256"] == hashlib.sha256(sa).hexdigest()[:16]
    assert a["torch"] == torch.__version__ and a["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert a["train_threads"] >= 1
    c = build_model("tiny", tmp_path / "c", seed=4, max_steps=1, eval_n=0)
    assert c["weights_sha256"] != a["weights_sha256"]


def test_evaluate_on_random_checkpoint(random_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(random_model_dir)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    report = evaluate(model, tok, eval_problems(4), samples=1)
    assert report.engine == "transformers"
    assert report.n == 4 and 0.0 <= report.accuracy <= 1.0
    assert report.p99_len >= report.p50_len > 0
    assert eval_problems(4) != generate_problems(4, seed=0)  # held out from the seed-0 training draws


def test_native_eval_answers_as_transformers_greedy(random_model_dir):
    # the independent reference: `transformers` generate on the same checkpoint; greedy answers and their lengths
    # (eos included) must be the same tokens, so the build's accuracy means what it meant before session 37
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tlt.model.evaluate import NativeGenerator, generate

    prompts = [format_prompt(p) for p in eval_problems(6)]
    tok = AutoTokenizer.from_pretrained(random_model_dir)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    texts, lengths = generate(model, tok, prompts, max_new_tokens=40, do_sample=False, batch_size=3)
    native = NativeGenerator(random_model_dir, threads=1)
    answers = native(prompts, max_new_tokens=40, do_sample=False)
    assert [a[0] for a in answers] == list(zip(texts, lengths))
    with pytest.raises(ValueError, match="samples must be 1"):
        native(prompts, max_new_tokens=4, do_sample=False, samples=2)


def test_native_eval_samples_are_seeded_per_problem(random_model_dir):
    # a problem's samples do not depend on which other problems run beside it (paired comparisons of two
    # checkpoints need common random numbers per problem), and another seed draws other samples
    from tlt.model.evaluate import NativeGenerator

    prompts = [format_prompt(p) for p in eval_problems(6)]
    native = NativeGenerator(random_model_dir, threads=1)
    alone = native(prompts[:2], max_new_tokens=24, do_sample=True, samples=3, seed=5)
    together = native(prompts, max_new_tokens=24, do_sample=True, samples=3, seed=5)
    assert together[:2] == alone
    assert len({text for text, _ in together[0]}) > 1  # three samples of one prompt, not one repeated
    assert native(prompts[:2], max_new_tokens=24, do_sample=True, samples=3, seed=6) != alone


def test_evaluate_native_report(random_model_dir):
    from tlt.model.evaluate import NativeGenerator

    problems = eval_problems(4)
    report = evaluate(None, None, problems, samples=2, native=NativeGenerator(random_model_dir, threads=1))
    assert report.engine == "native" and report.n == 4 and report.samples == 2
    assert len(report.greedy_correct) == len(report.sampled_correct) == 4
    assert all(0 <= c <= 2 for c in report.sampled_correct)
    assert report.p99_len >= report.p50_len > 0
    from tlt.task.slips import SLIPS

    # where the 8 sampled completions first leave the reference derivation: shares of all 8, in SLIPS order
    assert list(report.sampled_slips) == list(SLIPS) and abs(sum(report.sampled_slips.values()) - 1) < 1e-9
    assert report.sampled_slips["none"] <= report.sampled_accuracy  # a clean derivation is a right answer
    with pytest.raises(ValueError, match="NativeGenerator or a transformers model"):
        evaluate(None, None, problems)


@pytest.mark.slow
def test_tiny_model_meets_targets(tiny_model_dir):
    facts = json.loads((tiny_model_dir / ".complete").read_text())
    assert 0.15 <= facts["accuracy"] <= 0.85, facts
    assert facts["tail_ratio"] >= 4, facts
    assert os.path.getsize(tiny_model_dir / "model.safetensors") > 1_000_000


def test_model_eval_shows_progress_on_stderr_and_keeps_stdout_json(random_model_dir, capfd):
    # a 200-problem eval with samples runs for minutes on a CPU: it printed nothing until the end
    # (`tlt model eval` run in this process, its file descriptors 1 and 2 captured: a subprocess added seconds of
    # imports and showed nothing more)
    from tlt.cli import main

    capfd.readouterr()
    rc = main(["model", "eval", "--model", str(random_model_dir), "--n", "6", "--samples", "2", "--batch-size", "4",
               "--threads", "1", "--json"])
    out, err = capfd.readouterr()
    assert rc == 0, err[-2000:]
    report = json.loads(out)  # stdout is the one JSON object, nothing else
    assert report["n"] == 6 and report["samples"] == 2
    assert "greedy_correct" not in report and "sampled_correct" not in report  # per problem: left out of as_dict
    assert "eval: 100%" in err and "18/18" in err  # 6 problems x (greedy + 2 samples), native engine


def test_model_eval_refuses_an_empty_eval(random_model_dir, capsys):
    # `tlt model eval --n 0` crashed (max() of an empty list, then a division by zero)
    from tlt.cli import main

    with pytest.raises(SystemExit) as e:
        main(["model", "eval", "--model", str(random_model_dir), "--n", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --n: must be >= 1, got 0" in err and "Traceback" not in err


def test_an_interrupted_build_leaves_nothing_beside_its_out(tmp_path, monkeypatch):
    """Ctrl-C (or any failure) during a build left its `.<out>.tmp-PID` folder beside --out; the next build
    (another pid) never cleaned it."""
    import tlt.model.tokenizer as tokenizer

    real = tokenizer.build_tokenizer

    def interrupted(folder, *args, **kwargs):
        real(folder, *args, **kwargs)  # the temp folder now holds the tokenizer
        assert any(tmp_path.iterdir())
        raise KeyboardInterrupt

    monkeypatch.setattr(tokenizer, "build_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_model("tiny", tmp_path / "tiny", seed=0, max_steps=1, eval_n=0)
    assert list(tmp_path.iterdir()) == []


def test_a_build_stopped_by_sigterm_leaves_nothing_beside_its_out_and_dies_of_the_signal(tmp_path):
    """SIGTERM (a container's stop, `timeout`, the parent-death signal) ended a build at once, without the cleanup
    Ctrl-C runs: its half-built `.<out>.tmp-PID` folder stayed beside --out for good. The real CLI in a child
    process, stopped while it trains; it still dies of the signal (launchers read the status) and says so."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "tiny"
    child = subprocess.Popen([sys.executable, "-m", "tlt.cli", "model", "build", "--out", str(out), "--max-steps",
                              "5000", "--eval-n", "0", "--threads", "1"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(tmp_path.glob(".tiny.tmp-*/tokenizer.json")) and time.monotonic() < deadline:
            assert child.poll() is None, child.stderr.read()[-2000:]
            time.sleep(0.1)
        assert any(tmp_path.glob(".tiny.tmp-*/tokenizer.json")), "the build never wrote its tokenizer"
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert child.returncode == -signal.SIGTERM, err[-2000:]
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    assert "build_terminated" in err and "SIGTERM" in err


def test_paired_difference_by_hand():
    from tlt.model.evaluate import paired_difference

    d = paired_difference([1, 1, 0, 1], [0, 1, 0, 0])  # differences 1, 0, 0, 1: mean 0.5, sd 0.57735
    assert d.mean == 0.5 and abs(d.se - 0.57735027 / 2) < 1e-8
    assert abs(d.ci95[0] - (0.5 - 1.96 * d.se)) < 1e-12 and abs(d.ci95[1] - (0.5 + 1.96 * d.se)) < 1e-12
    assert paired_difference([0.25, 0.5], [0.25, 0.5]).se == 0.0
    with pytest.raises(ValueError):
        paired_difference([1.0], [0.0])


def test_model_eval_against_itself_is_a_zero_paired_difference(random_model_dir, tmp_path, capfd):
    """--against scores the second checkpoint on the same problems with the same sampling seeds: a copy of the
    model samples the very same completions, so every per-problem difference is 0 (independent draws would not
    give 0 for the sampled figure). Against another model the difference is that of the two accuracies.
    (`tlt model eval` in this process: what is compared is the command's JSON, not the process.)"""
    import shutil

    from tlt.cli import main

    copy = tmp_path / "copy"
    shutil.copytree(random_model_dir, copy)
    base = ["model", "eval", "--n", "6", "--samples", "2", "--batch-size", "4", "--threads", "1", "--json"]
    capfd.readouterr()
    rc = main(base + ["--model", str(random_model_dir), "--against", str(copy)])
    stdout, err = capfd.readouterr()
    assert rc == 0, err[-2000:]
    out = json.loads(stdout)
    assert out["model"]["sampled_accuracy"] == out["against"]["sampled_accuracy"]
    for name in ("greedy", "sampled"):
        assert out["difference"][name]["mean"] == 0.0 and out["difference"][name]["se"] == 0.0
    rc = main(base[:-1] + ["--n", "1", "--model", str(random_model_dir), "--against", str(copy)])
    assert rc == 2 and "--against needs --n >= 2" in capfd.readouterr().err


def test_compare_is_paired_by_problem():
    from tlt.model.evaluate import EvalReport, compare

    def report(greedy, sampled, samples):  # noqa: ANN001, ANN202
        return EvalReport(len(greedy), sum(greedy) / len(greedy), samples, 1.0, 1.0, 1.0,
                          sum(sampled) / (len(sampled) * samples), {}, 0.0, tuple(greedy), tuple(sampled))

    diff = compare(report([True, True, False], [2, 1, 0], 2), report([False, True, False], [1, 1, 1], 2))
    assert diff["greedy"].mean == 1 / 3 and diff["sampled"].mean == 0.0  # sampled: +0.5, 0, -0.5
    assert abs(diff["sampled"].se - 0.5 / 3**0.5) < 1e-12
    # each report's counts are shares of its own samples: 2 of 2 against 2 of 4 is +0.5, not 0
    diff = compare(report([True, False], [2, 0], 2), report([True, False], [2, 0], 4))
    assert diff["sampled"].mean == 0.25 and diff["greedy"].mean == 0.0


def test_eval_scores_over_every_problem_and_sample():
    """The report's figures by hand, the answers scripted: a generator (what NativeGenerator is to `evaluate`)
    answers with the reference solution where the script says so, else one digit off. Greedy accuracy is over all
    problems, sampled accuracy over problems x samples (it was over problems alone: 2x with two samples, and the
    only check was `none <= sampled_accuracy`), each step bucket's accuracy over that bucket's problems, and the
    length percentiles and tail ratio over the sampled answers (every length was 10, so a p90 or a ratio over the
    longest passed)."""
    problems = eval_problems(40)
    greedy_ok = {i for i in range(len(problems)) if i % 3 == 0}
    sampled_ok = {(i, s) for i in range(len(problems)) for s in range(2) if (i + s) % 4 == 0}

    def answer(p, ok):  # noqa: ANN001, ANN202
        return p.solution if ok else p.solution[: -1] + str((int(p.answer) + 1) % 10)

    def scripted(prompts, *, max_new_tokens, do_sample, samples=1, seed=0, bar=None):  # noqa: ANN001, ANN202
        assert prompts == [format_prompt(p) for p in problems]
        if do_sample:
            return [[(answer(p, (i, s) in sampled_ok), 1 + 2 * i + s) for s in range(samples)]
                    for i, p in enumerate(problems)]
        return [[(answer(p, i in greedy_ok), 1000)] for i, p in enumerate(problems)]

    report = evaluate(None, None, problems, samples=2, native=scripted)
    assert report.accuracy == len(greedy_ok) / 40 and report.sampled_accuracy == len(sampled_ok) / 80
    assert report.greedy_correct == tuple(i in greedy_ok for i in range(40))
    assert report.sampled_correct == tuple(sum((i, s) in sampled_ok for s in range(2)) for i in range(40))
    by_bucket = {}
    for i, p in enumerate(problems):
        by_bucket.setdefault(_bucket(p.steps), []).append(i in greedy_ok)
    assert len(by_bucket) >= 4
    assert report.accuracy_by_steps == {k: sum(v) / len(v) for k, v in by_bucket.items()}
    assert report.sampled_slips["none"] == report.sampled_accuracy  # each wrong answer is an answer slip
    # the length tail is over the sampled answers alone (lengths 1 .. 80; the greedy ones, 1000, are not in it)
    assert (report.p50_len, report.p99_len) == pytest.approx((40.5, 1 + 0.99 * 79))
    assert report.tail_ratio == pytest.approx((1 + 0.99 * 79) / 40.5)


def test_the_held_out_eval_is_not_what_the_build_trains_on():
    """The build's eval draws with another seed than its training stream (EVAL_SEED_OFFSET): an eval drawn from a
    training chunk's seed scores the model on problems it was trained on, and nothing failed (the only check
    compared the eval with seed 0's draw, not with the training stream). Problems of 8 or more steps are all but
    unique, so none of the eval's may be among the first training rows of the same seed."""
    tok = test_tokenizer()
    for seed in (0, 5):
        batches = packed_batches(tok, seq_len=320, batch_size=64, seed=seed)
        trained = "".join(tok.decode(row) for _ in range(2) for row in next(batches)["input_ids"].tolist())
        assert trained.count("<|im_start|>user") > 500  # the first 512-problem chunk and more
        long = [p for p in eval_problems(400, seed) if p.steps >= 8]
        assert len(long) > 20
        assert not [p.prompt for p in long if f"{p.prompt}<|im_end|>" in trained]


def test_a_row_a_problem_fills_exactly_takes_it():
    """A problem exactly as long as a row is packed into it (positions 0..seq_len-1), not refused as too long."""
    tok = test_tokenizer()
    from tlt.model.build import TRAIN_SEED_OFFSET

    p = generate_problems(1, seed=TRAIN_SEED_OFFSET)[0]
    n = len(tok(format_prompt(p))["input_ids"]) + len(tok(p.solution)["input_ids"]) + 1
    batch = next(packed_batches(tok, seq_len=n, batch_size=1, seed=0))
    assert batch["position_ids"][0].tolist() == list(range(n))
    assert tok.decode(batch["input_ids"][0].tolist()) == format_prompt(p) + p.solution + "<|im_end|>"


def test_native_samples_of_two_problems_are_drawn_independently(random_model_dir):
    """Sample s of problem i is keyed by (seed, s, i): the same prompt twice in one eval draws other samples,
    so two problems never share their random numbers (they did when the key left out the problem)."""
    from tlt.model.evaluate import NativeGenerator

    prompt = format_prompt(eval_problems(1)[0])
    first, second = NativeGenerator(random_model_dir, threads=1)([prompt, prompt], max_new_tokens=24, do_sample=True,
                                                                samples=2, seed=5)
    assert first != second


def test_transformers_eval_draws_each_sample_with_its_own_seed(random_model_dir, monkeypatch):
    """`--engine transformers` runs one generate pass per sample: pass s is seeded seed + s, so two samples of a
    problem are two draws (one seed for every pass made them the same completion twice)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import tlt.model.evaluate as ev

    passes = []
    real = ev.generate

    def recorded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = real(*args, **kwargs)
        passes.append((kwargs["do_sample"], kwargs.get("seed", 0), out[0]))
        return out

    monkeypatch.setattr(ev, "generate", recorded)
    tok = AutoTokenizer.from_pretrained(random_model_dir)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    evaluate(model, tok, eval_problems(3), samples=2, seed=4, batch_size=3)
    assert [(s, seed) for s, seed, _ in passes] == [(False, 0), (True, 4), (True, 5)]
    assert passes[1][2] != passes[2][2]


def test_model_eval_scores_the_seeds_draw_and_checks_against_first(random_model_dir, tmp_path, monkeypatch, capfd):
    """`tlt model eval --seed 7` scores eval_problems(n, 7) with sampling seed 7 (either one left at 0 passed every
    test); `--against` a folder that is no checkpoint is refused before the first model is scored (minutes), not
    after it."""
    import tlt.model.evaluate as ev
    from tlt.cli import main

    calls = []
    real = ev.evaluate

    def recorded(model, tokenizer, problems, **kwargs):  # noqa: ANN001, ANN003, ANN202
        calls.append((problems, kwargs["seed"]))
        return real(model, tokenizer, problems, **kwargs)

    monkeypatch.setattr(ev, "evaluate", recorded)
    base = ["model", "eval", "--model", str(random_model_dir), "--n", "2", "--threads", "1", "--json"]
    assert main(base + ["--seed", "7"]) == 0
    assert calls == [(eval_problems(2, 7), 7)]
    capfd.readouterr()
    assert main(base + ["--against", str(tmp_path / "nope")]) == 2
    assert calls == [(eval_problems(2, 7), 7)] and str(tmp_path / "nope") in capfd.readouterr().err


def test_model_build_facts_say_what_was_done(tmp_path, monkeypatch, capsys):
    """`tlt model build` stopped by its time budget reports the steps it ran (0 here), not the planned ones;
    --threads is what it trained on and --eval-n / --seed what it evaluated (eval_problems(n, seed); --eval-n read
    as the default 200 passed every test); a rebuild replaces the older model folder and leaves nothing beside it."""
    import tlt.model.evaluate as ev
    from tlt.cli import main

    seen = []
    real = ev.evaluate

    def recorded(model, tokenizer, problems, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append(problems)
        return real(model, tokenizer, problems, **kwargs)

    monkeypatch.setattr(ev, "evaluate", recorded)
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an older model
    (out / "old.txt").write_text("x")
    threads = torch.get_num_threads()
    capsys.readouterr()
    try:
        assert main(["model", "build", "--out", str(out), "--seed", "3", "--max-steps", "3", "--time-budget", "1e-9",
                     "--eval-n", "2", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    facts = json.loads(capsys.readouterr().out)
    assert facts == json.loads((out / ".complete").read_text()) and facts["seed"] == 3
    assert facts["steps"] == 0 and facts["planned_steps"] == 3 and facts["stopped_by_time"] is True
    assert facts["final_loss"] is None and facts["train_threads"] == 1 and facts["eval_n"] == 2
    assert seen == [eval_problems(2, 3)]
    assert [p.name for p in tmp_path.iterdir()] == ["m"] and not (out / "old.txt").exists()


def test_a_completion_that_stops_counts_its_eos_in_both_engines(random_model_dir, tmp_path):
    """Response length counts the eos a completion stops at (the module docstring; the native engine does), but a
    random model never stops within the tests' budgets, so a transformers `generate` that left the eos out of the
    length passed the comparison of the two engines. Here the checkpoint's eos row of lm_head is twice that of the
    first prompt's greedy first token: that prompt's answer is its eos alone, length 1 in both engines."""
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tlt.model.evaluate import NativeGenerator, generate

    folder = tmp_path / "stops"
    shutil.copytree(random_model_dir, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompts = [format_prompt(p) for p in eval_problems(3)]
    with torch.no_grad():
        first = int(model(**tok(prompts[:1], return_tensors="pt")).logits[0, -1].argmax())
        assert first != tok.eos_token_id
        model.lm_head.weight[tok.eos_token_id] = 2 * model.lm_head.weight[first]
    model.save_pretrained(folder)
    texts, lengths = generate(model, tok, prompts, max_new_tokens=12, do_sample=False, batch_size=3)
    assert (texts[0], lengths[0]) == ("", 1)
    answers = NativeGenerator(folder, threads=1)(prompts, max_new_tokens=12, do_sample=False)
    assert [a[0] for a in answers] == list(zip(texts, lengths))


def test_the_time_budget_counts_training_only(tmp_path, monkeypatch):
    """--time-budget guards the training loop (its help: "the training wall-clock guard"); the tokenizer before it,
    slow here by 2 s, is not charged to it: counted from the build's start, a 1.5 s budget stopped before step 0."""
    import time

    import tlt.model.tokenizer as tokenizer

    real = tokenizer.build_tokenizer

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(2.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "build_tokenizer", slow)
    facts = build_model("tiny", tmp_path / "m", seed=0, max_steps=1, time_budget_s=1.5, eval_n=0)
    assert facts["steps"] == 1 and facts["stopped_by_time"] is False


def test_norm_weights_are_not_weight_decayed(tmp_path):
    """The build decays only the matrices (weight_decay 0.1), not the RMSNorm weights or the embeddings. After one
    AdamW step at warm-up's first lr (1e-3 / 40) a norm weight, 1 at init, moves by at most that lr (Adam's first
    step is lr * g / (|g| + eps)); decayed, one moving down would move by 10% more (1 - lr * 0.1 first)."""
    from safetensors.torch import load_file

    build_model("tiny", tmp_path / "m", seed=0, max_steps=1, eval_n=0)
    lr0 = lr_at(0, lr=1e-3, warmup=40, total=1, min_ratio=0.1)
    norms = {k: v for k, v in load_file(str(tmp_path / "m" / "model.safetensors")).items() if "norm" in k}
    assert len(norms) == 2 * 12 + 1
    moved = max(float((w - 1).abs().max()) for w in norms.values())
    assert 0.5 * lr0 < moved <= lr0 * 1.02, (moved, lr0)


def test_model_eval_against_prints_model_minus_against_and_each_interval(random_model_dir, tmp_path, monkeypatch,
                                                                         capfd):
    """`tlt model eval --against` without --json: each model's sampled accuracy is its sampled one (not the greedy),
    and the paired difference is --model minus --against with its interval's two ends. Only --json was checked, and
    against a copy of the model, where every difference is 0 whatever its sign. Hand reports of 3 problems: greedy
    T, T, F against F, T, F (+0.333, s.e. 0.333); sampled 2, 2, 1 of 2 against 1, 1, 1 (+.5, +.5, 0: +0.333,
    s.e. 0.167; 95% +0.007 .. +0.660)."""
    import shutil

    import tlt.model.evaluate as ev
    from tlt.cli import main

    def report(greedy, sampled):  # noqa: ANN001, ANN202
        return ev.EvalReport(3, sum(greedy) / 3, 2, 10.0, 20.0, 2.0, sum(sampled) / 6, {"1": 0.5}, 1.0,
                             tuple(greedy), tuple(sampled))

    copy = tmp_path / "start"
    shutil.copytree(random_model_dir, copy)
    reports = {str(random_model_dir): report((True, True, False), (2, 2, 1)),
               str(copy): report((False, True, False), (1, 1, 1))}
    monkeypatch.setattr(ev, "_score", lambda path, args: reports[path])
    capfd.readouterr()
    assert main(["model", "eval", "--model", str(random_model_dir), "--against", str(copy), "--n", "3"]) == 0
    out = capfd.readouterr().out
    assert out.count("greedy accuracy     66.7%") == 1 and out.count("greedy accuracy     33.3%") == 1, out
    assert "sampled accuracy    83.3%  (T=1.0, 2 per problem)" in out and "sampled accuracy    50.0%" in out, out
    assert "  greedy   +0.333  (s.e. 0.333; 95% -0.320 .. +0.987)" in out, out
    assert "  sampled  +0.333  (s.e. 0.167; 95% +0.007 .. +0.660)" in out, out
    assert main(["model", "eval", "--model", str(random_model_dir), "--against", str(copy), "--n", "3", "--json"]) == 0
    diff = json.loads(capfd.readouterr().out)["difference"]
    assert diff["greedy"]["mean"] == pytest.approx(1 / 3) and diff["sampled"]["mean"] == pytest.approx(1 / 3)
