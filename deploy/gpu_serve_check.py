"""The rollout server on a GPU, end to end: `tlt rollout serve` with adaptive speculation, its greedy completions
checked against `transformers` `generate` on the same GPU.

    python3 deploy/gpu_serve_check.py [--device cuda] [--kernels triton] [--graphs cuda] [--requests 16]

Starts `tlt rollout serve --model artifacts/tiny --drafter artifacts/drafter-tiny --spec adaptive` as a child on
free loopback ports (fp32, so that greedy tokens can be compared with `transformers`), sends `--requests` greedy
completions of task prompts at once over the OpenAI HTTP API, and requires every completion's text to equal the
text of `transformers` greedy decoding of the same prompt (an independent reference: speculation on, lossless).
Prints the speculative-decoding lines of `/metrics`. Exit status 0 when every completion matches, 1 otherwise,
2 when the server did not start. Run by `bash deploy/gpu_check.sh serve` on a GPU machine; on a CPU
(`--device cpu --kernels torch --graphs off`) it checks the same path on the CPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="artifacts/tiny")
    parser.add_argument("--drafter", default="artifacts/drafter-tiny")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--kernels", default="triton", choices=("auto", "torch", "triton"))
    parser.add_argument("--graphs", default="cuda", choices=("off", "cuda", "emulate"))
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the server to start")
    args = parser.parse_args(argv)
    # `timeout` ends this check with SIGTERM: exit through the finally below, which stops the server and its
    # replicas (Python's default would leave them holding the GPU for the next step)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import httpx
    import torch
    import transformers

    from tlt.cli import tlt_command
    from tlt.services.trainer.procs import ServiceError, ServiceProcess
    from tlt.task import format_prompt, generate_problems

    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    prompts = [format_prompt(p) for p in generate_problems(args.requests, 11)]
    work = Path(tempfile.mkdtemp(prefix="tlt-serve-check-"))
    server = ServiceProcess("rollout", tlt_command(
        "rollout", "serve", "--model", args.model, "--drafter", args.drafter, "--spec", "adaptive", "--replicas", "1",
        "--http-port", "0", "--grpc-port", "0", "--ready-file", str(work / "ready.json"),
        "--set", f"engine.device={args.device}", "--set", "engine.dtype=float32",
        "--set", f"engine.kernels={args.kernels}", "--set", f"engine.decode_graphs={args.graphs}",
        "--set", "engine.max_model_len=512", "--set", "engine.max_num_seqs=32"), work / "serve.log",
        ready_file=work / "ready.json",
        env={"TLT_AUTH_TOKEN": os.environ.get("TLT_AUTH_TOKEN") or "gpu-serve-check-" + os.urandom(4).hex()})
    t0 = time.monotonic()
    server.start()
    try:
        try:
            info = server.wait_ready(t0 + args.timeout)
        except ServiceError as e:
            print(f"the server did not start: {e}")
            return 2
        print(f"server up in {time.monotonic() - t0:.1f} s: {' '.join(server.argv[server.argv.index('rollout'):])}")
        base = f"http://127.0.0.1:{info['http_port']}"
        model_name = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]

        def complete(prompt: str) -> str:
            body = {"model": model_name, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0}
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            response.raise_for_status()
            return response.json()["choices"][0]["text"]

        t1 = time.monotonic()
        with ThreadPoolExecutor(len(prompts)) as pool:  # at once: the running batch shrinks through SD's range
            got = list(pool.map(complete, prompts))
        served_s = time.monotonic() - t1
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model).eval().to(args.device)
        want = []
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([tok.encode(prompt)], device=args.device)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens,
                                     do_sample=False)
                want.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        same = sum(g == w for g, w in zip(got, want))
        print(f"{same} of {len(prompts)} greedy completions equal transformers' ({served_s:.2f} s for the batch)")
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                print(f"  request {i}: served {g!r}\n  {'':>{len(str(i)) + 9}}reference {w!r}")
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        for line in metrics.splitlines():
            if line.startswith(("rollout_spec_arm_verify_steps_total", "rollout_spec_arm_accept_len")):
                print("  " + line)
        return 0 if same == len(prompts) else 1
    finally:
        server.stop(30)  # SIGTERM to its process group (the server stops its replicas), SIGKILL after 30 s
        shutil.rmtree(work, ignore_errors=True)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
