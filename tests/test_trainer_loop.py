"""The training loop end to end against a real rollout server: rollout -> rewards -> update -> push.

Real parts: the rollout server (replica process, native engine, grpc.aio on
127.0.0.1), DeepSpeed with a gloo group, the task verifier in-process and, in
the second test, the project's gRPC reward server. The model is a seeded
random Qwen2 with the task tokenizer (tlt.model.testing), so rewards are
mostly 0: the test checks the plumbing and the versions, not learning.
"""

from __future__ import annotations

import json

import pytest
import torch

from rollout_helpers import ServerThread, kill_replica_once_busy
from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.loop import train


def config(model_dir, address, out, **kw) -> TrainerConfig:
    base = dict(model_dir=str(model_dir), rollout_addresses=[address], output_dir=str(out), prompts_per_step=2,
                n_samples=4, max_tokens=12, mini_batch_size=8, micro_batch_size=4, lr=1e-3, steps=2,
                checkpoint_interval=1, synthetic_problems=64, torch_threads=1, connect_timeout_s=30)
    base.update(kw)
    return TrainerConfig(**base)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def test_two_steps_push_weights_and_next_rollout_carries_new_version(random_model_dir, tmp_path):
    from tlt.services.common.events import FeaturePuller
    from tlt.services.rollout.client import RolloutClient

    with ServerThread(random_model_dir, replicas=1) as server, FeaturePuller("tcp://127.0.0.1:*") as drafter:
        cfg = config(random_model_dir, server.grpc_address, tmp_path / "run", drafter_features_address=drafter.endpoint)
        summary = train(cfg)
        with RolloutClient(server.grpc_address) as client:
            serving = client.status().versions.policy
        batches = [b for b in (drafter.recv(2.0) for _ in range(2)) if b is not None]
    assert summary.steps_done == 2 and summary.policy_version == 2 and serving == 2
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1] and [m["policy_version"] for m in lines] == [1, 2]
    for m in lines:
        assert m["optimizer_updates"] == 1 and m["tokens"] > 0
        assert m["sd_response_tokens"] == m["tokens"]  # the SD share's denominator: every generated token (no filter)
        assert m["times"]["push_s"] > 0 and m["times"]["rollout_s"] > 0
        # trainer and rollout compute the same logprobs for the same weights (fp32 both sides)
        assert m["rollout_logprob_max_diff"] < 1e-3
    # step 1's rollout was checked to come entirely from version 1 (the pushed weights), else
    # train() raises StaleWeightsError; the final policy is a loadable HF folder.
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy", local_files_only=True)
    assert (tmp_path / "run" / "policy" / "tokenizer.json").exists()
    policy = tmp_path / "run" / "policy"  # weights readable like the config beside them (safetensors wrote 0600)
    assert {p.stat().st_mode & 0o777 for p in policy.glob("*.safetensors")} == {(policy / "config.json").stat().st_mode
                                                                                 & 0o777}
    # the old-logprob pass's hidden states reached the drafter's PULL socket (a push that
    # finds no connected peer yet is dropped by design, so at least one of the two steps)
    assert batches, "no trainer features received"
    for b in batches:
        assert b.source == "trainer" and len(b.sequences) == 8
        for seq in b.sequences:
            assert seq.hidden_size == 64 and len(seq.features) == len(seq.token_ids) * 64 * 2
            assert seq.policy_version in (0, 1) and 0 < seq.response_start < len(seq.token_ids)
        assert len({seq.group_id for seq in b.sequences}) == 2  # two prompts' groups (the held-out split's unit)


def test_resume_continues_versions_and_data(random_model_dir, tmp_path):
    from tlt.services.reward.config import RewardConfig
    from tlt.services.reward.server import RewardServer

    out = tmp_path / "run"
    with ServerThread(random_model_dir, replicas=1) as server, RewardServer(RewardConfig(port=0)) as rs:
        kw = dict(reward="grpc", reward_address=rs.address, eval_problems=3, eval_interval=1, eval_samples=2)
        train(config(random_model_dir, server.grpc_address, out, steps=1, **kw))
        summary = train(config(random_model_dir, server.grpc_address, out, steps=2, **kw))
    assert summary.resumed_from == 1 and summary.policy_version == 2
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1]
    # held-out evals: before training, after step 1 (first run), after step 2 (the resumed run); each
    # scored the version pushed at that point, once.
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [(e["after_steps"], e["policy_version"]) for e in evals] == [(0, 0), (1, 1), (2, 2)]
    assert all(e["problems"] == 3 and e["samples"] == 2 and 0.0 <= e["accuracy"] <= 1.0 for e in evals)
    from tlt.services.trainer.data import PromptSampler, synthetic_prompts

    sampler = PromptSampler(synthetic_prompts(64, 0), seed=0)
    assert [m["prompt_indices"] for m in lines] == [[p.index for p in sampler.next_batch(2)] for _ in range(2)]


def test_a_trainer_whose_token_the_rollout_refuses_stops_before_its_first_step(random_model_dir, tmp_path,
                                                                               monkeypatch):
    """A missing or wrong control token used to surface at the first weight push, after a whole RL step
    (rollout, rewards, update) had been spent; GetStatus now says whether the caller's token would pass."""
    from tlt.services.rollout.client import ControlRefusedError, RolloutClient

    # the server's token from its config, not the environment: a front whose environment changed since its
    # forkserver started spawns its replica (services/rollout/replica_start.py), ~8 s of imports on 2 cores
    with ServerThread(random_model_dir, replicas=1, control_token="the-rollout-token") as server:
        monkeypatch.delenv("TLT_AUTH_TOKEN")
        with RolloutClient(server.grpc_address, control_token="the-rollout-token") as ok, \
                RolloutClient(server.grpc_address, control_token="") as none:
            assert ok.status().control_refused == ""
            assert "without 'authorization" in none.status().control_refused
        cfg = config(random_model_dir, server.grpc_address, tmp_path / "run", rollout_token="a-wrong-token")
        with pytest.raises(ControlRefusedError, match="wrong token"):
            train(cfg)
        with RolloutClient(server.grpc_address) as client:
            served = client.status().replicas[0].versions.policy
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and served == 0


def test_a_step_whose_replica_died_is_rolled_out_again_once_the_replica_is_back(random_model_dir, tmp_path):
    """A replica that dies (OOM, kill -9) fails its requests with UNAVAILABLE and the rollout server restarts
    it; the trainer used to fail the step and stop the run, losing the steps since its last checkpoint. Now it
    drops the step's partial rollout, waits until every replica serves again and rolls the step out anew.
    Killed while step 0's requests are in it, with re-dispatch off (`redispatch_limit=0`), so they fail: a
    request sent while the only replica restarts waits for it instead (tests/test_rollout_front_loop.py)."""
    with ServerThread(random_model_dir, replicas=1, max_restarts=1, redispatch_limit=0) as server:
        killer = kill_replica_once_busy(server.server.pool)  # step 0's rollout is in the replica
        cfg = config(random_model_dir, server.grpc_address, tmp_path / "run", steps=1, rollout_retries=1)
        summary = train(cfg)
        killer.join(5)
        restarts = dict(server.server.pool.restarts)
    assert summary.steps_done == 1 and restarts == {0: 1}
    (line,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert line["rollout_retries"] == 1 and line["policy_version"] == 1


def test_the_held_out_eval_is_also_redone_after_a_replica_death(random_model_dir, tmp_path):
    import os
    import signal

    with ServerThread(random_model_dir, replicas=1, max_restarts=1) as server:
        os.kill(server.server.pool.replicas[0].process.pid, signal.SIGKILL)  # dead before the step-0 eval
        cfg = config(random_model_dir, server.grpc_address, tmp_path / "run", steps=1, rollout_retries=1,
                     eval_problems=4, eval_samples=1)
        summary = train(cfg)
    assert summary.steps_done == 1
    evals = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["after_steps"] for e in evals] == [0, 1] and all(e["samples"] == 1 for e in evals)
    (line,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert line["rollout_retries"] == 0  # the eval's retry had waited for the replica: the step found it serving


def test_a_step_refused_by_a_busy_rollout_server_is_rolled_out_again_once_there_is_room(random_model_dir, tmp_path,
                                                                                       monkeypatch):
    """A rollout server shared with other clients refuses a request it has no room for (RESOURCE_EXHAUSTED,
    `max_pending_sequences`). The trainer asks again after a wait instead of ending the run. Here another client's
    request holds one of the 8 places (its replica SIGSTOPped until the trainer has been refused once). The place is
    taken as the trainer starts its first rollout: a stopped replica answers no status query (the front waits 5 s
    for it, twice at the trainer's start), which held the test up for 10 s before the rollout it is about."""
    import os
    import re
    import signal
    import threading
    import time

    import httpx

    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer import collect
    from tlt.v1 import rollout_pb2

    monkeypatch.setattr(collect, "BUSY_WAIT_S", 0.5)
    with ServerThread(random_model_dir, replicas=1, max_pending_sequences=8) as server, \
            RolloutClient(server.grpc_address, timeout_s=120) as other:
        pool, pid = server.server.pool, server.server.replica_pids()[0]
        params = rollout_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
        held = threading.Thread(target=lambda: list(other.batch_generate(["1+1="], n=1, params=params)))
        metrics = server.base_url.removesuffix("/v1") + "/metrics"

        def refused() -> float:
            found = re.search(r'^rollout_rejected_total\{reason="overloaded"\} (\S+)$', httpx.get(metrics).text, re.M)
            return float(found.group(1)) if found else 0.0

        def release_once_refused() -> None:
            # At least once, not exactly once: on a loaded machine the trainer may be refused again before a poll.
            deadline = time.monotonic() + 120
            while refused() < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(pid, signal.SIGCONT)

        releaser = threading.Thread(target=release_once_refused)
        real_collect = collect.collect_retrying

        def collect_with_a_place_held(*args, **kw):  # noqa: ANN002, ANN003, ANN202 - the trainer's rollouts
            if held.ident is None:  # the step's rollout (no eval here): the place is taken as it starts
                held.start()
                while pool.pending_sequences < 1:
                    time.sleep(0.005)
                os.kill(pid, signal.SIGSTOP)
                releaser.start()
            return real_collect(*args, **kw)

        monkeypatch.setattr(collect, "collect_retrying", collect_with_a_place_held)
        try:
            summary = train(config(random_model_dir, server.grpc_address, tmp_path / "run", steps=1,
                                   rollout_retries=5))
        finally:
            os.kill(pid, signal.SIGCONT)
            for t in (releaser, held):
                if t.ident is not None:  # started
                    t.join(130)
    assert summary.steps_done == 1
    (line,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert line["rollout_retries"] >= 1 and line["policy_version"] == 1


def test_a_verl_chat_data_file_trains_through_the_loop(random_model_dir, tmp_path, monkeypatch):
    """train() on verl-shaped rows (chat-message prompts, the answer at reward_model.ground_truth): the trainer
    renders each prompt with the policy's chat template as it loads the file, the rollout generates from that text,
    and the python reward function gets the messages, TRL's assistant-message completions and `completion_ids`."""
    from transformers import AutoTokenizer

    rows = [{"data_source": "synthetic", "prompt": [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": f"Compute mod 10: {i} +{i}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i % 10)}} for i in range(3)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "chat_reward_probe.py").write_text(
        "SEEN = []\n\n"
        "def reward(prompts, completions, completion_ids, answer, data_source, **kw):\n"
        "    SEEN.append((prompts, completions, completion_ids, answer, data_source))\n"
        "    return [float(len(i) % 2) for i in completion_ids]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with ServerThread(random_model_dir, replicas=1) as server:
        cfg = config(random_model_dir, server.grpc_address, tmp_path / "run", steps=1, data_path=str(data),
                     answer_field="reward_model.ground_truth", reward="python",
                     reward_function="chat_reward_probe:reward")
        assert train(cfg).steps_done == 1
    import chat_reward_probe

    [(prompts, completions, ids, answers, sources)] = chat_reward_probe.SEEN
    assert len(prompts) == len(completions) == len(ids) == 8 and set(sources) == {"synthetic"}
    by_question = {r["prompt"][1]["content"]: r for r in rows}
    for p, c, i, a in zip(prompts, completions, ids, answers):
        row = by_question[p[1]["content"]]
        assert p == row["prompt"] and a == row["reward_model"]["ground_truth"]
        assert c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) and 1 <= len(i) <= cfg.max_tokens
    tok = AutoTokenizer.from_pretrained(random_model_dir)
    for c, i in zip(completions, ids):  # the ids are the completion's own tokens
        assert tok.decode(i, skip_special_tokens=True) == c[0]["content"].replace("<|im_end|>", "")


def test_every_held_out_eval_samples_with_the_same_uniforms(random_model_dir, tmp_path, monkeypatch):
    """Common random numbers: the evals after 0 and after 10 steps seed their requests alike, so one policy
    samples the same completions in both (a change between two evals is then the policy's, not the draw's).
    The step label still differs (it names the server batch); with it as the seed key the draws differ, which
    this test checks too, so it cannot pass by sampling one fixed text."""
    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer import collect
    from tlt.services.trainer.evaluate import eval_items, run_eval
    from tlt.services.trainer.rewards import task_rewards

    got: list[list[tuple[int, ...]]] = []
    real = collect.collect_retrying

    def recording(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        result = real(*args, **kw)
        got.append([s.response_ids for s in sorted(result.samples, key=lambda s: (s.prompt_index, s.sample_index))])
        return result

    monkeypatch.setattr(collect, "collect_retrying", recording)
    with ServerThread(random_model_dir, replicas=1) as server, \
            RolloutClient(server.grpc_address, timeout_s=120) as client:
        cfg = config(random_model_dir, server.grpc_address, tmp_path / "run", eval_problems=6, eval_samples=3,
                     eval_temperature=1.0, max_tokens=16)
        items, rewards = eval_items(cfg), task_rewards()
        for steps_done in (0, 10):
            run_eval(items, [client], rewards, cfg, steps_done, 0, check_version=False)
        params = collect.sampling_params(cfg.max_tokens, 1.0, 1.0, seed=cfg.seed)
        recording(items, [client], rewards, 3, params, "eval10", 0, 1.0)  # the step label as the key: another draw
    first, tenth, own_key = got
    assert len(first) == 18 and all(first)
    assert first == tenth
    assert own_key != first


def test_eval_greedy_adds_one_greedy_completion_per_problem_to_each_held_out_eval(random_model_dir, tmp_path,
                                                                                   monkeypatch):
    """eval_greedy at eval_temperature 1: after the sampled pass each eval rolls out one greedy completion per problem
    (temperature 0, n = 1, its own server batch, version-checked as the first) and records its accuracy as
    greedy_accuracy. Greedy draws nothing, so two evals of one policy give the same greedy completions. At
    eval_temperature 0 the sampled pass is greedy already: one pass, greedy_accuracy = accuracy."""
    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer import collect, weight_sync
    from tlt.services.trainer.evaluate import EVAL_SEED_KEY, eval_items, run_eval
    from tlt.services.trainer.rewards import task_rewards

    calls: list[dict] = []
    real = collect.collect_retrying

    def recording(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        result = real(*args, **kw)
        samples = sorted(result.samples, key=lambda s: (s.prompt_index, s.sample_index))
        calls.append({"n": args[3], "params": args[4], "step": args[5], "seed_key": kw.get("seed_key"),
                      "ids": [s.response_ids for s in samples], "correct": [s.correct for s in samples]})
        return result

    checked: list[int] = []  # completions per version check (the real check runs)
    real_check = weight_sync.check_versions

    def counting(versions, expected):  # noqa: ANN001, ANN202
        versions = list(versions)
        checked.append(len(versions))
        return real_check(versions, expected)

    monkeypatch.setattr(collect, "collect_retrying", recording)
    monkeypatch.setattr(weight_sync, "check_versions", counting)
    with ServerThread(random_model_dir, replicas=1) as server, \
            RolloutClient(server.grpc_address, timeout_s=120) as client:
        kw = dict(eval_problems=4, eval_samples=2, eval_greedy=True, max_tokens=12)
        cfg = config(random_model_dir, server.grpc_address, tmp_path / "run", eval_temperature=1.0, **kw)
        items, rewards = eval_items(cfg), task_rewards()
        records = [run_eval(items, [client], rewards, cfg, k, 0) for k in (0, 10)]
        sampled_then_greedy = list(calls)
        calls.clear()
        at_zero = config(random_model_dir, server.grpc_address, tmp_path / "run", eval_temperature=0.0, **kw)
        greedy_only = run_eval(items, [client], rewards, at_zero, 0, 0)
    assert [c["step"] for c in sampled_then_greedy] == ["eval0", "eval0-greedy", "eval10", "eval10-greedy"]
    assert checked[:4] == [8, 4, 8, 4]  # both passes of both evals checked against the served version
    for c in sampled_then_greedy[1::2]:
        assert c["n"] == 1 and c["params"].temperature == 0.0 and c["params"].seed == cfg.seed
        assert c["params"].max_tokens == 12 and c["seed_key"] == EVAL_SEED_KEY and len(c["ids"]) == 4 and all(c["ids"])
    assert [c["params"].temperature for c in sampled_then_greedy[0::2]] == [1.0, 1.0]
    for r, greedy in zip(records, sampled_then_greedy[1::2]):
        assert isinstance(r.greedy_accuracy, float) and r.greedy_accuracy == sum(greedy["correct"]) / 4
        assert r.samples == 2 and r.temperature == 1.0
    assert sampled_then_greedy[1]["ids"] == sampled_then_greedy[3]["ids"]  # one policy: the same greedy completions
    assert [c["step"] for c in calls] == ["eval0"] and calls[0]["params"].temperature == 0.0
    assert greedy_only.greedy_accuracy == greedy_only.accuracy


def _gauges(text: str) -> dict[str, float]:
    """The Prometheus text's samples, by name and labels."""
    return {x.split(" ")[0]: float(x.split(" ")[1]) for x in text.splitlines() if x[:1] != "#"}


def test_a_resume_drops_the_lines_of_the_steps_after_its_checkpoint_and_restores_the_gauges(random_model_dir,
                                                                                            tmp_path):
    """Killed after step 2's metrics line and before its checkpoint (steps_done 2): the resumed run redoes step 2,
    so the old line for it goes (two lines for step 2 otherwise), the lines of steps 0 and 1 stay, and the gauges
    read as the last kept step (1) left them: its reward, not the first step's or the dropped one's. Rank 0's side of
    the loop over its real files; no service is called."""
    from tlt.services.trainer.loop import _Services

    out = tmp_path / "run"
    out.mkdir()
    rows = [{"step": k, "reward_mean": 0.25 * (k + 1), "times": {"step_s": 10.0 + k}} for k in range(3)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    services = _Services(config(random_model_dir, "127.0.0.1:1", out, steps=4), out, start=2)
    try:
        kept = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        text = services.prom.render().decode()
    finally:
        services.close()
    assert [m["step"] for m in kept] == [0, 1]
    gauges = _gauges(text)
    assert gauges["trainer_step"] == 2.0 and gauges["trainer_reward_mean"] == 0.5, gauges
    assert gauges['trainer_step_seconds{phase="step_s"}'] == 11.0, gauges


def test_a_steps_line_and_gauges_without_dynamic_sampling(random_model_dir, tmp_path):
    """Without dynamic sampling the step trained on every group it generated: groups_generated is prompts_per_step
    and zero_signal_groups_trained the step's own zero_signal_groups; publish() writes that line and sets the
    gauges to the steps done (step 3 done: 4) and its reward. Rank 0's side of the loop over its real files."""
    from types import SimpleNamespace

    from tlt.services.trainer.collect import RolloutResult
    from tlt.services.trainer.loop import _record_sampling, _Services
    from tlt.services.trainer.types import PromptItem, StepMetrics

    out = tmp_path / "run"
    m = StepMetrics(step=3, policy_version=4, reward_mean=0.75, zero_signal_groups=0.5)
    _record_sampling(m, RolloutResult(samples=[]), 2)
    assert (m.groups_generated, m.zero_signal_groups_trained, m.zero_signal_groups) == (2, 0.5, 0.5)
    services = _Services(config(random_model_dir, "127.0.0.1:1", out, steps=4), out, start=0)
    try:
        services.publish(SimpleNamespace(version=4), m, [PromptItem(7, "p", "1"), PromptItem(9, "q", "2")], 0.0)
        text = services.prom.render().decode()
    finally:
        services.close()
    line = json.loads((out / "metrics.jsonl").read_text())
    assert (line["step"], line["prompt_indices"], line["zero_signal_groups_trained"]) == (3, [7, 9], 0.5)
    gauges = _gauges(text)
    assert gauges["trainer_step"] == 4.0 and gauges["trainer_reward_mean"] == 0.75, gauges


def test_a_run_without_a_checkpoint_interval_still_checkpoints_its_last_step(random_model_dir, tmp_path):
    """checkpoint_interval = 0 ("only at the end"), and a last step off the interval: the finished run's state is
    checkpointed after its last step, so a longer run resumes from there (without it: from nothing, or from the
    last multiple of the interval, redoing steps the export already holds)."""
    out = tmp_path / "run"
    with ServerThread(random_model_dir, replicas=1) as server:
        train(config(random_model_dir, server.grpc_address, out, steps=1, checkpoint_interval=0))
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-00000001"]
