"""Where a speculative step's time goes on the GPU: one `learned` run of the tail workload under torch.profiler.

    python3 deploy/gpu_profile.py [bench rollout flags...]   e.g. --kernels triton --graphs cuda

Parses the flags of `tlt bench rollout` (defaults: issue #4's tail command on artifacts/tiny with
artifacts/drafter-tiny, on cuda in bf16), warms one `off` and one `learned` run up untimed, then profiles one
`off` and one `learned` run and prints each one's wall time and top operators by self CPU time and by self device
time.
Run by deploy/gpu_check.sh on a GPU machine; on a CPU (`--device cpu --clock cpu`) it profiles the CPU path.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    from torch.profiler import ProfilerActivity, profile

    from tlt.bench import rollout
    from tlt.bench.rollout_workload import task_requests
    from tlt.services.rollout.engine.engine import LLMEngine

    parser = argparse.ArgumentParser()
    rollout.add_arguments(parser)
    tail = ["--model", "artifacts/tiny", "--drafter", "artifacts/drafter-tiny", "--workload", "task", "--min-tokens",
            "100", "--prompts", "4", "--n", "1", "--max-tokens", "256", "--arms", "12_1_13,8_1_9,5_1_6,plain",
            "--threshold", "16", "--temperature", "1.0", "--device", "cuda", "--dtype", "bfloat16"]
    args = parser.parse_args(tail + argv)
    requests, prompt_len = task_requests(args.model, args)
    _, bucket_arms, given = rollout._bucket_arms(args)

    def engine(mode: str) -> LLMEngine:  # as `tlt bench rollout` builds each run's engine
        return rollout.build_engine(args.model, args, mode, sum(r.n for r in requests),
                                    prompt_len + args.max_tokens + 64, bucket_arms, given)

    for mode in ("off", "learned"):
        rollout._warm_up(engine(mode), requests)
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for mode in ("off", "learned"):
        e = engine(mode)
        with profile(activities=activities) as prof:
            _, measured = rollout._run_mode(e, requests, args.threshold)
        stats = e.stats().spec or {}
        print(f"== {mode}: {measured['wall']:.3f} s wall, {measured['steps']} steps, {measured['verify_steps']} verify steps, "
              f"emitted {stats.get('emitted_tokens')}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        if cuda:
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
