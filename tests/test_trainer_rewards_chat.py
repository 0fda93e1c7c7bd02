"""Reward functions on chat-message data, as TRL calls them, and `completion_ids`.

TRL's GRPOTrainer (trl/trainer/grpo_trainer.py, _generate_and_score_completions) calls every reward function as
`reward_func(prompts=prompts, completions=completions, completion_ids=completion_ids_list, **reward_kwargs)`; when
the data is conversational, `prompts` are the rows' message lists and each completion is
`[{"role": "assistant", "content": text}]`; `completion_ids` are the completion's token ids.

Nothing is faked: the rows come from a real JSONL file rendered with the real task tokenizer; the gRPC case runs
the project's reward server on 127.0.0.1.
"""

from __future__ import annotations

import json

import pytest

from tlt.services.trainer.rewards import FunctionRewards, GrpcRewards, RewardResult, task_rewards

CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 1+1?"}]


@pytest.fixture(scope="module")
def chat_items(tmp_path_factory):
    from tlt.model.tokenizer import build_tokenizer
    from tlt.services.trainer.data import load_prompts

    out = tmp_path_factory.mktemp("chat")
    build_tokenizer(out / "model")
    rows = [{"prompt": CHAT, "answer": "2", "level": 1},
            {"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"}]
    (out / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_prompts(out / "d.jsonl", model_dir=out / "model")


def submit_all(batch, items, texts, ids=None):
    for item in items:
        for k, text in enumerate(texts[item.index]):
            batch.submit(f"p{item.index}-k{k}", item.prompt, text, item.answer, extra=item.extra,
                         messages=item.messages, completion_ids=None if ids is None else ids[item.index][k])


def test_chat_rows_reach_functions_as_message_lists(chat_items):
    seen = {}

    def trl_style(prompts, completions, **kwargs):  # TRL's conversational reward: completion[0]["content"]
        seen.update(kwargs, prompts=prompts, completions=completions)
        return [float(c[0]["content"].endswith(a)) for c, a in zip(completions, kwargs["answer"])]

    batch = FunctionRewards([trl_style]).begin()
    submit_all(batch, chat_items, {0: ["it is 2", "3"], 1: ["4"]})
    res = batch.results()
    assert {k: r.reward for k, r in res.items()} == {"p0-k0": 1.0, "p0-k1": 0.0, "p1-k0": 1.0}
    assert seen["prompts"] == [CHAT, CHAT, [{"role": "user", "content": "What is 2+2?"}]]
    assert seen["completions"] == [[{"role": "assistant", "content": "it is 2"}],
                                   [{"role": "assistant", "content": "3"}], [{"role": "assistant", "content": "4"}]]
    assert seen["level"] == [1, 1, None] and seen["answers"] == ["2", "2", "4"]


def test_a_prefill_is_popped_off_the_prompt_and_opens_each_completion(tmp_path):
    """TRL (grpo_trainer.py, _generate_and_score_completions): `bootstrap = prompt.pop()["content"]` when the prompt
    ends with an assistant message, and the completion is `[{"role": "assistant", "content": bootstrap + text}]`."""
    from tlt.model.tokenizer import build_tokenizer
    from tlt.services.trainer.data import load_prompts

    build_tokenizer(tmp_path / "model")
    prefill = [{"role": "user", "content": "What is 1+1?"}, {"role": "assistant", "content": "<think>"}]
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": prefill, "answer": "2"}) + "\n")
    items = load_prompts(tmp_path / "d.jsonl", model_dir=tmp_path / "model")
    seen = {}

    def trl_style(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [float(c[0]["content"].startswith("<think>")) for c in completions]

    batch = FunctionRewards([trl_style]).begin()
    submit_all(batch, items, {0: [" 1+1 </think> 2"]})
    assert [r.reward for r in batch.results().values()] == [1.0]
    assert seen["prompts"] == [prefill[:1]]
    assert seen["completions"] == [[{"role": "assistant", "content": "<think> 1+1 </think> 2"}]]
    assert items[0].messages == prefill  # the row keeps its prefill for the next step


def test_a_function_editing_its_prompt_lists_changes_no_other_completion(chat_items):
    # TRL's own trainer pops a prefilled assistant turn off `prompt`; a function doing the like must not change the
    # item's messages (every later step reads them) or the next sample's prompt
    def pops(prompts, completions, **kw):
        out = [float(len(p)) for p in prompts]
        for p in prompts:
            p.pop()
        return out

    batch = FunctionRewards([pops]).begin()
    submit_all(batch, chat_items, {0: ["a", "b"], 1: ["c"]})
    assert [r.reward for r in batch.results().values()] == [2.0, 2.0, 1.0]
    assert chat_items[0].messages == CHAT


def test_completion_ids_reach_functions_that_name_them(chat_items):
    seen = {}

    def by_tokens(completions, completion_ids):  # names it, no **kw
        seen["ids"] = completion_ids
        return [float(len(i)) for i in completion_ids]

    def anything(prompts, completions, **kw):
        seen["kw"] = sorted(kw)
        return [0.0] * len(completions)

    def text_only(prompts, completions, answer):  # names neither: gets neither (a TypeError otherwise)
        return [0.0] * len(completions)

    ids = {0: [(5, 6, 7), (8,)], 1: [(9, 10)]}
    batch = FunctionRewards([by_tokens, anything, text_only]).begin()
    submit_all(batch, chat_items, {0: ["x", "y"], 1: ["z"]}, ids)
    assert {k: r.reward for k, r in batch.results().items()} == {"p0-k0": 3.0, "p0-k1": 1.0, "p1-k0": 2.0}
    assert seen["ids"] == [[5, 6, 7], [8], [9, 10]]
    assert seen["kw"] == ["answer", "answers", "completion_ids", "level", "trainer_state"]


def test_text_rows_keep_text_prompts_and_completions():
    seen = {}

    def fn(prompts, completions, **kw):
        seen.update(prompts=prompts, completions=completions)
        return [1.0] * len(completions)

    batch = FunctionRewards([fn]).begin()
    batch.submit("a", "1+1=", "2", "2", completion_ids=(3,))
    batch.results()
    assert seen == {"prompts": ["1+1="], "completions": ["2"]}


def test_the_builtin_verifier_scores_chat_completions(chat_items):
    batch = task_rewards().begin()
    submit_all(batch, chat_items, {0: ["1+1=2\nanswer: 2", "answer: 3"], 1: ["answer: 4"]})
    assert {k: r.reward for k, r in batch.results().items()} == {"p0-k0": 1.0, "p0-k1": 0.0, "p1-k0": 1.0}


def test_a_reward_server_gets_the_rendered_text(chat_items):
    from tlt.services.reward.config import RewardConfig
    from tlt.services.reward.server import RewardServer

    with RewardServer(RewardConfig(host="127.0.0.1", port=0)) as server:
        src = GrpcRewards(server.address, concurrency=2, timeout_s=10, retries=0)
        sent = []
        real = src._client

        class Spy:  # the real client, its requests recorded
            def submit(self, req):  # noqa: ANN001
                sent.append(req)
                return real.submit(req)

        src._client = Spy()
        try:
            batch = src.begin()
            texts = {0: ["answer: 2", "answer: 5"], 1: ["answer: 4"]}
            submit_all(batch, chat_items, texts, {0: [(1,), (2,)], 1: [(3,)]})
            res = batch.results()
        finally:
            real.close()
    assert res == {"p0-k0": RewardResult(1.0, True), "p0-k1": RewardResult(0.0, False),
                   "p1-k0": RewardResult(1.0, True)}
    assert [(r.prompt, r.completion, r.reference) for r in sent][0] == (chat_items[0].prompt, "answer: 2", "2")
    assert sent[0].prompt.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>")
    assert "level" in sent[0].metadata and len(sent) == 3  # the columns as metadata; nothing else changed
