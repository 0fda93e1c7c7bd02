"""DeepSpeed ZeRO stage 3 (parameters partitioned over the ranks) for the policy trainer.

Real DeepSpeed (gloo, CPU), tiny random Qwen2 models built in code. Under stage 3
`module.parameters()` hold empty partitions ([0]-shaped) outside a forward, so these
tests read the full weights through `deepspeed.zero.GatheredParameters` themselves
(`_gathered`), independently of the trainer's own gathers (push, save, checkpoints)
that they check.

Tolerances: stage 3 keeps its fp32 parameters and gradients in flat partition buffers
and computes the norm and the Adam update there; stage 0 updates each tensor. Same
maths, fp32 rounding in another order: ~1e-7 relative on the loss and the grad norm,
and the first AdamW update (lr * g / (|g| + eps): about lr = 1e-3 whatever g) differs
by a few fp32 ulps of the weights (|w| < ~1: ulp <= 1.2e-7). Hence atol 2e-6 /
rtol 1e-5 on the weights (the update itself is 1e-3: a wrong update is 500x that).
Save / load round trips are exact (fp32 written and read back): torch.equal.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from test_trainer_step import VOCAB, config, make_samples, tiny_qwen2
from tlt.services.common.ports import free_port
from tlt.services.trainer.checkpoint import CheckpointManager
from tlt.services.trainer.data import PromptSampler, synthetic_prompts
from tlt.services.trainer.policy import Policy, ReferencePolicy
from tlt.services.trainer.step import grpo_step
from tlt.services.trainer.weight_sync import policy_tensors

TESTS = Path(__file__).resolve().parent
ATOL, RTOL = 2e-6, 1e-5
NO_PERSISTENCE = {"stage3_param_persistence_threshold": 0}


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _partition_everything(monkeypatch):
    """DeepSpeed keeps parameters of <= 1e5 elements (every one of these tiny models') whole after their first
    use (stage3_param_persistence_threshold): threshold 0 here, so every parameter really is partitioned."""
    import tlt.services.trainer.policy as policy_mod

    monkeypatch.setattr(policy_mod, "ZERO3_OPTIONS", NO_PERSISTENCE, raising=False)


def tied_qwen2(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0,
    )
    return Qwen2ForCausalLM(cfg)


def _gathered(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full state dict (HF names, tied lm_head included), gathered by the test itself under ZeRO-3."""
    import deepspeed

    params = list(module.parameters())
    partitioned = any(hasattr(p, "ds_id") for p in params)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None) if partitioned else nullcontext():
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_close(got: dict, want: dict, **tol) -> None:
    assert set(got) == set(want), set(got) ^ set(want)
    for k in want:
        assert got[k].shape == want[k].shape, (k, got[k].shape, want[k].shape)
        torch.testing.assert_close(got[k], want[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


def _step(stage: int, model, samples, **kw):
    policy = Policy(config(zero_stage=stage, **kw), model=model)
    res = grpo_step(policy, samples, step=0)
    return policy, res


def test_stage3_partitions_parameters():
    policy = Policy(config(zero_stage=3), model=tiny_qwen2(0))
    assert policy.gathers and not Policy(config(zero_stage=2), model=tiny_qwen2(0)).gathers
    grpo_step(policy, make_samples(2, 4), step=0)
    p = policy.module.model.embed_tokens.weight
    assert p.numel() == 0 and tuple(p.ds_shape) == (VOCAB, 32)  # stage 3 really holds partitions only


def test_one_step_matches_stage_0():
    samples = make_samples(2, 4, seed=3)
    p0, r0 = _step(0, tiny_qwen2(0), samples)
    p3, r3 = _step(3, tiny_qwen2(0), samples)
    assert p3.version == p0.version == 1 and r3.metrics.optimizer_updates == 1
    assert r3.metrics.loss == pytest.approx(r0.metrics.loss, rel=1e-5, abs=1e-7)
    assert r3.metrics.tokens == r0.metrics.tokens
    assert r3.metrics.grad_norm == pytest.approx(r0.metrics.grad_norm, rel=1e-5)  # DeepSpeed's stage-3 norm
    before = _gathered(tiny_qwen2(0))
    after = _gathered(p3.module)
    assert all(not torch.equal(before[k], after[k]) for k in before)  # every parameter moved
    _assert_close(after, _gathered(p0.module), atol=ATOL, rtol=RTOL)


def test_bf16_step_matches_stage_1_and_pushes_bf16():
    """bf16 (the GPU setting, run here on CPU): bf16 module weights, fp32 master partitions in the optimizer."""
    samples = make_samples(2, 4, seed=3)
    p1, r1 = _step(1, tiny_qwen2(0), samples, bf16=True, lr=1e-2)
    p3, r3 = _step(3, tiny_qwen2(0), samples, bf16=True, lr=1e-2)
    assert r3.metrics.loss == pytest.approx(r1.metrics.loss, rel=1e-5, abs=1e-7)
    assert r3.metrics.grad_norm == pytest.approx(r1.metrics.grad_norm, rel=1e-5)
    full = _gathered(p3.module)
    assert all(t.dtype == torch.bfloat16 for t in full.values())
    # both round the same fp32 master weights to bf16; measured identical here, one bf16 ulp allowed
    _assert_close(full, _gathered(p1.module), atol=1e-2, rtol=8e-3)
    _assert_close(policy_tensors(p3.module, torch.bfloat16), full, atol=0, rtol=0)


def test_gradient_clipping_is_applied_at_stage3():
    # See test_trainer_step.test_gradient_clipping_is_applied: clipped to 1e-12 the first AdamW update is ~0.
    lr = 1e-3
    moved = []
    for clip in (1.0, 1e-12):
        policy = Policy(config(zero_stage=3, grad_clip=clip, lr=lr), model=tiny_qwen2())
        before = _gathered(policy.module)
        grpo_step(policy, make_samples(2, 4), step=0)
        after = _gathered(policy.module)
        moved.append(max(float((after[k] - before[k]).abs().max()) for k in before))
    assert moved[0] == pytest.approx(lr, rel=0.01)
    assert moved[1] < lr * 1e-3


@pytest.mark.parametrize("make", [tiny_qwen2, tied_qwen2], ids=["untied", "tied"])
def test_zero3_load_builds_the_model_partitioned(tmp_path, make):
    """From a folder under ZeRO-3 the model is created inside deepspeed.zero.Init: no rank holds it whole."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from tlt.services.trainer.distributed import init_process_group
    from tlt.services.trainer.policy import deepspeed_config, load_hf_model

    init_process_group()
    make(0).save_pretrained(tmp_path / "m")
    model = load_hf_model(str(tmp_path / "m"), torch.float32, deepspeed_config(config(zero_stage=3), 1, False))
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
    assert not is_deepspeed_zero3_enabled()  # switched off again: the reference model loads whole
    _assert_close(_gathered(model), make(0).state_dict(), atol=0, rtol=0)
    if make is tied_qwen2:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_model_dir_reference_and_gradient_checkpointing(tmp_path):
    """Loaded from a folder (zero.Init while loading), with a KL reference and gradient checkpointing."""
    tiny_qwen2(0).save_pretrained(tmp_path / "m")
    samples = make_samples(2, 4, seed=3)
    out = {}
    for stage in (0, 3):
        cfg = config(zero_stage=stage, kl_beta=0.1, gradient_checkpointing=True, model_dir=str(tmp_path / "m"))
        policy = Policy(cfg)
        reference = ReferencePolicy(str(tmp_path / "m"), policy.device, temperature=1.0)
        # the frozen reference is a plain full model, never partitioned by the policy's ZeRO-3 load
        assert all(p.numel() > 0 and not hasattr(p, "ds_id") for p in reference.model.parameters())
        grpo_step(policy, samples, step=0, reference=reference)
        res = grpo_step(policy, make_samples(2, 4, seed=4), step=1, reference=reference)
        assert res.metrics.kl > 0
        out[stage] = (res.metrics, _gathered(policy.module))
    (m0, w0), (m3, w3) = out[0], out[3]
    assert m3.loss == pytest.approx(m0.loss, rel=1e-5, abs=1e-7)
    assert m3.kl == pytest.approx(m0.kl, rel=1e-4)
    _assert_close(w3, w0, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("make", [tiny_qwen2, tied_qwen2], ids=["untied", "tied"])
@pytest.mark.parametrize("persistence", [0, 100], ids=["all-partitioned", "small-ones-whole"])
def test_pushed_tensors_are_the_full_weights(make, persistence, monkeypatch):
    import tlt.services.trainer.policy as policy_mod

    monkeypatch.setattr(policy_mod, "ZERO3_OPTIONS", {"stage3_param_persistence_threshold": persistence},
                        raising=False)
    policy, _ = _step(3, make(0), make_samples(2, 4, seed=3))
    # after the step: the norms (32 elements) whole when under the persistence threshold, the 1536-element
    # embedding partitioned; both must be pushed whole
    assert policy.module.model.norm.weight.numel() == (32 if persistence else 0)
    assert policy.module.model.embed_tokens.weight.numel() == 0
    pushed = policy_tensors(policy.module, torch.float32)
    full = _gathered(policy.module)
    if make is tied_qwen2:
        assert "lm_head.weight" not in pushed  # the rollout ties it to the embedding itself
        full.pop("lm_head.weight")
    assert pushed["model.embed_tokens.weight"].shape == (VOCAB, 32)
    _assert_close(pushed, full, atol=0, rtol=0)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in pushed.values())
    bf16 = policy_tensors(policy.module, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 and t.shape == full[k].shape for k, t in bf16.items())
    _assert_close(policy.state_dict_for_push(), _gathered(policy.module), atol=0, rtol=0)
    # the parameters are partitioned again afterwards (a gather that kept them whole would cost the memory ZeRO-3 saves)
    assert policy.module.model.embed_tokens.weight.numel() == 0


@pytest.mark.parametrize("make", [tiny_qwen2, tied_qwen2], ids=["untied", "tied"])
def test_save_pretrained_writes_a_loadable_hf_folder(tmp_path, make):
    from transformers import AutoModelForCausalLM

    policy, _ = _step(3, make(0), make_samples(2, 4, seed=3))
    policy.save_pretrained(str(tmp_path / "policy"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", local_files_only=True)
    assert all(not hasattr(p, "ds_id") for p in loaded.parameters())
    _assert_close({k: v.detach() for k, v in loaded.state_dict().items()}, _gathered(policy.module), atol=0, rtol=0)
    if make is tied_qwen2:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_checkpoint_resume_is_exact_at_stage3(tmp_path):
    cfg = config(zero_stage=3, warmup_steps=2, lr_schedule="cosine", steps=3)
    items = synthetic_prompts(10, seed=0)
    ckpt = CheckpointManager(tmp_path / "ck", keep=2)

    a = Policy(cfg, model=tiny_qwen2(0))
    sa = PromptSampler(items, seed=0)
    grpo_step(a, make_samples(2, 4, seed=0), step=0)
    sa.next_batch(3)
    ckpt.save(a, sa, steps_done=1)
    losses_a = [grpo_step(a, make_samples(2, 4, seed=s), step=s).metrics.loss for s in (1, 2)]

    b = Policy(cfg, model=tiny_qwen2(seed=7))  # other initial weights: everything must come from the checkpoint
    sb = PromptSampler(items, seed=0)
    state = ckpt.load(b, sb)
    assert state.steps_done == 1 and b.version == 1
    losses_b = [grpo_step(b, make_samples(2, 4, seed=s), step=s).metrics.loss for s in (1, 2)]
    assert losses_b == losses_a
    assert b.version == a.version == 3 and b.lr == pytest.approx(a.lr)
    _assert_close(_gathered(b.module), _gathered(a.module), atol=1e-7, rtol=0)


RANK_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from test_trainer_step import config, make_samples, tiny_qwen2
from test_trainer_zero3 import _gathered
from tlt.services.trainer.checkpoint import CheckpointManager
from tlt.services.trainer.data import PromptSampler, synthetic_prompts
from tlt.services.trainer.policy import Policy
from tlt.services.trainer.step import grpo_step
from tlt.services.trainer.weight_sync import policy_tensors
import tlt.services.trainer.policy as policy_mod
policy_mod.ZERO3_OPTIONS = {{"stage3_param_persistence_threshold": 0}}
cfg = config(micro_batch_size=2, zero_stage=3)
policy = Policy(cfg, model=tiny_qwen2(0))
res = grpo_step(policy, make_samples(2, 4, seed=3), step=0)
pushed = policy_tensors(policy.module, torch.float32)  # collective: every rank takes part, rank 0 gets the tensors
full = _gathered(policy.module)
policy.save_pretrained({saved!r})  # collective as well; rank 0 writes
ckpt = CheckpointManager({ckpt!r})
sampler = PromptSampler(synthetic_prompts(10, seed=0), seed=0)
ckpt.save(policy, sampler, steps_done=1)
res2 = grpo_step(policy, make_samples(2, 4, seed=4), step=1)
b = Policy(cfg, model=tiny_qwen2(7))
ckpt.load(b, PromptSampler(synthetic_prompts(10, seed=0), seed=0))
res2b = grpo_step(b, make_samples(2, 4, seed=4), step=1)
if policy.rank == 0:
    torch.save({{"pushed": pushed, "full": full, "loss": res.metrics.loss, "tokens": res.metrics.tokens,
                "grad_norm": res.metrics.grad_norm, "version": policy.version,
                "shards": policy.module.model.embed_tokens.weight.numel(),
                "after2": _gathered(policy.module), "after2_resumed": _gathered(b.module),
                "loss2": res2.metrics.loss, "loss2_resumed": res2b.metrics.loss}}, {out!r})
else:
    assert pushed == {{}}, "only rank 0 keeps the pushed tensors"
    _gathered(policy.module), _gathered(b.module)  # collective: match rank 0's gathers
from tlt.services.trainer.distributed import shutdown_process_group
shutdown_process_group()  # torn down together: a rank left to exit alone could abort (-6)
"""


# Each rank was a fresh `python -c script`: every one imported torch, transformers' Qwen2, DeepSpeed and (through
# DeepSpeed's optimizer check) torch's inductor, then spent seconds tearing the interpreter down at exit; on the
# 2-core CI machine that was most of each multi-rank test (~14 s a 2-rank test, ~25 s the 3-rank one, of which the
# ranks' own work is 1-3 s). RANK_SERVER imports all that once, and each rank of each run is a fork of it (as the
# rollout's replicas are forks of a forkserver, services/rollout/replica_start.py): a new process with the
# environment, affinity and rendezvous variables the rank was given, running the same script in `__main__`.
RANK_SERVER = r"""
import json, os, sys, traceback
import torch, deepspeed, transformers  # noqa: E401, F401 - what every rank script imports
transformers.Qwen2Config, transformers.Qwen2ForCausalLM  # the lazy modules: the slow part of the import
import tlt.services.trainer.checkpoint, tlt.services.trainer.data, tlt.services.trainer.policy  # noqa: E401, F401
import tlt.services.trainer.step, tlt.services.trainer.weight_sync  # noqa: E401, F401
try:  # imported by DeepSpeed's ZeRO optimizer check in every rank (it imports torch's inductor)
    import deepspeed.runtime.zero.muon.original_muon  # noqa: F401
except ImportError:
    pass
print("RANK_SERVER ready", flush=True)
for line in sys.stdin:  # one run per line: {"script", "ranks": [{"env", "output"}], "affinity"}; EOF: exit
    run = json.loads(line)
    pids = []
    for rank in run["ranks"]:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                out = os.open(rank["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(out, 1)
                os.dup2(out, 2)
                os.environ.clear()
                os.environ.update(rank["env"])
                os.sched_setaffinity(0, run["affinity"])
                sys.argv = ["-c"]
                exec(compile(run["script"], "<rank script>", "exec"), {"__name__": "__main__"})
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    print("RANK_SERVER codes", json.dumps(codes), flush=True)
"""


class _RankServer:
    """RANK_SERVER in its own process group (a hung run is ended by killing the group), its protocol lines read by
    a thread; started at the first run of this pytest process, killed at its exit."""

    def __init__(self) -> None:
        import atexit
        import queue
        import tempfile
        import threading

        self.log = tempfile.NamedTemporaryFile("w+", prefix="rank-server-", suffix=".log")  # noqa: SIM115
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # libgomp reads it when torch loads, before any rank exists
        self.proc = subprocess.Popen([sys.executable, "-c", RANK_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, text=True, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.killed = False
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.kill)  # idle by then; otherwise it would end on its own once its stdin closes

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith("RANK_SERVER "):
                self.lines.put(line.removeprefix("RANK_SERVER ").strip())
        self.lines.put("exited")

    def next_line(self, timeout: float) -> str | None:
        import queue

        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def kill(self) -> None:
        import signal

        if self.killed:  # once: later, the group's id may be another process's
            return
        self.killed = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and every rank it forked
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-2500:]


_rank_server: _RankServer | None = None


def run_two_ranks(script: str, timeout: float = 300, ranks: int = 2) -> None:
    """`script` as ranks 0 and 1 (0 .. ranks - 1) of a gloo group on 127.0.0.1, each a fork of RANK_SERVER with this
    process's environment plus the rank's rendezvous variables and OMP_NUM_THREADS=1; fails with every rank's
    output tail (or, on a timeout, kills the ranks)."""
    import json
    import tempfile

    global _rank_server
    if _rank_server is None or _rank_server.proc.poll() is not None:
        _rank_server = _RankServer()
        ready = _rank_server.next_line(300)
        assert ready == "ready", f"the rank server did not start ({ready}):\n{_rank_server.tail()}"
    server = _rank_server
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        outputs = [Path(tmp) / f"rank{rank}.log" for rank in range(ranks)]
        run = {"script": script, "affinity": sorted(os.sched_getaffinity(0)), "ranks": [
            {"output": str(outputs[rank]),
             "env": {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks),
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}}
            for rank in range(ranks)]}
        server.proc.stdin.write(json.dumps(run) + "\n")  # type: ignore[union-attr]
        server.proc.stdin.flush()  # type: ignore[union-attr]
        reply = server.next_line(timeout)
        if reply is None or not reply.startswith("codes "):
            server.kill()
            _rank_server = None
        texts = [o.read_text(errors="replace") if o.exists() else "" for o in outputs]
    assert reply is not None, f"the ranks did not finish in {timeout}s:\n" + "\n".join(
        f"--- rank {r}:\n{t[-2500:]}" for r, t in enumerate(texts))
    assert reply.startswith("codes "), f"the rank server died ({reply}):\n{server.tail()}"
    codes = json.loads(reply.removeprefix("codes "))
    assert codes == [0] * ranks, "\n".join(f"--- rank {r} exited {c}:\n{t[-2500:]}" for r, (c, t) in
                                       enumerate(zip(codes, texts)))


def test_two_ranks_at_stage3_match_one_rank(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "rank0.pt"
    t0 = time.perf_counter()
    run_two_ranks(RANK_SCRIPT.format(tests=str(TESTS), out=str(out), saved=str(tmp_path / "policy"),
                                      ckpt=str(tmp_path / "ck")))
    two = torch.load(out)
    print(f"two ranks: {time.perf_counter() - t0:.1f}s")
    one = Policy(config(micro_batch_size=4), model=tiny_qwen2(0))  # one rank, stage 0: the reference update
    res = grpo_step(one, make_samples(2, 4, seed=3), step=0)
    assert two["version"] == 2 and two["shards"] == 0
    assert two["tokens"] == res.metrics.tokens
    assert two["loss"] == pytest.approx(res.metrics.loss, rel=1e-5, abs=1e-7)
    assert two["grad_norm"] == pytest.approx(res.metrics.grad_norm, rel=1e-4)
    want = _gathered(one.module)
    _assert_close(two["full"], want, atol=ATOL, rtol=RTOL)
    _assert_close(two["pushed"], two["full"], atol=0, rtol=0)  # what the rollout would get: the full weights
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", local_files_only=True)
    _assert_close({k: v.detach() for k, v in loaded.state_dict().items()}, two["full"], atol=0, rtol=0)
    # two ranks' checkpoint (each rank's partition) resumed into fresh ranks: the same next step
    assert two["loss2_resumed"] == two["loss2"]
    _assert_close(two["after2_resumed"], two["after2"], atol=0, rtol=0)


def test_one_rank_stage3_loop_against_a_rollout_server(random_model_dir, tmp_path, monkeypatch):
    """The loop at stage 3: pushes gathered weights the rollout then samples with, and exports a loadable folder."""
    import json

    from transformers import AutoModelForCausalLM

    from rollout_helpers import ServerThread
    from test_trainer_loop import config as loop_config
    from tlt.services.rollout.client import RolloutClient
    from tlt.services.trainer.loop import train

    # a random model's answers all score 0 (no gradient, weights that never move): score the token ids' parity
    (tmp_path / "parity_reward.py").write_text(
        "def reward(prompts, completions, completion_ids, **kw):\n"
        "    return [float(sum(i) % 2) for i in completion_ids]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with ServerThread(random_model_dir, replicas=1) as server:
        summary = train(loop_config(random_model_dir, server.grpc_address, tmp_path / "run", zero_stage=3,
                                    reward="python", reward_function="parity_reward:reward"))
        with RolloutClient(server.grpc_address) as client:
            serving = client.status().versions.policy
    assert summary.steps_done == 2 and summary.policy_version == 2 and serving == 2
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy_version"] for m in lines] == [1, 2]
    # step 1 sampled with the weights pushed after step 0 and the trainer scored them with its own: an empty or
    # partial push would be refused by the server (shapes) or show here as a logprob gap
    assert all(m["rollout_logprob_max_diff"] < 1e-3 and m["grad_norm"] > 0 for m in lines)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "policy", local_files_only=True)
    start = AutoModelForCausalLM.from_pretrained(random_model_dir, local_files_only=True)
    moved = [k for k, v in start.state_dict().items() if not torch.equal(v, loaded.state_dict()[k])]
    assert moved and (tmp_path / "run" / "policy" / "tokenizer.json").exists()


LOOP_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.loop import train
import tlt.services.trainer.policy as policy_mod
policy_mod.ZERO3_OPTIONS = {{"stage3_param_persistence_threshold": 0}}  # gathers are collectives for every weight
cfg = TrainerConfig(model_dir={model!r}, rollout_addresses=[{address!r}], output_dir={out!r}, prompts_per_step=2,
                    n_samples=4, max_tokens=8, mini_batch_size=8, micro_batch_size=2, zero_stage=3, lr=1e-3,
                    steps={steps}, checkpoint_interval=1, synthetic_problems=32, connect_timeout_s=60)
s = train(cfg)
print("SUMMARY", s.steps_done, s.policy_version)
from tlt.services.trainer.distributed import shutdown_process_group
shutdown_process_group()  # torn down together: a rank left to exit alone could abort (-6)
"""


@pytest.mark.slow  # two trainer ranks and a rollout server, twice: a few minutes on two cores
def test_two_rank_stage3_loop_pushes_exports_and_resumes(random_model_dir, tmp_path):
    """Only rank 0 talks to the rollout, but every rank must take part in the ZeRO-3 gathers (no deadlock)."""
    import json

    from transformers import AutoModelForCausalLM

    from rollout_helpers import ServerThread
    from tlt.services.rollout.client import RolloutClient

    out = tmp_path / "run"
    for steps in (2, 3):  # the second run resumes after 2 steps against a fresh server: the sync push
        with ServerThread(random_model_dir, replicas=1) as server:
            script = LOOP_SCRIPT.format(model=str(random_model_dir), address=server.grpc_address, out=str(out),
                                        steps=steps)
            run_two_ranks(script, timeout=500)
            with RolloutClient(server.grpc_address) as client:
                serving = client.status().versions.policy
        assert serving == steps
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]
    loaded = AutoModelForCausalLM.from_pretrained(out / "policy", local_files_only=True)
    w = loaded.model.embed_tokens.weight
    assert w.numel() > 0 and torch.isfinite(w).all()


TIED_SCRIPT = """
import sys, torch
import torch.distributed as dist
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from test_trainer_step import config, make_samples
from test_trainer_zero3 import _gathered, tied_qwen2
from tlt.services.trainer.policy import Policy
from tlt.services.trainer.step import grpo_step
import tlt.services.trainer.policy as policy_mod
policy_mod.ZERO3_OPTIONS = {{"stage3_param_persistence_threshold": 0}}
policy = Policy(config(micro_batch_size=2, zero_stage=3), model=tied_qwen2(0))
grpo_step(policy, make_samples(2, 4, seed=3), step=0)
state = policy.state_dict_for_push()  # collective: every rank, rank 0 keeps
policy.save_pretrained({saved!r})  # collective: every rank, rank 0 writes
full = _gathered(policy.module)  # the ranks are still in step: one more gather of every parameter together
marker = torch.tensor([float(policy.rank + 1)])
dist.all_reduce(marker)
assert marker.item() == 3.0, marker
if policy.rank == 0:
    torch.save({{"state": state, "full": full}}, {out!r})
else:
    assert state == {{}}, "only rank 0 keeps the gathered tensors"
"""


def test_two_ranks_gather_a_tied_model_in_step(tmp_path):
    """A tied lm_head is the embedding's parameter under a second name: gathered once on every rank. Rank 0, which
    keeps the tensors, reused its copy for the second name; the others gathered it again, an all-gather rank 0 never
    joined (the export of a tied model, Qwen2.5-0.5B's kind, hung or crossed the next collective)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "rank0.pt"
    run_two_ranks(TIED_SCRIPT.format(tests=str(TESTS), out=str(out), saved=str(tmp_path / "policy")), timeout=180)
    two = torch.load(out)
    assert two["state"]["lm_head.weight"] is two["state"]["model.embed_tokens.weight"]
    _assert_close(two["state"], two["full"], atol=0, rtol=0)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", local_files_only=True)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    _assert_close({k: v.detach() for k, v in loaded.state_dict().items()}, two["full"], atol=0, rtol=0)


EPOCHS_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from test_trainer_step import config, make_samples, tiny_qwen2
from test_trainer_zero3 import _gathered
from tlt.services.trainer.policy import Policy
from tlt.services.trainer.step import grpo_step
import tlt.services.trainer.policy as policy_mod
policy_mod.ZERO3_OPTIONS = {{"stage3_param_persistence_threshold": 0}}
cfg = config(prompts_per_step=3, n_samples=4, mini_batch_size=6, micro_batch_size=2, ppo_epochs=2, zero_stage=3)
policy = Policy(cfg, model=tiny_qwen2(0))
losses = [grpo_step(policy, make_samples(3, 4, seed=s), step=s).metrics.loss for s in range(3)]
full = _gathered(policy.module)
if policy.rank == 0:
    torch.save({{"losses": losses, "full": full}}, {out!r})
"""


def test_three_ranks_at_stage3_with_ppo_epochs_match_one_rank(tmp_path):
    """ppo_epochs = 2 over W = 3 ranks: a rank's later passes train on sequences of other ranks' first pass, and
    each needs their old logprobs. At stage 3 every forward is a collective (each layer's weights all-gathered),
    so each rank must run as many no-grad forwards as the others: one over the union of its sequences of every
    pass ran 3 on one rank and 4 on another at step 2 here (with 2 ranks the unions are always the same size)."""
    out = tmp_path / "rank0.pt"
    run_two_ranks(EPOCHS_SCRIPT.format(tests=str(TESTS), out=str(out)), timeout=240, ranks=3)
    three = torch.load(out)
    one = Policy(config(prompts_per_step=3, n_samples=4, mini_batch_size=6, micro_batch_size=2, ppo_epochs=2),
                 model=tiny_qwen2(0))  # one rank, stage 0: the reference updates
    losses = [grpo_step(one, make_samples(3, 4, seed=s), step=s).metrics.loss for s in range(3)]
    assert three["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-6)
    _assert_close(three["full"], _gathered(one.module), atol=2e-5, rtol=1e-4)
