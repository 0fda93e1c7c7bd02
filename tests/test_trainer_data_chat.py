"""Data sets as TRL and verl users have them: chat-message prompts, a nested answer field, real Parquet files.

- TRL "conversational" rows: `prompt` is a list of {role, content} messages, rendered once at load time with the
  policy's chat template (add_generation_prompt=True), as TRL's maybe_apply_chat_template does.
- verl rows: a chat-message `prompt`, the reference answer in `reward_model.ground_truth` (answer_field), and
  `data_source` / `ability` / `extra_info` columns kept for reward functions.
- Parquet files written with pyarrow here and read back through load_prompts.

Nothing is faked: the tokenizer is the project's real task tokenizer (built in a temporary folder, ChatML template),
the Parquet files are real; only the missing-pyarrow case hides the installed pyarrow from the import.
"""

from __future__ import annotations

import datetime
import json
import re
import sys

import pytest

from tlt.services.trainer.data import DataError, PromptSampler, load_prompts

CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 1+1?"}]
RENDERED = ("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
            "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A folder holding the real task tokenizer (its ChatML chat template inside tokenizer_config.json)."""
    from tlt.model.tokenizer import build_tokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return out


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def verl_row(i: int) -> dict:
    """A row as verl's data preprocessing scripts (examples/data_preprocess/gsm8k.py) write it."""
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i}}


# -- chat-message prompts (TRL conversational) ---------------------------------------------------------------------


def test_chat_prompt_is_rendered_with_the_model_chat_template(tmp_path, model_dir):
    from transformers import AutoTokenizer

    from tlt.task import format_chat

    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": CHAT, "answer": "2"},
                                           {"prompt": [{"role": "user", "content": "3*3="}], "answer": 9}])
    items = load_prompts(p, model_dir=model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert items[0].prompt == RENDERED == tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert items[1].prompt == format_chat("3*3=")  # one user turn: exactly the synthetic task's prompt text
    # the messages are kept for reward functions (TRL passes them as `prompts`); not among the extra columns
    assert items[0].messages == CHAT and items[0].extra == {} and items[1].answer == "9"


def test_text_prompts_keep_no_messages_and_need_no_tokenizer(tmp_path):
    items = load_prompts(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}]))
    assert items[0].prompt == "1+1=" and items[0].messages is None


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "d.jsonl:1: 'prompt' is an empty list; a chat prompt needs at least one message"),
        (["hi"], "d.jsonl:1: 'prompt' message 0 must be an object with 'role' and 'content', got str"),
        ([{"role": "user"}], "d.jsonl:1: 'prompt' message 0 lacks 'content'"),
        ([{"content": "hi"}], "d.jsonl:1: 'prompt' message 0 lacks 'role'"),
        ([{"role": "robot", "content": "hi"}], "d.jsonl:1: 'prompt' message 0 has role 'robot'; roles are"),
        ([{"role": "user", "content": 5}], "d.jsonl:1: 'prompt' message 0 'content' must be a string, got int"),
        ([{"role": "assistant", "content": "Sure:"}],
         "d.jsonl:1: 'prompt' ends with an assistant prefill but has no user message before it"),
        ([{"role": "user", "content": "hi"}, {"role": "system", "content": "be brief"}],
         "d.jsonl:1: 'prompt' ends with role 'system'; the last message must be the user's"),
        ({"role": "user", "content": "hi"}, "d.jsonl:1: 'prompt' must be a non-empty string or a list of chat"),
    ],
)
def test_bad_chat_prompts_say_what_and_where(tmp_path, model_dir, prompt, message):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "answer": "1"}])
    with pytest.raises(DataError, match=re.escape(message)):
        load_prompts(p, model_dir=model_dir)


PREFILL = [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "<think>"}]


def test_a_prompt_ending_with_an_assistant_message_is_a_prefill_the_model_continues(tmp_path, model_dir):
    """As TRL's maybe_apply_chat_template: the final assistant turn is left open (continue_final_message), with no
    generation prompt after it, so the model's completion continues the prefill's text."""
    from transformers import AutoTokenizer

    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": PREFILL, "answer": "2"}])
    items = load_prompts(p, model_dir=model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    want = tok.apply_chat_template(PREFILL, tokenize=False, continue_final_message=True)
    assert items[0].prompt == want  # independently: the ChatML text, the assistant turn open after the prefill
    assert want == "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n<think>"
    assert items[0].messages == PREFILL


def test_a_file_mixing_text_and_chat_prompts_is_refused(tmp_path, model_dir):
    # a reward function gets one kind of `prompts` / `completions` per batch (TRL decides it from the first row)
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": CHAT, "answer": "2"}, {"prompt": "2+2=", "answer": "4"}])
    with pytest.raises(DataError, match=re.escape("d.jsonl:2: 'prompt' is text, and the first row's is chat messages")):
        load_prompts(p, model_dir=model_dir)


def test_chat_prompts_without_a_tokenizer_or_its_template_are_refused(tmp_path, model_dir):
    import shutil

    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": CHAT, "answer": "2"}])
    with pytest.raises(DataError, match=re.escape("d.jsonl:1: 'prompt' is a list of chat messages; rendering it "
                                                  "needs the policy's tokenizer")):
        load_prompts(p)
    bare = tmp_path / "no-template"  # the same real tokenizer, its chat template removed
    shutil.copytree(model_dir, bare)
    conf = json.loads((bare / "tokenizer_config.json").read_text())
    del conf["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(conf))
    with pytest.raises(DataError, match=re.escape(f"the tokenizer in {bare} has no chat template")):
        load_prompts(p, model_dir=bare)
    # a template that refuses a role (as Gemma's refuses a system turn): the row and the template's own words
    conf["chat_template"] = "{{ raise_exception('System role not supported') }}"
    (bare / "tokenizer_config.json").write_text(json.dumps(conf))
    with pytest.raises(DataError, match=re.escape(f"d.jsonl:1: the chat template of {bare} refused the messages: "
                                                  "System role not supported")):
        load_prompts(p, model_dir=bare)


def test_a_template_that_writes_the_bos_token_gives_one_bos_at_the_rollout(tmp_path, model_dir):
    """Llama 3's and Gemma's templates write the BOS token into the text, and the rollout server encodes prompt text
    with the tokenizer's special tokens (BOS added again): the model saw two. TRL encodes the rendered text without
    special tokens; here the text is stored without the template's leading BOS, so the rollout's encode gives one.
    The tokenizer is the real task tokenizer made to add a BOS (<|endoftext|>) as Llama's does."""
    import shutil

    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer

    from tlt.model.tokenizer import CHAT_TEMPLATE, ENDOFTEXT

    bos_dir = tmp_path / "bos"
    shutil.copytree(model_dir, bos_dir)
    raw = Tokenizer.from_file(str(bos_dir / "tokenizer.json"))
    raw.post_processor = processors.TemplateProcessing(single=f"{ENDOFTEXT} $A", special_tokens=[
        (ENDOFTEXT, raw.token_to_id(ENDOFTEXT))])
    raw.save(str(bos_dir / "tokenizer.json"))
    conf = json.loads((bos_dir / "tokenizer_config.json").read_text())
    conf.update(bos_token=ENDOFTEXT, add_bos_token=True, chat_template="{{ bos_token }}" + CHAT_TEMPLATE)
    (bos_dir / "tokenizer_config.json").write_text(json.dumps(conf))
    tok = AutoTokenizer.from_pretrained(bos_dir)
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == ENDOFTEXT + RENDERED and tok.encode("x")[0] == tok.bos_token_id  # a BOS-adding tokenizer

    [item] = load_prompts(write_jsonl(tmp_path / "d.jsonl", [{"prompt": CHAT, "answer": "2"}]), model_dir=bos_dir)
    assert item.prompt == RENDERED
    assert tok.encode(item.prompt) == tok.encode(rendered, add_special_tokens=False)  # what the rollout encodes
    # the same template with a tokenizer that adds no BOS: the template's BOS is the only one, and stays
    raw.post_processor = None
    raw.save(str(bos_dir / "tokenizer.json"))
    assert AutoTokenizer.from_pretrained(bos_dir).encode("x")[0] != tok.bos_token_id
    [item] = load_prompts(tmp_path / "d.jsonl", model_dir=bos_dir)
    assert item.prompt == ENDOFTEXT + RENDERED


def test_fingerprint_covers_the_messages(tmp_path, model_dir):
    # two files whose rendered text is equal but whose messages differ would be other data for a reward function
    a = load_prompts(write_jsonl(tmp_path / "a.jsonl", [{"prompt": CHAT, "answer": "2"}]), model_dir=model_dir)
    assert PromptSampler(a, 0).fingerprint != PromptSampler([a[0].__class__(0, a[0].prompt, "2")], 0).fingerprint


# -- answer location (answer_field) --------------------------------------------------------------------------------


def test_verl_rows_with_a_nested_answer_field(tmp_path, model_dir):
    p = write_jsonl(tmp_path / "verl.jsonl", [verl_row(1), verl_row(2)])
    items = load_prompts(p, answer_field="reward_model.ground_truth", model_dir=model_dir)
    assert [i.answer for i in items] == ["2", "4"]
    assert items[0].prompt == "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
    # every other column reaches reward functions, reward_model included (its 'style', verl's reward routing)
    assert items[1].extra == {"data_source": "openai/gsm8k", "ability": "math",
                              "reward_model": {"style": "rule", "ground_truth": "4"},
                              "extra_info": {"split": "train", "index": 2}}


def test_a_top_level_answer_field_is_not_kept_as_a_column(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "solution": "7", "note": "kept"}])
    items = load_prompts(p, answer_field="solution")
    assert (items[0].answer, items[0].extra) == ("7", {"note": "kept"})
    # a column 'answer' beside it would reach reward functions replaced by the reference (answer=): refused
    p = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "q", "solution": "7", "answer": "ignored"}])
    with pytest.raises(DataError, match="column 'answer' clashes"):
        load_prompts(p, answer_field="solution")


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "q", "answer": "1"}, "d.jsonl:1: missing field(s) ['reward_model']; every row needs 'prompt' (text "
         "or chat messages) and the answer at answer_field 'reward_model.ground_truth'"),
        ({"prompt": "q", "reward_model": {"style": "rule"}},
         "d.jsonl:1: no 'reward_model.ground_truth' (answer_field 'reward_model.ground_truth')"),
        ({"prompt": "q", "reward_model": "rule"},
         "d.jsonl:1: 'reward_model' is a str, not an object holding 'ground_truth' (answer_field"),
        ({"prompt": "q", "reward_model": {"ground_truth": None}},
         "d.jsonl:1: 'reward_model.ground_truth' is empty (None); every row needs the reference answer"),
    ],
)
def test_a_missing_answer_path_names_the_row_and_the_path(tmp_path, row, message):
    p = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(DataError, match=re.escape(message)):
        load_prompts(p, answer_field="reward_model.ground_truth")


# -- Parquet, for real -----------------------------------------------------------------------------------------------


def test_verl_shaped_parquet_loads(tmp_path, model_dir):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([verl_row(i) for i in range(3)]), path)
    items = load_prompts(path, answer_field="reward_model.ground_truth", model_dir=model_dir)
    assert [(i.index, i.answer) for i in items] == [(0, "0"), (1, "2"), (2, "4")]
    assert items[2].prompt == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert items[2].messages == [{"role": "user", "content": "What is 2+2?"}]
    assert items[2].extra["extra_info"] == {"split": "train", "index": 2} and items[2].extra["ability"] == "math"
    # the same rows as JSONL load the same (the format is no part of the data)
    same = load_prompts(write_jsonl(tmp_path / "train.jsonl", [verl_row(i) for i in range(3)]),
                        answer_field="reward_model.ground_truth", model_dir=model_dir)
    assert same == items


def test_parquet_missing_the_answer_column_names_the_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["q"], "solution": ["1"]}), path)
    with pytest.raises(DataError, match=re.escape("missing column(s) ['answer']; columns are ['prompt', "
                                                  "'solution']; answer_field names the answer's column")):
        load_prompts(path)


@pytest.mark.parametrize("column, kind", [([b"\x00\x01", b"\x02"], "bytes"),
                                          ([datetime.date(2024, 1, 1), datetime.date(2024, 1, 2)], "date")])
def test_parquet_columns_that_are_not_json_are_refused(tmp_path, column, kind):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"], "blob": column}), path)
    with pytest.raises(DataError, match=re.escape(f"d.parquet row 0: column 'blob' holds a {kind}, which is not JSON")):
        load_prompts(path)


def test_parquet_int_answers_with_a_null_are_integers(tmp_path):
    """pandas writes an int column with a missing value as float64 (42.0 in the file): the answer is "42", which
    the task verifier and an integer answer string match; the null row itself is refused, naming it."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pd_style = tmp_path / "pandas.parquet"  # the float64 column pandas writes for [42, 7, None]
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "answer": pa.array([42.0, 7.0, None], pa.float64())}),
                   pd_style)
    with pytest.raises(DataError, match=re.escape("pandas.parquet row 2: 'answer' is empty (None)")):
        load_prompts(pd_style)
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": pa.array([42.0, 7.0], pa.float64()),
                             "level": pa.array([3, None], pa.int64())}), pd_style)
    items = load_prompts(pd_style)
    assert [(i.answer, i.extra) for i in items] == [("42", {"level": 3}), ("7", {"level": None})]


def test_parquet_without_pyarrow_says_how_to_get_it(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow...` raises ImportError, as when not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=re.escape(f"{path}: reading Parquet needs pyarrow: pip install pyarrow")):
        load_prompts(path)


# -- the trainer's own loading path --------------------------------------------------------------------------------


def test_trainer_and_eval_load_chat_rows_through_the_config(tmp_path, model_dir):
    """The trainer's call sites (loop.train: trainer_prompts; evaluate.eval_items; the launcher's resume check)
    read answer_field / eval_answer_field and render chat rows with model_dir's template."""
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.data import trainer_prompts
    from tlt.services.trainer.evaluate import eval_items

    train = write_jsonl(tmp_path / "train.jsonl", [verl_row(1), verl_row(2)])
    held_out = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": CHAT, "solution": "2"}])
    cfg = TrainerConfig(model_dir=str(model_dir), data_path=str(train), answer_field="reward_model.ground_truth",
                        eval_data_path=str(held_out), eval_answer_field="solution", eval_problems=1)
    items = trainer_prompts(cfg)
    assert [(i.prompt, i.answer) for i in items] == [
        ("<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n", "2"),
        ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "4")]
    [ev] = eval_items(cfg)
    assert (ev.prompt, ev.answer, ev.messages) == (RENDERED, "2", CHAT)
    # eval_answer_field defaults to answer_field
    both = TrainerConfig(model_dir=str(model_dir), data_path=str(train), answer_field="reward_model.ground_truth",
                         eval_data_path=str(train), eval_problems=2)
    assert [i.answer for i in eval_items(both)] == ["2", "4"]


def test_the_launchers_resume_check_reads_the_data_as_the_trainer_does(tmp_path, model_dir):
    """`tlt run` compares the data file with the checkpoint's data position before it starts anything
    (run_resume.data_file_change); reading a chat-message file without the trainer's template and answer_field, it
    found an unreadable file and refused every resume of the run. The checkpoint state is the trainer's own."""
    import torch

    from tlt.services.trainer.checkpoint import LATEST, STATE_FILE
    from tlt.services.trainer.config import TrainerConfig
    from tlt.services.trainer.data import trainer_prompts
    from tlt.services.trainer.run_resume import data_file_change, latest_state

    data = write_jsonl(tmp_path / "train.jsonl", [verl_row(i) for i in range(4)])
    cfg = TrainerConfig(model_dir=str(model_dir), data_path=str(data), answer_field="reward_model.ground_truth")
    sampler = PromptSampler(trainer_prompts(cfg), cfg.seed)
    sampler.next_batch(2)
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    ckpt.mkdir(parents=True)
    torch.save({"sampler": sampler.state_dict()}, ckpt / STATE_FILE)
    (ckpt.parent / LATEST).write_text(ckpt.name)
    assert data_file_change(cfg, latest_state(tmp_path / "run")) is None
    write_jsonl(data, [verl_row(i) for i in (0, 1, 2, 5)])  # edited: the launcher sees it
    assert "was edited since" in data_file_change(cfg, latest_state(tmp_path / "run"))
