"""Policy weight push from the trainer's DeepSpeed model to a real rollout server.

Real rollout server (replica process, native engine, grpc.aio on 127.0.0.1),
real DeepSpeed policy loaded from the same checkpoint folder. Checks: gRPC
chunks and the /dev/shm path both apply; generation after a push uses the new
weights (greedy output changes to what the trainer's own model would produce);
a refused push raises; stale versions are detected.

Stand-ins, not the real thing: `test_sync_weights_brings_every_server_to_the_trainer`
runs `sync_weights` against `_VersionedServer` (only the rollout's "a push must be
newer" rule, which tests/test_rollout_hotswap.py checks on the real server) and a
two-by-two Linear as the policy, to set up restarted and ahead-of-checkpoint servers
that real servers would need a restart per case for.
"""

from __future__ import annotations

import pytest
import torch

from rollout_helpers import ServerThread
from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.policy import Policy
from tlt.services.trainer.weight_sync import (
    StaleWeightsError,
    WeightPublisher,
    check_versions,
    policy_tensors,
    resolve_dtype,
)


def greedy(client, prompt_ids, k=6):
    from tlt.v1 import rollout_pb2

    params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
    (c,) = client.generate(prompt_ids, n=1, params=params)
    return list(c.token_ids), c.versions.policy


def hf_greedy(model, prompt_ids, k=6):
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(k):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_push_grpc_and_shm_then_rollout_uses_new_weights(random_model_dir):
    from tlt.services.rollout.client import RolloutClient

    torch.set_num_threads(1)
    cfg = TrainerConfig(model_dir=str(random_model_dir), prompts_per_step=1, n_samples=4, mini_batch_size=4,
                        micro_batch_size=4)
    policy = Policy(cfg)
    prompt = [5, 6, 7, 8]
    with ServerThread(random_model_dir, replicas=1) as server, RolloutClient(server.grpc_address) as client:
        before, v0 = greedy(client, prompt)
        assert v0 == 0 and before == hf_greedy(policy.module.eval(), prompt)
        # change the policy deterministically (as an update would), then push it
        with torch.no_grad():
            torch.manual_seed(1)
            for p in policy.module.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        want = hf_greedy(policy.module.eval(), prompt)
        assert want != before
        tensors = policy_tensors(policy.module, resolve_dtype("auto", policy.bf16))
        for version, mode in ((1, "grpc"), (2, "shm")):
            report = WeightPublisher([client], mode).push(tensors, version)
            assert report.version == version and report.bytes > 0 and report.seconds > 0 and report.replicas == (0,)
            got, v = greedy(client, prompt)
            assert v == version and got == want
        # versions only grow: re-pushing version 2 is refused and changes nothing
        from tlt.services.rollout.client import WeightPushError

        with pytest.raises(WeightPushError, match="not newer"):
            WeightPublisher([client]).push(tensors, 2)
        # a wrong dtype is refused whole
        with pytest.raises(WeightPushError):
            WeightPublisher([client]).push(policy_tensors(policy.module, torch.float16), 3)
        assert greedy(client, prompt) == (want, 2)


def test_a_fresh_trainer_pushes_its_weights_to_a_rollout_started_from_another_checkpoint(random_model_dir,
                                                                                           tmp_path):
    """Both at version 0 made the startup sync push nothing: a rollout started from another checkpoint of the same
    shapes (another seed here; in practice base vs instruct, or another run's policy folder) served the step-0 eval
    and every rollout from that model, and GRPO took its samples as on-policy. Now the sync compares two probe
    tensors and pushes when they differ; from the same folder it still pushes nothing."""
    from tlt.model.testing import random_checkpoint
    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer.loop import sync_weights

    torch.set_num_threads(1)
    other = random_checkpoint(tmp_path / "other", family="qwen2", seed=5)
    cfg = TrainerConfig(model_dir=str(random_model_dir), prompts_per_step=1, n_samples=4, mini_batch_size=4,
                        micro_batch_size=4)
    policy = Policy(cfg)
    prompt = [5, 6, 7, 8]
    want = hf_greedy(policy.module.eval(), prompt)
    for served, pushes in ((random_model_dir, False), (other, True)):
        with ServerThread(served, replicas=1) as server, RolloutClient(server.grpc_address) as client:
            policy.version = 0
            sync_weights(policy, WeightPublisher([client]), [client])
            assert policy.version == int(pushes) and client.status().versions.policy == int(pushes)
            assert greedy(client, prompt) == (want, int(pushes))


def test_a_fresh_zero3_trainer_pushes_to_a_rollout_started_from_another_checkpoint_too(random_model_dir, tmp_path,
                                                                                        monkeypatch):
    """Under ZeRO-3 each parameter is a partition ([0]-shaped outside a forward) and the probes were never read: the
    sync pushed nothing at a fresh start, so the step-0 eval and rollout came from the other model. Now every rank
    gathers the two probes (probe_values, a collective; one rank here) and the sync compares them as at stage 0."""
    from transformers import AutoModelForCausalLM

    import tlt.services.trainer.policy as policy_mod
    from tlt.model.testing import random_checkpoint
    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer.loop import probe_values, sync_weights

    torch.set_num_threads(1)
    monkeypatch.setattr(policy_mod, "ZERO3_OPTIONS", {"stage3_param_persistence_threshold": 0}, raising=False)
    other = random_checkpoint(tmp_path / "other", family="qwen2", seed=5)
    policy = Policy(TrainerConfig(model_dir=str(random_model_dir), prompts_per_step=1, n_samples=4,
                                  mini_batch_size=4, micro_batch_size=4, zero_stage=3))
    assert policy.gathers and all(p.numel() == 0 for p in policy.module.parameters())  # nothing readable alone
    start = AutoModelForCausalLM.from_pretrained(random_model_dir, local_files_only=True).eval()
    probes = probe_values(policy)
    assert len(probes) == 2 and all(torch.equal(t, start.state_dict()[n]) for n, t in probes.items())
    prompt = [5, 6, 7, 8]
    want = hf_greedy(start, prompt)
    for served, pushes in ((random_model_dir, False), (other, True)):
        with ServerThread(served, replicas=1) as server, RolloutClient(server.grpc_address) as client:
            policy.version = 0
            sync_weights(policy, WeightPublisher([client]), [client])
            assert policy.version == int(pushes) and client.status().versions.policy == int(pushes)
            assert greedy(client, prompt) == (want, int(pushes))


def test_check_versions():
    check_versions([3, 3, 3], 3)
    with pytest.raises(StaleWeightsError, match=r"version\(s\) \[2\] but version 3 was pushed"):
        check_versions([3, 2, 3], 3)


def test_tied_lm_head_is_not_pushed():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    m = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    names = set(policy_tensors(m, torch.bfloat16))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert all(t.dtype == torch.bfloat16 for t in policy_tensors(m, torch.bfloat16).values())


class _VersionedServer:
    """Just the version rule of a rollout server: status() reports it, a push must be newer."""

    def __init__(self, version: int) -> None:
        self.version, self.address = version, f"server-at-{version}"

    def status(self):
        from types import SimpleNamespace

        return SimpleNamespace(versions=SimpleNamespace(policy=self.version), dtype="float32", backend="native")

    def update_weights(self, tensors, kind, version, shm=False):
        from types import SimpleNamespace

        from tlt.services.rollout.client import WeightPushError

        if version <= self.version:
            raise WeightPushError(f"policy version {version} is not newer than the serving {self.version}")
        self.version = version
        return SimpleNamespace(version=version, apply_seconds=0.0, replicas=[0])


@pytest.mark.parametrize("serving, trainer, pushed", [
    ((5, 5), 5, None),  # in sync: nothing to push
    ((5, 0), 5, 6),     # one server restarted (serves the start checkpoint): all must get the trainer's weights
    ((0, 5), 5, 6),
    ((0, 0), 5, 5),     # every server restarted: the resumed weights under their own version
    ((7, 6), 5, 8),     # killed after pushes the checkpoint does not know: a newer version than any served
])
def test_sync_weights_brings_every_server_to_the_trainer(serving, trainer, pushed):
    from types import SimpleNamespace

    from tlt.services.trainer.loop import sync_weights

    servers = [_VersionedServer(v) for v in serving]
    policy = SimpleNamespace(version=trainer, module=torch.nn.Linear(2, 2), bf16=False,
                             cfg=SimpleNamespace(push_dtype="float32"))
    sync_weights(policy, WeightPublisher(servers), servers)
    want = trainer if pushed is None else pushed
    assert policy.version == want and [s.version for s in servers] == [want] * len(servers)


class _ReadyServer(_VersionedServer):
    """A _VersionedServer that `_Services.sync` can wait for and check the control token of."""

    def wait_ready(self, timeout_s):
        pass

    def check_control(self):
        pass


@pytest.mark.parametrize("serving, trainer, pushed", [
    ((5, 5), 5, None),
    ((5, 0), 5, 6),
    ((0, 0), 5, 5),
    ((7, 6), 5, 8),     # killed after pushes the checkpoint does not know: a newer version than any served
])
def test_the_loops_startup_sync_hands_every_rank_the_raised_version(serving, trainer, pushed):
    """train() runs the sync in two halves: rank 0's `_Services.sync` says (version, push due), every rank takes
    that version (broadcast) and joins the push (ZeRO-3 gathers), rank 0 sends it. The version handed on must be
    the one sync_version raised past the servers', or the push is refused as not newer."""
    from types import SimpleNamespace

    from tlt.services.trainer.loop import _Services, push_tensors

    servers = [_ReadyServer(v) for v in serving]
    services = object.__new__(_Services)  # rank 0's side without its metrics files, Prometheus or gRPC clients
    services.cfg = SimpleNamespace(weight_push="grpc", connect_timeout_s=1.0, push_dtype="auto", bf16=None)
    services.clients, services.rewards, services.loan = servers, SimpleNamespace(), None
    policy = SimpleNamespace(version=trainer, module=torch.nn.Linear(2, 2), bf16=False,
                             cfg=SimpleNamespace(push_dtype="float32"))
    version, push_due = services.sync(policy)  # what rank 0 broadcasts; train() sets it as every rank's version
    want = trainer if pushed is None else pushed
    assert (version, push_due) == (want, pushed is not None)
    if push_due:
        services.publisher.push(push_tensors(policy), version)
    assert [s.version for s in servers] == [want] * len(servers)


def test_shm_publisher_removes_the_files_of_a_trainer_killed_mid_push():
    """A trainer SIGKILLed while its shm push was in flight leaves its file in /dev/shm (no `finally` runs);
    the next shm publisher (the resumed trainer) removes it, and leaves a live writer's file alone."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tlt.services.common import weights as W

    code = ("import os, signal\nfrom tlt.services.common.weights import write_shm\n"
            "print(write_shm(b'x' * 4096), flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    stale = Path(child.stdout.strip())
    live = W.write_shm(b"mine")
    try:
        assert stale.exists() and stale.name.startswith(W.SHM_PREFIX)
        WeightPublisher([], "grpc")
        assert stale.exists()  # only the shm mode owns such files
        WeightPublisher([], "shm")
        assert not stale.exists() and Path(live).exists()
    finally:
        W.remove_shm(str(stale))
        W.remove_shm(live)


def test_a_trainer_terminated_mid_push_removes_its_shm_file_and_dies_of_the_signal():
    """`tlt run`'s stop, a container's stop and the parent-death signal send SIGTERM, which ended the trainer with
    no `finally`: a push in flight left the whole model's weights in /dev/shm. `tlt train` now unwinds first."""
    import glob
    import signal
    import subprocess
    import sys
    import textwrap
    import threading
    import time
    from concurrent import futures
    from pathlib import Path

    import grpc

    from tlt.services.common.weights import SHM_PREFIX, shm_dir
    from tlt.v1 import rollout_pb2, rollout_pb2_grpc

    release = threading.Event()

    class SlowApply(rollout_pb2_grpc.RolloutServicer):  # a rollout whose apply takes long (a big model)
        def UpdateWeights(self, request_iterator, context):
            for _ in request_iterator:
                pass
            release.wait(60)
            return rollout_pb2.UpdateWeightsResponse(ok=True)

    server = grpc.server(futures.ThreadPoolExecutor(2))
    rollout_pb2_grpc.add_RolloutServicer_to_server(SlowApply(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    code = textwrap.dedent(f"""
        import torch
        from tlt.services.rollout.client import RolloutClient
        from tlt.services.common.signals import unwind_on_termination
        from tlt.services.trainer.weight_sync import WeightPublisher
        with unwind_on_termination("train_terminated", "trainer"):
            WeightPublisher([RolloutClient("127.0.0.1:{port}")], "shm").push({{"w": torch.zeros(64, 64)}}, 1)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    pattern = str(shm_dir() / f"{SHM_PREFIX}{child.pid}.*")
    try:
        deadline = time.monotonic() + 60
        while not glob.glob(pattern) and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert glob.glob(pattern), "the push never wrote its file"
        child.send_signal(signal.SIGTERM)  # as procs.Service.stop does
        child.wait(30)
        assert child.returncode == -signal.SIGTERM  # still dies of the signal: launchers read the status
        assert glob.glob(pattern) == []
    finally:
        release.set()
        if child.poll() is None:
            child.kill()
            child.wait(10)
        server.stop(0)
        for left in glob.glob(pattern):
            Path(left).unlink()


def test_a_trainer_under_nohup_still_ignores_the_hangup():
    """`nohup tlt train ...` ignores SIGHUP; the trainer's own handler must not take that back."""
    import signal
    import subprocess
    import sys

    code = ("import os, signal\nfrom tlt.services.common.signals import unwind_on_termination\n"
            "with unwind_on_termination('train_terminated', 'trainer'):\n    os.kill(os.getpid(), signal.SIGHUP)\n    print('trained on')\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # as nohup starts it
    assert child.returncode == 0 and "trained on" in child.stdout, child.stderr[-2000:]


class _ServingWeights(_VersionedServer):
    """A _VersionedServer at version 0 whose start checkpoint holds `weights` (what get_weights answers)."""

    def __init__(self, name: str, weights: dict) -> None:
        super().__init__(0)
        self.address, self.weights = name, weights

    def get_weights(self, names, kind="policy"):
        return 0, {n: self.weights[n].clone() for n in names}


def test_a_fresh_start_pushes_unless_every_server_serves_the_trainers_weights_matrix_and_vector_alike():
    """Both at version 0, two servers: one started from the trainer's own checkpoint, the other from one whose
    matrices match it and whose vectors (a bias, a norm) do not (a fine-tune of the norms, another seed of them).
    The other's samples are not the trainer's policy: the sync pushes, to both, though one of them serves these
    weights and the matrix probe matches on both."""
    from types import SimpleNamespace

    from tlt.services.trainer.loop import sync_weights

    module = torch.nn.Linear(2, 3)
    own = {k: v.detach().clone() for k, v in module.named_parameters()}
    other = {**own, "bias": own["bias"] + 1.0}
    servers = [_ServingWeights("same", own), _ServingWeights("other-vectors", other)]
    policy = SimpleNamespace(version=0, module=module, bf16=False, gathers=False,
                             cfg=SimpleNamespace(push_dtype="float32"))
    sync_weights(policy, WeightPublisher(servers), servers)
    assert policy.version == 1 and [s.version for s in servers] == [1, 1]
    alike = [_ServingWeights("a", own), _ServingWeights("b", own)]
    policy.version = 0
    sync_weights(policy, WeightPublisher(alike), alike)  # both serve the trainer's weights: nothing to push
    assert policy.version == 0 and [s.version for s in alike] == [0, 0]


def test_the_whole_state_of_a_tied_model_names_the_shared_tensor_under_both_names():
    """full_state_dict (Policy.state_dict_for_push, the ZeRO-3 export) keeps a tied lm_head under its own name, the very
    tensor the embedding is (gathered once under ZeRO-3); only the push leaves it out (policy_tensors)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tlt.services.trainer.weight_sync import full_state_dict

    m = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    state = full_state_dict(m)
    assert set(state) == set(m.state_dict())
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
