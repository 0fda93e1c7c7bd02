"""Prompt loading (JSONL, Parquet error path, synthetic default) and seeded, resumable sampling.

Nothing is faked. Parquet is exercised for real only when pyarrow is installed (it is in the dev extra); chat-message
prompts, answer_field and the Parquet cases of verl's files: tests/test_trainer_data_chat.py.
"""

from __future__ import annotations

import json
import re

import pytest

from tlt.services.trainer.data import DataError, PromptSampler, load_prompts, synthetic_prompts


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_loads_prompt_and_answer(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2", "extra": 5}, {"prompt": "2*3=", "answer": 6}])
    items = load_prompts(p)
    assert [(i.index, i.prompt, i.answer) for i in items] == [(0, "1+1=", "2"), (1, "2*3=", "6")]


def test_jsonl_keeps_the_other_columns_for_reward_functions(tmp_path):
    # TRL passes a data set's other columns to reward functions; only prompt and answer were kept
    rows = [{"prompt": "1+1=", "answer": "2", "solution": "1+1 is 2", "meta": {"level": 1, "tags": ["add"]}},
            {"prompt": "2*3=", "answer": 6, "difficulty": None, "weights": [0.5, 1]}]
    items = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows))
    assert items[0].extra == {"solution": "1+1 is 2", "meta": {"level": 1, "tags": ["add"]}}
    assert items[1].extra == {"difficulty": None, "weights": [0.5, 1]}
    assert items[1].answer == "6"  # the answer stays the text it was, not among the extra columns
    pretty = tmp_path / "d.json"  # one JSON array: the same
    pretty.write_text(json.dumps(rows, indent=2))
    assert load_prompts(pretty) == items


@pytest.mark.parametrize("name", ["prompts", "completions", "answers"])
def test_a_column_named_like_a_reward_keyword_is_refused(tmp_path, name):
    # a reward function gets prompts=, completions= and answers= (the 'answer' values) itself: a column of that
    # name could not be passed beside them
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2", name: "x"}])
    with pytest.raises(DataError, match=re.escape(f"d.jsonl:2: column {name!r} clashes with the reward function "
                                                  "keyword")):
        load_prompts(p)


def test_an_answer_column_beside_another_answer_field_is_refused(tmp_path):
    # answer_field names the reference's column; the trainer passes that as answer=, so a column called 'answer'
    # (GSM8K's worked solutions) would reach a reward function replaced by the reference, silently
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2*21?", "solution": "42", "answer": "#### 42 because ..."}])
    with pytest.raises(DataError, match=re.escape("d.jsonl:1: column 'answer' clashes with the reward function "
                                                  "keyword answer=")):
        load_prompts(p, answer_field="solution")
    assert load_prompts(p)[0].extra == {"solution": "42"}  # as the answer field itself, it is the reference
    # a dotted answer_field inside the 'answer' column: that column holds the reference, as before
    nested = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "1+1=", "answer": {"value": "2", "note": "n"}}])
    assert [(i.answer, i.extra) for i in load_prompts(nested, answer_field="answer.value")] == [
        ("2", {"answer": {"value": "2", "note": "n"}})]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a", "answer": "1"}\n{"prompt": "b"\n', "d.jsonl:2: not valid JSON"),
        ('{"prompt": "a"}\n', "missing field(s) ['answer']"),
        ('[1, 2]\n', "expected an object"),
        ('{"prompt": "", "answer": "1"}\n', "'prompt' must be a non-empty string"),
        ('{"prompt": " \\n\\t ", "answer": "1"}\n', "d.jsonl:1: 'prompt' must be a non-empty string"),  # blank
        ('{"prompt": "a", "answer": ""}\n', "d.jsonl:1: 'answer' is empty"),  # a row without its answer
        ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "  "}\n', "d.jsonl:2: 'answer' is empty"),
        ('{"prompt": "a", "answer": NaN}\n', "'answer' is empty (nan)"),  # json.loads takes NaN
        ("\n\n", "no prompts"),
        # valid JSON that json.loads cannot read: a traceback, not a refusal
        ('{"prompt": "a", "answer": "1"}\n{"prompt": "a", "answer": "1", "x": ' + "[" * 5000 + "]" * 5000 + "}\n",
         "d.jsonl:2: JSON nested too deeply to read"),
        ('{"prompt": "a", "answer": ' + "7" * 5000 + "}\n", "d.jsonl:1: not readable as JSON (Exceeds the limit"),
        ("[" * 5000 + "]" * 5000, "d.jsonl: JSON nested too deeply to read"),
    ],
)
def test_bad_jsonl_says_what_and_where(tmp_path, content, message):
    p = tmp_path / "d.jsonl"
    p.write_text(content)
    with pytest.raises(DataError, match=re.escape(message)):
        load_prompts(p)


def test_jsonl_that_is_not_utf8_names_the_line(tmp_path):
    # a Latin-1 export: the decode error used to escape as a bare UnicodeDecodeError naming neither file nor line
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DataError, match=re.escape(f"{p}:2: not UTF-8 text")):
        load_prompts(p)


@pytest.mark.parametrize("row", [
    '{"prompt": "what is 2+2? \\ud83d", "answer": "4"}',  # half an emoji, as scraped data has it
    '{"prompt": [{"role": "user", "content": "hi \\udc00"}], "answer": "4"}',
    '{"prompt": "2+2?", "answer": "4\\ud83d"}',
])
def test_a_lone_surrogate_is_refused_naming_the_line(tmp_path, row):
    # json.loads accepts "\ud83d"; the rollout request could not be encoded and its reader thread died, which left
    # the trainer waiting forever at the first rollout
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "answer": "1"}\n' + row + "\n")
    with pytest.raises(DataError, match=re.escape(f"{p}:2: the prompt or answer holds text that is not valid Unicode")):
        load_prompts(p)


@pytest.mark.parametrize(("row", "column"), [
    ('{"prompt": "2+2?", "answer": "4", "source": "forum \\ud83d"}', "source"),
    ('{"prompt": "2+2?", "answer": "4", "tags": ["ok", {"note": "cut \\udc00"}]}', "tags"),
    ('{"prompt": "2+2?", "answer": "4", "meta": {"\\ud83d": 1}}', "meta"),  # keys too, at any depth
    ('{"prompt": "2+2?", "answer": "4", "\\ud83d": 1}', "\\ud83d"),
])
def test_a_lone_surrogate_in_another_column_is_refused_naming_the_line_and_column(tmp_path, row, column):
    # only the prompt, answer and messages were checked: the row loaded, and with reward = "grpc" the step failed
    # after its whole rollout with a raw UnicodeEncodeError (metadata is sent as UTF-8 text)
    p = tmp_path / "d.jsonl"
    whole = '{"prompt": "a", "answer": "1", "source": "ok \U0001f600"}\n'  # a whole emoji is fine
    p.write_text(whole + row + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(f"{p}:2: column '{column}' holds text that is not valid Unicode")):
        load_prompts(p)


def test_jsonl_with_a_utf8_bom_loads(tmp_path):
    # Windows editors save "UTF-8 with BOM": json.loads refused the first line ("Unexpected UTF-8 BOM")
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": "1"}\r\n{"prompt": "b", "answer": "2"}\r\n')
    assert [(i.prompt, i.answer) for i in load_prompts(p)] == [("a", "1"), ("b", "2")]


def test_integral_float_answers_are_integers(tmp_path):
    # pandas writes an int column with a missing value as float64, and some JSON writers emit 42.0: the answer
    # used to be "42.0", which the task verifier refused (int("42.0") raised: every step failed on its reward)
    from tlt.task import verify

    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": 42.0}, {"prompt": "b", "answer": -3.0},
                                           {"prompt": "c", "answer": 0.5}, {"prompt": "d", "answer": 7}])
    items = load_prompts(p)
    assert [i.answer for i in items] == ["42", "-3", "0.5", "7"]
    assert verify("answer: 42", items[0].answer) and verify("answer: -3", items[1].answer)


def test_json_file_holding_one_array_loads(tmp_path):
    # json.dump(rows, f, indent=2) or pandas to_json(orient="records"): a .json file is read as JSONL, and its first
    # line "[" was refused as "d.json:1: not valid JSON", although the file is valid JSON
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": 2}]
    pretty = tmp_path / "d.json"
    pretty.write_text(json.dumps(rows, indent=2))
    one_line = tmp_path / "e.json"
    one_line.write_text(json.dumps(rows))
    for p in (pretty, one_line):
        assert [(i.index, i.prompt, i.answer) for i in load_prompts(p)] == [(0, "a", "1"), (1, "b", "2")]
    bad = tmp_path / "f.json"
    bad.write_text('[\n  {"prompt": "a", "answer": "1"},\n  {"prompt": "b"}\n]\n')
    with pytest.raises(DataError, match=re.escape(f"{bad} item 1: missing field(s) ['answer']")):
        load_prompts(bad)


def test_missing_and_unknown_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match="use .jsonl or .parquet"):
        load_prompts(tmp_path / "d.csv")


def test_parquet(tmp_path):
    p = tmp_path / "d.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        p.write_bytes(b"PAR1")
        with pytest.raises(DataError, match="pip install pyarrow"):
            load_prompts(p)
        return
    pq.write_table(pa.table({"prompt": ["x", "y"], "answer": ["1", "2"], "solution": ["s1", "s2"]}), p)
    assert [(i.answer, i.extra) for i in load_prompts(p)] == [("1", {"solution": "s1"}), ("2", {"solution": "s2"})]

    # not Parquet at all (JSONL so named), cut short, empty: refused as the data's fault, not a pyarrow traceback
    good = p.read_bytes()
    for name, content in [("jsonl", b'{"prompt": "x", "answer": "1"}\n'), ("cut", good[: len(good) // 2]), ("empty", b"")]:
        bad = tmp_path / f"{name}.parquet"
        bad.write_bytes(content)
        with pytest.raises(DataError, match=re.escape(f"{bad}: not a readable Parquet file")):
            load_prompts(bad)


def test_a_parquet_float32_answer_is_its_shortest_decimal(tmp_path):
    """to_pylist widened float32 0.1 to 0.10000000149011612: the reference answer no right completion matches."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    table = pa.table({"prompt": ["x", "y", "z"], "answer": pa.array([0.1, 3.3, 42.0], pa.float32()),
                      "weight": pa.array([0.1, None, 2.5], pa.float16())})
    pq.write_table(table, p)
    items = load_prompts(p)
    assert [i.answer for i in items] == ["0.1", "3.3", "42"]
    assert [i.extra["weight"] for i in items] == [0.1, None, 2.5]  # other columns: numbers still, shortest too


def test_synthetic_default_is_the_task():
    from tlt.task import verify

    items = synthetic_prompts(5, seed=0)
    assert len(items) == 5 and items[0].prompt.startswith("<|im_start|>user\n")
    assert all(verify(f"answer: {i.answer}", i.answer) for i in items)
    assert synthetic_prompts(5, seed=0) == items


def test_sampler_epochs_cover_everything_and_resume_exactly():
    items = synthetic_prompts(7, seed=1)
    s = PromptSampler(items, seed=3)
    first = [i.index for i in s.next_batch(3)] + [i.index for i in s.next_batch(3)]
    state = s.state_dict()
    rest = [[i.index for i in s.next_batch(3)] for _ in range(4)]
    # epoch 0 = first 7 indices handed out: a permutation of 0..6
    flat = first + sum(rest, [])
    assert sorted(flat[:7]) == list(range(7)) and sorted(flat[7:14]) == list(range(7))
    assert flat[:7] != flat[7:14]  # a new permutation per epoch
    # resuming from the saved position continues with exactly the same prompts
    s2 = PromptSampler(items, seed=3)
    s2.load_state_dict(state)
    assert [[i.index for i in s2.next_batch(3)] for _ in range(4)] == rest
    # same seed, same order; different seed, different order
    assert [i.index for i in PromptSampler(items, seed=3).next_batch(6)] == first
    assert [i.index for i in PromptSampler(items, seed=4).next_batch(7)] != flat[:7]
    # saved inside epoch 1 (9 of 7 drawn): the resume continues epoch 1's order, not epoch 0's
    s = PromptSampler(items, seed=3)
    s.next_batch(9)
    state = s.state_dict()
    assert (state["epoch"], state["position"]) == (1, 2)
    rest = [i.index for i in s.next_batch(5)]
    assert rest == flat[9:14] and flat[7:14] != flat[:7]
    s2 = PromptSampler(items, seed=3)
    s2.load_state_dict(state)
    assert [i.index for i in s2.next_batch(5)] == rest


def test_sampler_refuses_state_of_other_data():
    s = PromptSampler(synthetic_prompts(4, seed=0), seed=0)
    with pytest.raises(DataError, match="same data and seed"):
        PromptSampler(synthetic_prompts(5, seed=0), seed=0).load_state_dict(s.state_dict())
    # the same prompts under another seed: another permutation, so the saved position points elsewhere
    items = synthetic_prompts(7, seed=1)
    s = PromptSampler(items, seed=3)
    s.next_batch(3)
    with pytest.raises(DataError, match="for seed 3 and 7 prompts, now seed 4 and 7 prompts"):
        PromptSampler(items, seed=4).load_state_dict(s.state_dict())


def test_sampler_refuses_state_of_edited_data_of_the_same_size(tmp_path):
    # A data file edited to the same number of prompts resumed silently: the saved position then pointed into
    # other prompts (another order and content). The state carries a fingerprint of the content.
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    p = write_jsonl(tmp_path / "d.jsonl", rows)
    s = PromptSampler(load_prompts(p), seed=0)
    s.next_batch(4)
    state = s.state_dict()
    edits = {"prompt": dict(rows[2], prompt="2+2="), "answer": dict(rows[2], answer="4"),
             "order": None, "extra column": dict(rows[2], solution="3")}
    for what, row in edits.items():
        changed = rows[:2] + [row] + rows[3:] if row is not None else rows[1:] + rows[:1]
        write_jsonl(p, changed)
        edited = PromptSampler(load_prompts(p), seed=0)
        with pytest.raises(DataError, match=r"6 prompts of other content .*resume with the same data and seed"):
            edited.load_state_dict(state)
    write_jsonl(p, rows)  # the same content again (another file object, same text): resumes where it was
    same = PromptSampler(load_prompts(p), seed=0)
    same.load_state_dict(state)
    assert same.next_batch(2) == s.next_batch(2)


def test_sampler_resumes_a_state_saved_without_a_fingerprint():
    # checkpoints written before the fingerprint was kept hold only epoch, position, seed and size
    items = synthetic_prompts(5, seed=0)
    s = PromptSampler(items, seed=2)
    s.next_batch(3)
    old = {k: v for k, v in s.state_dict().items() if k != "fingerprint"}
    assert set(old) == {"epoch", "position", "seed", "size"}
    resumed = PromptSampler(items, seed=2)
    resumed.load_state_dict(old)
    assert resumed.next_batch(4) == s.next_batch(4)


def test_tlt_train_with_a_bad_data_file_ends_with_one_line_naming_it(tmp_path):
    """`tlt train` on a data file with a bad line ended in a traceback (the message last); it now logs the file and
    line and exits 2, before it connects to anything (the rollout address here is closed). Real CLI process."""
    import subprocess
    import sys

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=" "answer": 4}\n')
    r = subprocess.run([sys.executable, "-m", "tlt.cli", "train", "--config", "cpu-tiny", "--set", f"data_path={bad}",
                        "--set", "eval_problems=0", "--set", 'rollout_addresses=["127.0.0.1:1"]',
                        "--set", f"output_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "train_refused" in out and f"{bad}:2: not valid JSON" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]


def test_any_integer_seeds_the_data_order():
    """A seed past torch's range (a nanosecond clock's) failed the trainer's first step ("Overflow when unpacking
    long long"); every seed torch took draws the order it drew (torch keeps seeds modulo 2**64)."""
    import torch

    from tlt.services.common.seeds import torch_seed

    items = synthetic_prompts(40, seed=0)
    for seed in (0, 7, -1, 2**40):  # derived seeds in torch's range: the orders they always had
        derived = seed * 1_000_003
        assert -(2**63) <= derived < 2**64
        expected = torch.randperm(40, generator=torch.Generator().manual_seed(derived)).tolist()
        assert [i.index for i in PromptSampler(items, seed=seed).next_batch(40)] == [items[k].index for k in expected]
    big = [i.index for i in PromptSampler(items, seed=20_000_000_000_000).next_batch(40)]
    assert sorted(big) == sorted(i.index for i in items)
    assert torch_seed(2**64 + 5) == 5 and torch_seed(-1) == 2**64 - 1
    from tlt.services.trainer.policy import seed_everything

    seed_everything(2**70)  # the trainer's torch / numpy / random seeding takes it too
