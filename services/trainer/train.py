"""`tlt train`: run the GRPO trainer against running rollout (and reward) services.

    export TLT_AUTH_TOKEN=$(openssl rand -hex 32)   # the rollout applies only pushes that carry it
    tlt rollout serve --model artifacts/tiny --grpc-port 50051 &
    tlt reward serve --port 50061 &                  # cpu-tiny scores with reward = "grpc"
    tlt train --config cpu-tiny --set steps=10 --set output_dir=runs/demo

Config: the [trainer] section of the preset or TOML file given with --config
(default cpu-tiny), then TLT_TRAINER__* environment variables, then
`--set field=value`. Several ranks: `deepspeed --num_gpus N --module tlt.cli
train --config ...` (rank 0 talks to the services). Writes output_dir/metrics.jsonl (one line per step),
output_dir/checkpoints/ (resumed automatically) and output_dir/policy (the
trained model as a Hugging Face folder).
"""

from __future__ import annotations

import argparse

from tlt.services.common.signals import unwind_on_termination


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="cpu-tiny", help="preset name or path to a .toml file ([trainer] section)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a [trainer] field; repeatable")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    # The DeepSpeed launcher appends --local_rank=N (unless --no_local_rank); the rank
    # is read from the environment it also sets, so the flag is accepted and ignored.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    import json

    from tlt.services.common.config import cli_overrides, load_config
    from tlt.services.common.logging import get_logger
    from tlt.services.trainer.config import TrainerConfig

    cfg = load_config(TrainerConfig, "trainer", args.config, cli_overrides(args.overrides), require_section=True)
    if args.print_config:
        print(json.dumps(cfg.model_dump(), indent=2))
        return 0
    if cfg.reward == "python":  # a reward function that cannot be imported: say so before loading the model
        from tlt.services.trainer.rewards import RewardFunctionError, load_function

        try:
            load_function(cfg.reward_function)
        except RewardFunctionError as e:
            get_logger("trainer").error("train_refused", error=str(e))
            return 2
    from tlt.services.rollout.client import ControlRefusedError, WeightPushError
    from tlt.services.trainer.checkpoint import CheckpointError
    from tlt.services.trainer.collect import RolloutError
    from tlt.services.trainer.data import DataError
    from tlt.services.trainer.loop import train
    from tlt.services.trainer.policy import ModelMismatchError
    from tlt.services.trainer.rewards import RewardError, RewardFunctionFailed
    from tlt.services.trainer.checkpoint import CheckpointWriteError
    from tlt.services.trainer.weight_sync import PushDtypeError, StaleWeightsError

    try:
        with unwind_on_termination("train_terminated", "trainer"):
            summary = train(cfg)
    except (ControlRefusedError, RolloutError, RewardError) as e:  # what to fix is in the message: no traceback
        if isinstance(e, RewardFunctionFailed) and e.__cause__ is not None:  # the user's own code: where it raised
            import traceback

            traceback.print_exception(e.__cause__)
        get_logger("trainer").error("train_failed", error=str(e))
        return 1
    except StaleWeightsError as e:  # another trainer pushed to the server; or a second push did not mend it
        get_logger("trainer").error("train_failed", error=str(e), hint="the rollout server's weights are not this "
                                    "trainer's (another trainer pushing to it, or a restarted server still stale after "
                                    "the trainer pushed to it again); run the same command again: "
                                    "the trainer resumes from its checkpoint and pushes its weights first")
        return 1
    except WeightPushError as e:  # refused: too large, another model's tensors, a replica down; the message says which
        get_logger("trainer").error("train_failed", error=str(e))
        return 1
    except CheckpointWriteError as e:  # a full disk: where, and that the run resumes from its last whole checkpoint
        get_logger("trainer").error("train_failed", error=str(e))
        return 1
    except (DataError, CheckpointError, ModelMismatchError, PushDtypeError) as e:  # the user's data, folders, dtypes
        get_logger("trainer").error("train_refused", error=str(e))
        return 2
    from tlt.services.trainer.distributed import shutdown_process_group

    shutdown_process_group()  # every rank finished: torn down together, not at each one's exit
    get_logger("trainer").info("train_done", steps=summary.steps_done, policy_version=summary.policy_version,
                               resumed_from=summary.resumed_from, output_dir=summary.output_dir)
    return 0


