"""Held-out accuracy of the policy, measured through the rollout server while training runs.

    eval prompts (the synthetic task's held-out draw, or eval_data_path)
      -> collect(n = eval_samples, temperature = eval_temperature)   same rollout + reward path as a step
      -> correct completions per problem (`correct`) and their share (`accuracy`) -> EvalRecord -> one line of
         runs/<id>/eval.jsonl
    with eval_greedy and eval_temperature > 0, then collect(n = 1, temperature 0) -> greedy_correct, greedy_accuracy
    (at eval_temperature 0 the first pass is greedy: greedy_accuracy = accuracy, no second pass)

`change(first, last)` pairs two evals of a run by problem: the difference of accuracies with its standard error,
which the report (plots/heldout.png) and `tlt run`'s closing line give.

Greedy and sampled accuracy answer different questions: greedy is a deployment's
pass@1, sampled (at the training temperature) is what the RL objective
optimises. On the tiny model sampled accuracy stayed flat over 50-step runs
while greedy accuracy rose in most, so eval_greedy records both on one learning curve.

When: before the first step (after 0 steps), after every `eval_interval`
steps, and after the last step. A step's rollout accuracy moves with the mix
of prompts it happened to draw; the eval set is fixed, so two evals differ
only by the policy (and, with eval_temperature > 0, by sampling noise). The
synthetic held-out draw is the one `tlt model eval` uses (seed
EVAL_SEED_OFFSET), independent of the trainer's seed, so runs with different
seeds are scored on the same problems. Its requests are seeded as a step's
(`sampling_seed` and the server's place: collect.request_seed), with one key,
"eval", for every eval of the run: common random numbers. Each sample's token at
position t is the inverse CDF of the policy's distribution at the same uniform
in every eval, so two evals of one policy sample the same completions and two
evals of nearby policies differ only where the policy moved. Each eval is still
an unbiased estimate of the policy's accuracy; the change between evals is
measured with far less noise than independent draws would give (the learning
curve is what the eval is for). A resumed run repeats the evals of the
uninterrupted one. The requests are `reproducible` (SamplingParams): under
speculative decoding they take the tree walk, which emits plain decoding's
tokens for the same uniforms, not rejection-sampled chains, whose tokens also
depend on the drafter (which the online drafter service changes between evals:
a TLT run's first eval now equals an SD-off run's problem by problem). The SGLang backend
ignores the flag: its evals pair only as far as SGLang's own sampling repeats.

Eval time is not part of any step's time (it runs after the step's metrics
line is written) and is recorded in the record itself.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tlt.services.trainer.config import TrainerConfig
from tlt.services.trainer.run_stats import read_jsonl, trim_jsonl
from tlt.services.trainer.types import PromptItem

if TYPE_CHECKING:
    from tlt.model.evaluate import PairedDifference
    from tlt.services.trainer.weight_sync import VersionGuard


EVAL_SEED_KEY = "eval"  # every eval's requests are seeded from it (common random numbers: see above)


@dataclass(frozen=True)
class EvalRecord:
    after_steps: int  # RL steps done when evaluated (0: the initial policy)
    policy_version: int
    accuracy: float  # correct / (problems x samples)
    problems: int
    samples: int
    temperature: float
    seconds: float  # both passes (the sampled one and, with eval_greedy, the greedy one)
    started_at: float = 0.0  # unix time the eval began (0: a record from before it was kept)
    greedy_accuracy: float | None = None  # one greedy completion per problem (eval_greedy; None: off, or an old record)
    # per eval problem, in the eval set's order: how many of its `samples` were correct, and whether its greedy
    # completion was (0 / 1): what `change` pairs two evals by. None: a record from before they were kept.
    correct: tuple[int, ...] | None = None
    greedy_correct: tuple[int, ...] | None = None
    eval_set: str = ""  # `eval_set_digest` of the problems scored ("": a record from before it was kept)

    def as_dict(self) -> dict:
        return asdict(self)


def change(first: EvalRecord, last: EvalRecord) -> dict[str, PairedDifference]:
    """`last` minus `first` accuracy, paired by problem, with its standard error: "sampled" and (when both evals
    scored it) "greedy". Two evals of a run score the same problems with the same random numbers, so the problems'
    difficulty and most of the draw cancel and the s.e. is a fraction of an accuracy's own. Empty when either
    record has no per-problem counts (an eval.jsonl line from before they were kept), the two were not scored
    alike (another temperature, samples per problem or problem count, or other problems by their `eval_set` digest:
    a resumed run's changed settings or eval data), or they are one record (a run with a single eval)."""
    from tlt.model.evaluate import paired_counts

    out: dict[str, PairedDifference] = {}
    if first is last or (first.temperature, first.samples, first.problems) != (last.temperature, last.samples,
                                                                               last.problems):
        return out
    if first.eval_set and last.eval_set and first.eval_set != last.eval_set:
        return out
    for name, a, b, n in (("sampled", first.correct, last.correct, first.samples),
                          ("greedy", first.greedy_correct, last.greedy_correct, 1)):
        if a is not None and b is not None and len(a) == len(b) >= 2:
            out[name] = paired_counts(b, n, a, n)
    return out


def change_text(first: EvalRecord, last: EvalRecord, name: str) -> str:
    """' (+0.012, paired s.e. 0.008)' for `change`'s `name`, or '' when it cannot be computed."""
    d = change(first, last).get(name)
    return "" if d is None else f" ({d.mean:+.3f}, paired s.e. {d.se:.3f})"


def eval_set_digest(items: list[PromptItem]) -> str:
    """The eval problems' `items_fingerprint` (16 hex digits): two evals pair by problem only over the same ones. A
    resumed run whose eval_data_path now holds other rows of the same count scored other problems."""
    from tlt.services.trainer.data import items_fingerprint

    return items_fingerprint(items)[:16]


def eval_items(cfg: TrainerConfig) -> list[PromptItem]:
    """The fixed eval set: the first eval_problems of eval_data_path (read as data_path is: its answer at
    eval_answer_field, chat prompts rendered with model_dir's template), else the synthetic held-out draw."""
    if cfg.eval_data_path:
        from tlt.services.trainer.data import DataError, load_prompts

        items = load_prompts(cfg.eval_data_path, cfg.eval_answer_field or cfg.answer_field, cfg.model_dir)
        if len(items) < cfg.eval_problems:
            raise DataError(f"{cfg.eval_data_path}: {len(items)} prompts, eval_problems asks for {cfg.eval_problems}")
        items = items[: cfg.eval_problems]
        if cfg.reward == "task":  # as trainer_prompts: refused now, not at the first eval, eval_every steps in
            from tlt.services.trainer.rewards import task_reference_problem

            if (problem := task_reference_problem(items, cfg.eval_data_path)) is not None:
                raise DataError(problem)
        return items
    from tlt.model.evaluate import EVAL_SEED_OFFSET
    from tlt.task import format_prompt, generate_problems

    problems = generate_problems(cfg.eval_problems, EVAL_SEED_OFFSET)
    return [PromptItem(i, format_prompt(p), p.answer) for i, p in enumerate(problems)]


def sampling_seed(cfg: TrainerConfig) -> int:
    """The seed the run's rollout requests are seeded from (collect.request_seed): sampling_seed, else seed."""
    return cfg.seed if cfg.sampling_seed is None else cfg.sampling_seed


def due(cfg: TrainerConfig, steps_done: int) -> bool:
    """Evaluate after `steps_done` steps? (0 = before training.)"""
    if cfg.eval_problems == 0:
        return False
    return steps_done == 0 or steps_done == cfg.steps or steps_done % cfg.eval_interval == 0


def run_eval(items: list[PromptItem], clients, rewards, cfg: TrainerConfig, steps_done: int,  # noqa: ANN001
             version: int, check_version: bool = True, guard: VersionGuard | None = None) -> EvalRecord:
    """Score the eval set with the policy the rollout server(s) serve now (checked to be `version`; by `guard`, a
    weight_sync.VersionGuard, where given: a server restarted since the push gets the weights again)."""
    t0, started_at = time.perf_counter(), time.time()
    correct = _pass(items, clients, rewards, cfg, cfg.eval_samples, cfg.eval_temperature, f"eval{steps_done}",
                    version, check_version, guard)
    accuracy = sum(correct) / (len(items) * cfg.eval_samples)
    greedy, greedy_accuracy = None, None
    if cfg.eval_greedy:  # at T = 0 the pass above was greedy already: its accuracy is the greedy one (its counts
        # are the sampled pass's; `change` pairs them as such, so no greedy counts of their own)
        if cfg.eval_temperature == 0:
            greedy_accuracy = accuracy
        else:
            greedy = _pass(items, clients, rewards, cfg, 1, 0.0, f"eval{steps_done}-greedy", version, check_version,
                           guard)
            greedy_accuracy = sum(greedy) / len(items)
    return EvalRecord(steps_done, version, accuracy, len(items), cfg.eval_samples, cfg.eval_temperature,
                      time.perf_counter() - t0, started_at, greedy_accuracy, correct, greedy, eval_set_digest(items))


def _pass(items: list[PromptItem], clients, rewards, cfg: TrainerConfig, n: int, temperature: float,  # noqa: ANN001
          label: str, version: int, check_version: bool, guard: VersionGuard | None = None) -> tuple[int, ...]:
    """Per eval problem, how many of `n` completions at `temperature` are correct. Seeded as a step's (`sampling_seed`),
    from EVAL_SEED_KEY (greedy draws nothing, but a seedless request would be the odd one out); `label` names the
    server batch. A replica death is redone, as in a step."""
    from tlt.services.trainer.collect import collect_retrying, sampling_params
    from tlt.services.trainer.weight_sync import check_versions

    params = sampling_params(cfg.max_tokens, temperature, 1.0, seed=sampling_seed(cfg))
    params.reproducible = True  # plain decoding's tokens for these uniforms whatever the drafter (see the docstring)
    def roll_out():  # noqa: ANN202
        return collect_retrying(items, clients, rewards, n, params, label, cfg.rollout_retries,
                                cfg.rollout_retry_wait_s, seed_key=EVAL_SEED_KEY)

    if guard is not None:
        result = guard.collect(roll_out, version)
    else:
        result = roll_out()
        if check_version:
            check_versions((s.policy_version for s in result.samples), version)
    counts = [0] * len(items)
    for s in result.samples:  # prompt_index: the problem's place in `items`
        counts[s.prompt_index] += bool(s.correct)
    return tuple(counts)


def read_evals(path: Path) -> list[EvalRecord]:
    out = []
    for r in read_jsonl(path):
        for key in ("correct", "greedy_correct"):  # JSON lists back to the record's tuples
            if r.get(key) is not None:
                r[key] = tuple(r[key])
        out.append(EvalRecord(**r))
    return out


def trim_evals(path: Path, steps_done: int) -> None:
    """Keep the evals a trainer that starts after `steps_done` steps keeps: on a resume those up to its checkpoint
    (later ones are the killed run's, run again), atomically; on a fresh start (0) none (step 0's is run again).
    The trainer does it as it starts (loop.py), and `tlt run` before, so that it shows each eval once."""
    if steps_done:
        trim_jsonl(path, lambda r: r["after_steps"] <= steps_done)
    else:
        path.unlink(missing_ok=True)
