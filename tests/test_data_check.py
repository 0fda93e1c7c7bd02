"""`tlt data check`: a prompt file read as the trainer reads it, measured against the rollout's context.

Run in this process through `tlt.cli.main`, on real files written here (JSONL, Parquet via pyarrow) and a real tiny
checkpoint (tests/rollout_helpers.py: the task tokenizer, one token per digit, no BOS, a ChatML template, and a
config.json with max_position_embeddings = 256). Nothing is faked.

The figures are checked against values worked out by hand: a prompt of k digits is k tokens with this tokenizer (each
digit is its own token), so a file of such prompts has known lengths, percentiles and fits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tlt.cli import main

MAX_MODEL_LEN = 64
MAX_TOKENS = 16  # so a prompt fits the rollout's context with up to 64 - 16 = 48 tokens


pytestmark = pytest.mark.usefixtures("no_tlt_environment")  # the caller's TLT_* variables: conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout_helpers import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory.mktemp("policy"))


@pytest.fixture(scope="module")
def tok(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture
def preset(tmp_path: Path, model_dir: Path) -> Path:
    """A preset as a user writes one: the policy, max_tokens, and the rollout engine's context."""
    p = tmp_path / "my.toml"
    p.write_text(f'[trainer]\nmodel_dir = "{model_dir}"\nmax_tokens = {MAX_TOKENS}\neval_problems = 0\n\n'
                 f"[rollout.engine]\nmax_model_len = {MAX_MODEL_LEN}\n")
    return p


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def digits(k: int) -> str:
    return "7" * k


def check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    """`tlt data check ... --json`: (exit status, the parsed report)."""
    rc = main(["data", "check", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


# -- the figures ---------------------------------------------------------------------------------------------------


def test_prompt_lengths_are_counted_with_the_policy_tokenizer(tmp_path, preset, tok, capsys) -> None:
    lengths = [13, 3, 40, 8, 5]
    assert [len(tok.encode(digits(k))) for k in lengths] == lengths  # one token per digit, nothing added
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": digits(k), "answer": i} for i, k in enumerate(lengths)])
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset))
    assert rc == 0 and r["status"] == "ok" and r["warnings"] == []
    assert r["rows"] == 5 and r["prompt_kind"] == "text" and r["answer_field"] == "answer"
    # sorted 3 5 8 13 40; nearest rank: p50 = the 3rd of 5, p99 = the 5th
    assert r["prompt_tokens"] == {"min": 3, "p50": 8, "p99": 40, "max": 40}
    assert r["answers"] == ["0", "1", "2"] and r["distinct_answers"] == 5
    assert r["max_model_len"] == MAX_MODEL_LEN and r["max_tokens"] == MAX_TOKENS
    assert r["too_long"] == {"count": 0, "rows": []}


def test_prompts_leaving_no_room_for_max_tokens_are_named(tmp_path, preset, capsys) -> None:
    """64 - 16 = 48: a 48-token prompt fits exactly; 49 and 70 tokens would be refused by the rollout server."""
    lengths = [10, 49, 48, 20, 70, 1]
    rows = [{"prompt": digits(k), "answer": 1} for k in lengths]
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(rows[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows[1:]))  # a blank line 2
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset))
    assert rc == 1 and r["status"] == "warn"
    assert r["too_long"] == {"count": 2, "rows": [f"{data}:3", f"{data}:6"]}  # the file's own line numbers
    assert len(r["warnings"]) == 1 and "2 prompts" in r["warnings"][0]
    rc = main(["data", "check", "--data", str(data), "--preset", str(preset)])
    out = capsys.readouterr().out
    assert rc == 1 and f"{data}:3" in out and f"{data}:6" in out and "max_model_len 64" in out


def test_the_named_rows_say_when_more_were_left_out(tmp_path, preset, capsys) -> None:
    """The warning names the first 5 rows too long, and ', ...' only when there are more: with exactly 5 it read as
    if some were left out (a user looked for a sixth)."""
    for count in (5, 6):
        data = write_jsonl(tmp_path / f"d{count}.jsonl", [{"prompt": digits(49), "answer": 1}] * count)
        rc, r = check(capsys, "--data", str(data), "--preset", str(preset))
        assert rc == 1 and r["too_long"]["count"] == count and len(r["too_long"]["rows"]) == 5
        named = ", ".join(f"{data}:{i}" for i in range(1, 6))
        assert r["warnings"][0].endswith(f"({named})" if count == 5 else f"({named}, ...)"), r["warnings"][0]


def test_the_resolved_config_decides_the_room(tmp_path, preset, capsys, monkeypatch) -> None:
    """The environment and --set change max_tokens and max_model_len as they do for the services."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": digits(k), "answer": 1} for k in (30, 40)])
    assert check(capsys, "--data", str(data), "--preset", str(preset))[1]["too_long"]["count"] == 0
    monkeypatch.setenv("TLT_TRAINER__MAX_TOKENS", "30")  # 64 - 30 = 34: the 40-token prompt no longer fits
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset))
    assert rc == 1 and r["max_tokens"] == 30 and r["too_long"] == {"count": 1, "rows": [f"{data}:2"]}
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset), "--set", "trainer.max_tokens=34",
                  "--set", "rollout.engine.max_model_len=63")  # 63 - 34 = 29: neither fits
    assert rc == 1 and r["max_tokens"] == 34 and r["max_model_len"] == 63 and r["too_long"]["count"] == 2
    # max_model_len = 0: the model's max_position_embeddings (256), as the native engine takes it
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset), "--set", "rollout.engine.max_model_len=0")
    assert rc == 0 and r["max_model_len"] == 256
    # past the model's own context: the engine refuses to start, and so does the check
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset), "--set", "rollout.engine.max_model_len=512")
    assert rc == 2 and "past the model's context 256" in r["error"]


def test_a_model_the_native_engine_cannot_read_is_refused_in_the_json_too(tmp_path, model_dir, preset, capsys) -> None:
    """The check reads config.json as the native engine does; its CheckpointError went out as a log line only, and
    `--json` printed nothing for a caller to parse."""
    import shutil

    other = tmp_path / "yarn"
    shutil.copytree(model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (other / "config.json").write_text(json.dumps(cfg))
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": digits(5), "answer": 1}])
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset), "--model", str(other))
    assert rc == 2 and r["status"] == "refused" and "yarn" in r["error"]


def test_the_sglang_backend_leaves_out_the_draft_slots_sglang_reserves(tmp_path, model_dir, capsys) -> None:
    """With an EAGLE drafter SGLang reserves max(topk x steps, draft tokens) slots of each request's context
    (sglang_backend/launch.py reserved_tokens; adaptive by default: the deepest candidate, 7 steps, + 1 = 8); the
    adapter refuses prompt + reserved + max_tokens past max_position_embeddings (256), and so must the check."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": digits(k), "answer": 1} for k in (232, 236)])
    p = tmp_path / "sglang.toml"
    p.write_text(f'[trainer]\nmodel_dir = "{model_dir}"\nmax_tokens = 16\neval_problems = 0\n\n'
                 '[rollout]\nbackend = "sglang"\n\n[sglang]\nspeculative_algorithm = "EAGLE"\nnum_steps = 3\n')
    rc, r = check(capsys, "--data", str(data), "--preset", str(p))
    assert rc == 1 and r["max_model_len"] == 248 and r["too_long"] == {"count": 1, "rows": [f"{data}:2"]}
    p.write_text(p.read_text().replace('"EAGLE"', '"none"'))
    rc, r = check(capsys, "--data", str(data), "--preset", str(p))
    assert rc == 0 and r["max_model_len"] == 256


def test_a_verl_parquet_file_with_a_dotted_answer_field(tmp_path, preset, tok, capsys) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(4)]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset), "--answer-field", "reward_model.ground_truth")
    assert rc == 0, r
    assert r["prompt_kind"] == "chat messages" and r["answer_field"] == "reward_model.ground_truth"
    assert r["answers"] == ["0", "2", "4"] and r["distinct_answers"] == 4
    assert r["columns"] == {"data_source": 4, "ability": 4, "reward_model": 4, "extra_info": 4}
    n = [len(tok.encode(tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)))
         for row in rows]
    assert r["prompt_tokens"]["min"] == min(n) and r["prompt_tokens"]["max"] == max(n)


def test_show_prints_chat_prompts_as_the_model_sees_them(tmp_path, preset, tok, capsys) -> None:
    chat = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 1+1?"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 1+1?"
                        "<|im_end|>\n<|im_start|>assistant\n")
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": chat, "answer": "2"},
                                              {"prompt": [{"role": "user", "content": "3*3="}], "answer": 9}])
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset), "--show", "1")
    assert rc == 0
    assert r["shown"] == [{"row": f"{data}:1", "prompt": rendered, "tokens": len(tok.encode(rendered)),
                           "answer": "2"}]
    assert main(["data", "check", "--data", str(data), "--preset", str(preset), "--show", "2"]) == 0
    out = capsys.readouterr().out
    assert rendered in out and "<|im_start|>user\n3*3=<|im_end|>\n<|im_start|>assistant\n" in out


def test_tokens_counted_with_special_tokens_as_the_rollout_server_encodes(tmp_path, model_dir, capsys) -> None:
    """The rollout server encodes prompt text with tokenizer.encode(text): special tokens added. A tokenizer that
    adds a BOS token makes each prompt one token longer, and the room check counts it."""
    import shutil

    from tokenizers import Tokenizer, processors

    bos_dir = tmp_path / "bos"
    bos_dir.mkdir()
    for f in ("tokenizer_config.json", "special_tokens_map.json", "config.json"):
        if (model_dir / f).exists():
            shutil.copy(model_dir / f, bos_dir / f)
    t = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = t.token_to_id("<|endoftext|>")
    t.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    t.save(str(bos_dir / "tokenizer.json"))
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": digits(k), "answer": 1} for k in (10, 48)])
    p = tmp_path / "p.toml"
    p.write_text(f'[trainer]\nmax_tokens = 16\n\n[rollout.engine]\nmax_model_len = 64\n')
    rc, r = check(capsys, "--data", str(data), "--preset", str(p), "--model", str(bos_dir))
    assert r["prompt_tokens"] == {"min": 11, "p50": 11, "p99": 49, "max": 49}
    assert rc == 1 and r["too_long"] == {"count": 1, "rows": [f"{data}:2"]} and r["model_dir"] == str(bos_dir)


def test_duplicates_are_counted_and_conflicting_answers_warned(tmp_path, preset, capsys) -> None:
    same = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": 4},
                                                 {"prompt": "1+1=", "answer": 2}, {"prompt": "1+1=", "answer": 2}])
    rc, r = check(capsys, "--data", str(same), "--preset", str(preset))
    assert rc == 0 and r["duplicates"] == {"count": 2, "conflicting": 0, "rows": []} and r["distinct_answers"] == 2
    clash = write_jsonl(tmp_path / "clash.jsonl", [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": 4},
                                                   {"prompt": "1+1=", "answer": 3}])
    rc, r = check(capsys, "--data", str(clash), "--preset", str(preset))
    assert rc == 1 and r["duplicates"] == {"count": 1, "conflicting": 1, "rows": [f"{clash}:3"]}


# -- refusals: what the trainer refuses, with its words ------------------------------------------------------------


@pytest.mark.parametrize("rows, extra", [
    ([{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2="}], []),                       # a row without its answer
    ([{"prompt": "1+1=", "reward_model": {"style": "rule"}}], ["--answer-field", "reward_model.ground_truth"]),
    ([{"prompt": "1+1=", "answer": 2}, {"prompt": [{"role": "user", "content": "x"}], "answer": 1}], []),  # mixed
])
def test_a_bad_file_is_refused_with_the_trainers_message(rows, extra, tmp_path, preset, capsys) -> None:
    from tlt.services.common.config import load_config
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.data import DataError, trainer_prompts

    data = write_jsonl(tmp_path / "d.jsonl", rows)
    over = {"data_path": str(data)} | ({"answer_field": extra[1]} if extra else {})
    with pytest.raises(DataError) as trainer_error:
        trainer_prompts(load_config(TrainerConfig, "trainer", preset, over))
    rc = main(["--log-json", "data", "check", "--data", str(data), "--preset", str(preset), *extra])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and captured.out == "" and len(lines) == 1
    assert json.loads(lines[0])["error"] == str(trainer_error.value)
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset), *extra)
    assert rc == 2 and r == {"status": "refused", "error": str(trainer_error.value)}


def test_set_gives_what_the_flags_give_when_they_are_not_used(tmp_path, model_dir, preset, capsys) -> None:
    """--set trainer.data_path / model_dir / answer_field, as the trainer takes them: the flags not given replaced
    them with None, so the check said "no data file to check", checked the preset's model, or passed a file whose
    rows lack the answer field the trainer would ask for."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "gold": 2}])
    rc, r = check(capsys, "--preset", str(preset), "--set", f"trainer.data_path={data}",
                  "--set", f"trainer.model_dir={model_dir}", "--set", "trainer.answer_field=gold")
    assert rc == 0 and r["status"] == "ok" and r["rows"] == 1 and r["answer_field"] == "gold"
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset), "--set", "trainer.answer_field=nosuchfield")
    assert rc == 2 and "nosuchfield" in r["error"]
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset), "--set", "trainer.answer_field=nosuchfield",
                  "--answer-field", "gold")  # the flag, given, goes last
    assert rc == 0 and r["answer_field"] == "gold"


def test_a_bad_config_or_missing_model_is_refused(tmp_path, preset, capsys) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": 2}])
    assert main(["data", "check", "--data", str(data), "--preset", str(preset), "--set", "trainer.max_tokens=0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert main(["data", "check", "--data", str(data), "--preset", str(preset), "--set", "reward.kind=x"]) == 2
    err = capsys.readouterr().err
    assert "reward.kind" in err and "trainer, rollout" in err
    assert main(["data", "check", "--data", str(data), "--preset", str(preset), "--set", "trainer=5"]) == 2
    err = capsys.readouterr().err  # a section with no field: said as such, not as an unknown field 'trainer'
    assert "override 'trainer': name a section, SECTION.FIELD=VALUE" in err
    missing = tmp_path / "no-such-model"
    assert main(["data", "check", "--data", str(data), "--preset", str(preset), "--model", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and len(err.strip().splitlines()) == 1
    assert main(["data", "check", "--data", str(tmp_path / "nope.jsonl"), "--preset", str(preset)]) == 2
    assert "does not exist" in capsys.readouterr().err
    # max_tokens at or above max_model_len: no prompt fits at all (it printed "-46 prompt tokens at most", exit 1)
    assert main(["data", "check", "--data", str(data), "--preset", str(preset), "--set", "trainer.max_tokens=64",
                 "--set", "rollout.engine.max_model_len=50"]) == 2
    err = capsys.readouterr().err
    assert "leaves no room for a prompt" in err and "-14" not in err


# -- the eval file: read as the trainer reads it (evaluate.py eval_items), when it evaluates ---------------------


def eval_preset(tmp_path: Path, model_dir: Path, eval_file: Path, problems: int, answer_field: str = "") -> Path:
    p = tmp_path / "eval.toml"
    field = f'eval_answer_field = "{answer_field}"\n' if answer_field else ""
    p.write_text(f'[trainer]\nmodel_dir = "{model_dir}"\nmax_tokens = {MAX_TOKENS}\neval_problems = {problems}\n'
                 f'eval_data_path = "{eval_file}"\n{field}\n[rollout.engine]\nmax_model_len = {MAX_MODEL_LEN}\n')
    return p


def test_the_eval_file_is_checked_too(tmp_path, model_dir, capsys) -> None:
    """`tlt data check` read [trainer] data_path only: an eval file with prompts the rollout refuses passed. Its
    first eval_problems rows are what the trainer evaluates: a too-long prompt among them warns (exit 1), one
    after them does not count. Its answer is read at eval_answer_field."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": digits(k), "answer": 1} for k in (5, 9)])
    lengths = [10, 49, 3, 48, 7, 70]  # 49 (row 2) is too long and evaluated; 70 (row 6) is past eval_problems
    ev = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": digits(k), "solution": i} for i, k in enumerate(lengths)])
    preset = eval_preset(tmp_path, model_dir, ev, 4, "solution")
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset))
    assert rc == 1 and r["status"] == "warn" and r["too_long"]["count"] == 0 and r["rows"] == 2
    assert r["eval"] == {"file": str(ev), "rows": 6, "evaluated": 4, "prompt_kind": "text",
                         "answer_field": "solution", "prompt_tokens": {"min": 3, "max": 49},
                         "too_long": {"count": 1, "rows": [f"{ev}:2"]}}
    assert len(r["warnings"]) == 1 and "1 prompt of the eval file" in r["warnings"][0] and f"{ev}:2" in r["warnings"][0]
    rc = main(["data", "check", "--data", str(data), "--preset", str(preset)])
    out = capsys.readouterr().out
    assert rc == 1 and f"{ev}: 6 rows, the first 4 evaluated" in out and f"eval too long  1: {ev}:2" in out
    # the three rows that fit: ok, and the eval line is there
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset), "--set", "trainer.eval_problems=1")
    assert rc == 0 and r["eval"]["evaluated"] == 1 and r["eval"]["too_long"]["count"] == 0
    # eval_problems = 0: the trainer reads no eval file, and neither does the check (a missing one passes)
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset), "--set", "trainer.eval_problems=0",
                  "--set", f"trainer.eval_data_path={tmp_path / 'nope.jsonl'}")
    assert rc == 0 and r["eval"] is None


@pytest.mark.parametrize("rows, problems, answer_field", [
    ([{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2="}], 2, ""),                  # a row without its answer
    ([{"prompt": "1+1=", "answer": 2}], 1, "solution"),                             # eval_answer_field not there
    ([{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": 4}], 3, ""),     # fewer rows than eval_problems
    (None, 1, ""),                                                                   # no such file
])
def test_a_bad_eval_file_is_refused_with_the_trainers_message(rows, problems, answer_field, tmp_path, model_dir,
                                                               capsys) -> None:
    """A bad eval file was refused only when `tlt train` started (eval_items); the check refuses it with the
    trainer's DataError, word for word, exit 2, while the data file itself is fine."""
    from tlt.services.common.config import load_config
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.data import DataError
    from tlt.services.trainer.evaluate import eval_items

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": 2}])
    ev = tmp_path / "eval.jsonl" if rows is None else write_jsonl(tmp_path / "eval.jsonl", rows)
    preset = eval_preset(tmp_path, model_dir, ev, problems, answer_field)
    with pytest.raises(DataError) as trainer_error:
        eval_items(load_config(TrainerConfig, "trainer", preset, {"data_path": str(data)}))
    rc = main(["--log-json", "data", "check", "--data", str(data), "--preset", str(preset)])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2 and captured.out == "" and len(lines) == 1
    assert json.loads(lines[0])["error"] == str(trainer_error.value)
    rc, r = check(capsys, "--data", str(data), "--preset", str(preset))
    assert rc == 2 and r == {"status": "refused", "error": str(trainer_error.value)}


def test_the_default_preset_asks_for_an_eval_file_or_no_eval(tmp_path, capsys) -> None:
    """README's `tlt data check --data FILE` with the default preset: cpu-tiny evaluates 200 problems, and with your
    own data the trainer needs held-out prompts of the same kind, so it is refused (exit 2) with a message that names
    both ways out; each way, as README gives it, then passes."""
    from rollout_helpers import tiny_checkpoint

    model_dir = tiny_checkpoint(tmp_path / "policy", max_position_embeddings=1024)  # cpu-tiny's max_model_len
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": 2}])
    rc, r = check(capsys, "--data", str(data), "--model", str(model_dir))
    assert rc == 2 and "needs eval_data_path" in r["error"] and "eval_problems=0" in r["error"], r
    rc, r = check(capsys, "--data", str(data), "--model", str(model_dir), "--set", "trainer.eval_problems=0")
    assert rc == 0 and r["eval"] is None, r
    ev = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(200)])
    rc, r = check(capsys, "--data", str(data), "--model", str(model_dir), "--set", f"trainer.eval_data_path={ev}")
    assert rc == 0 and r["eval"]["evaluated"] == 200, r


# -- the command ---------------------------------------------------------------------------------------------------


def test_help_describes_every_flag(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["data", "check", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for flag in ("--data", "--model", "--answer-field", "--preset", "--set", "--json", "--show"):
        assert flag in out
    from tlt.cli import build_parser

    (sub,) = [a for a in build_parser()._subparsers._group_actions[0].choices["data"]._subparsers._group_actions
              if hasattr(a, "choices")]
    actions = [a for a in sub.choices["check"]._actions if a.option_strings and a.dest not in ("help", "log_json")]
    assert {a.option_strings[0] for a in actions} == {"--data", "--model", "--answer-field", "--preset", "--set",
                                                       "--json", "--show"}
    assert all(a.help and len(a.help) > 15 for a in actions)


@pytest.mark.parametrize("argv, option", [(["--show", "-1"], "--show"), (["--data", ""], "--data"),
                                          (["--model", ""], "--model"), (["--answer-field", ""], "--answer-field")])
def test_bad_flags_are_usage_errors_naming_the_option(argv, option, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["data", "check", *argv])
    assert e.value.code == 2 and f"argument {option}" in capsys.readouterr().err


def test_a_long_file_shows_progress(tmp_path, preset, capsys) -> None:
    big = write_jsonl(tmp_path / "big.jsonl", [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(5001)])
    assert main(["data", "check", "--data", str(big), "--preset", str(preset)]) == 0
    captured = capsys.readouterr()
    assert "prompt tokens" in captured.err and "5001/5001" in captured.err and "5001" in captured.out
    small = write_jsonl(tmp_path / "small.jsonl", [{"prompt": "1+1=", "answer": 2}])
    assert main(["data", "check", "--data", str(small), "--preset", str(preset)]) == 0
    assert capsys.readouterr().err == ""
