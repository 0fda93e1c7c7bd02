"""`tlt rollout serve`: run the rollout server (OpenAI HTTP + gRPC) over N engine replicas.

    tlt rollout serve --model artifacts/tiny --replicas 2 --http-port 8000 --grpc-port 50051

Config: the [rollout] section of the preset (default cpu-tiny), then
TLT_ROLLOUT__* environment variables, then `--set field=value` (dotted for
the nested engine and spec configs: `--set engine.max_num_seqs=32`,
`--set spec.threshold=16`), then the explicit
flags. `--ready-file PATH` writes JSON {http_port, grpc_port, pid,
replica_pids} once every replica is serving (useful with port 0). Stops
cleanly on SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tlt.cli_args import out_file

    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder (config.json, safetensors, tokenizer)")
    parser.add_argument("--replicas", type=int, default=None,
                        help="engine replicas, one process each (default: the preset's; 1 in cpu-tiny)")
    parser.add_argument("--host", default=None, help="bind address (default: the preset's, 127.0.0.1)")
    parser.add_argument("--http-port", "--port", dest="http_port", type=int, default=None,
                        help="OpenAI HTTP port (0: a free one; default: the preset's, 8000); --port as in vLLM")
    parser.add_argument("--grpc-port", type=int, default=None,
                        help="gRPC port (0: a free one; default: the preset's, 50051)")
    parser.add_argument("--backend", default=None, help="engine backend: native (default) or sglang")
    parser.add_argument("--spec", default=None, choices=("off", "static", "adaptive"),
                        help="speculative decoding mode (default from the preset: adaptive); "
                        "with --backend sglang it sets [sglang] fields")
    parser.add_argument("--spec-threshold", type=int, default=None, metavar="N",
                        help="speculate only while the running batch is <= N (default: the preset's; 16 in cpu-tiny, "
                        "32 in 1gpu and 8gpu)")
    parser.add_argument("--spec-arms", default=None, metavar="ARMS",
                        help="arms steps_topk_drafttokens, comma-separated (e.g. 8_4_48,8_4_32,8_4_16,8_4_8; 'plain' "
                        "does not speculate). adaptive: every batch-size bucket chooses among them, or give one list "
                        "per bucket with '/' between buckets; static: the one arm it runs")
    parser.add_argument("--drafter", default=None,
                        help="learned EAGLE drafter folder (else the model-free n-gram drafter); "
                        "with --backend sglang a `tlt drafter export --format sglang-eagle` folder")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model name the OpenAI API serves and answers with (default: the folder's name); "
                        "one name: vLLM's several aliases are refused")
    parser.add_argument("--max-model-len", type=human_readable_int, default=None, metavar="N",
                        help="context length in tokens, as vLLM reads it (1k = 1000, 1K = 1024) (engine.max_model_len, "
                        "[sglang] context_length; default: the model's, capped by the preset's)")
    parser.add_argument("--dtype", type=vllm_dtype, default=None, metavar="DTYPE",
                        help="weights and activations: float32 (float), bfloat16 or float16 (half) (engine.dtype; "
                        "vLLM's 'auto' only with --backend sglang, [sglang] dtype; default: the preset's)")
    parser.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                        help="most sequences one replica decodes together (engine.max_num_seqs, [sglang] "
                        "max_running_requests)")
    parser.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1/* (as vLLM's --api-key, one key; any user of "
                        "this machine can read it in `ps`: $TLT_API_KEY keeps it out of sight)")
    parser.add_argument("--preset", default="cpu-tiny", help="config preset name or .toml path")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a [rollout] field (engine.* and spec.* for the nested sections); repeatable")
    parser.add_argument("--insecure-local", action="store_true", default=None,
                        help="with no control token (TLT_AUTH_TOKEN), allow UpdateWeights anyway; loopback only")
    parser.add_argument("--ready-file", type=out_file, default=None,
                        help="write the bound ports and pids here as JSON when ready")


NESTED = ("engine", "spec")  # [rollout.engine], [rollout.spec]
VLLM_DTYPES = {"half": "float16", "float": "float32"}  # vLLM's --dtype aliases
VLLM_ENGINE_FLAGS = {"max_model_len": "context_length", "dtype": "dtype", "max_num_seqs": "max_running_requests"}


def vllm_dtype(text: str) -> str:
    """`--dtype` as vLLM takes it: half = float16, float = float32 (the engine's config checks the rest)."""
    return VLLM_DTYPES.get(text, text)


def human_readable_int(text: str) -> int:
    """`--max-model-len` as vLLM reads it (vllm/utils/argparse_utils.py): k, m, g, t multiply by powers of 1000 and
    take decimals (25.6k = 25600); K, M, G, T by powers of 1024, whole numbers only (32K = 32768); else an integer."""
    import re

    value = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        power = "kmgt".index(suffix.lower()) + 1
        if suffix.islower():
            return int(float(number) * 1000**power)
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: no decimals with the binary suffix {suffix} (1024s); "
                                             f"did you mean {number}{suffix.lower()}?")
        return int(number) * 1024**power
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 4096, 4k = 4000, 4K = 4096); "
                                         "vLLM's 'auto' is not taken: leave the flag out for the model's "
                                         "context") from None


def build_config(args: argparse.Namespace) -> object:
    from tlt.services.common.config import cli_overrides, load_config
    from tlt.services.rollout.config import RolloutConfig

    flat = cli_overrides(args.overrides)
    if args.spec is not None:
        flat["spec.mode"] = args.spec
    if getattr(args, "spec_threshold", None) is not None:
        flat["spec.threshold"] = args.spec_threshold
    if args.drafter is not None:
        if args.spec == "off":  # the drafter would load into every replica and never run: a command line at odds
            from tlt.services.common.config import ConfigError  # with itself (as with --backend sglang)

            raise ConfigError(f"--drafter {args.drafter} with --spec off: plain decoding never runs a drafter; "
                              "drop --drafter, or use --spec adaptive / static")
        flat.update({"spec.drafter": "learned", "spec.drafter_path": args.drafter})
    overrides: dict = {k: v for k, v in flat.items() if "." not in k}
    bad = [k for k in flat if "." in k and k.split(".", 1)[0] not in NESTED]
    if bad:
        from tlt.services.common.config import ConfigError, own_section_hint

        if bad[0].startswith("rollout."):
            raise ConfigError(own_section_hint("rollout", bad[0], flat[bad[0]]))
        raise ConfigError(f"unknown nested override(s) {bad}; nested sections of [rollout]: {', '.join(NESTED)}")
    for section in NESTED:  # only the keys given: load_config merges them field by field over the preset and
        nested = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith(f"{section}.")}  # environment
        if nested:
            overrides[section] = nested
    for flag, field in (("replicas", "replicas"), ("host", "host"), ("http_port", "http_port"),
                        ("grpc_port", "grpc_port"), ("backend", "backend"), ("insecure_local", "insecure_local")):
        if getattr(args, flag, None) is not None:
            overrides[field] = getattr(args, flag)
    for flag, what in (("served_model_name", "this server answers to one model name"),
                       ("api_key", "this server checks one key")):  # vLLM takes several of each
        given = getattr(args, flag, None)
        if isinstance(given, list) and len(given) > 1:
            from tlt.services.common.config import ConfigError

            raise ConfigError(f"--{flag.replace('_', '-')} {' '.join(given)}: {what}; give one")
        if given is not None:
            overrides[flag] = given[0] if isinstance(given, list) else given
    # [rollout.engine] fields, as vLLM names them; with --backend sglang they are [sglang] fields (sglang_flags),
    # and nothing reads [rollout.engine]
    engine = {flag: getattr(args, flag) for flag in VLLM_ENGINE_FLAGS if getattr(args, flag, None) is not None}
    arms = getattr(args, "spec_arms", None)
    if engine or arms is not None:
        # one look at what the preset and environment set: the backend, and where --spec-arms goes (the mode and
        # the bucket count; the engine fields change neither)
        probe = load_config(RolloutConfig, "rollout", args.preset, overrides, require_section=True)
        if engine and probe.backend != "sglang":
            overrides.setdefault("engine", {}).update(engine)
        if arms is not None:
            spec = probe.spec
            overrides.setdefault("spec", {}).update(_arms_override(arms, spec.mode, len(spec.bucket_thresholds)))
    return load_config(RolloutConfig, "rollout", args.preset, overrides, require_section=True)


def _arms_override(text: str, mode: str, buckets: int) -> dict:
    """`--spec-arms` as [rollout.spec] fields: static -> static_arm; otherwise bucket_arms, the one list for every
    bucket, or one list per bucket with '/' between them (SpecConfig checks that count and each arm)."""
    from tlt.services.common.config import ConfigError

    lists = [[a.strip() for a in part.split(",")] for part in text.split("/")]
    if any(a == "" for arms in lists for a in arms):
        raise ConfigError(f"--spec-arms {text!r} has an empty arm; give arms like 8_4_16,4_1_5 ('/' between buckets)")
    from tlt.services.rollout.spec.arm import Arm

    for arm in (a for arms in lists for a in arms):
        try:  # here, the flag's own words; SpecConfig's refusal printed the whole [rollout.spec] section before them
            Arm.parse(arm)
        except ValueError as e:
            raise ConfigError(f"--spec-arms {text!r}: {e}") from None
    if mode == "static":
        if len(lists) != 1 or len(lists[0]) != 1:
            raise ConfigError(f"--spec-arms {text!r}: static mode runs one arm at every small batch; name one "
                              "(e.g. --spec-arms 8_4_16), or use --spec adaptive to choose among several")
        return {"static_arm": lists[0][0]}
    return {"bucket_arms": lists * buckets if len(lists) == 1 else lists}


def sglang_flags(args: argparse.Namespace, environ: dict | None = None) -> dict[str, Any]:
    """The speculative flags as `[sglang]` fields: the SGLang replicas read that section (`resolve_config`),
    never `[rollout.spec]`, which is the native engine's.

        --drafter DIR        -> draft_model_path (a `tlt drafter export --format sglang-eagle` folder)
        --spec off           -> speculative_algorithm = "none" (plain decoding, no drafter)
        --spec static        -> adaptive = false;  --spec adaptive -> adaptive = true
        --spec-threshold N   -> spec_batch_threshold = N
        --spec-arms S_K_D    -> num_steps, eagle_topk, num_draft_tokens (static: one arm)
        --max-model-len N    -> context_length;  --dtype -> dtype;  --max-num-seqs N -> max_running_requests

    SGLang's adaptive mode picks only a chain depth per batch-size slot ([sglang] adaptive_steps), so a list of
    arms for it is refused rather than dropped; so is a drafter with speculation off.
    """
    from tlt.services.common.config import ConfigError, load_config
    from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig
    from tlt.services.rollout.spec.tree import Arm

    out: dict[str, Any] = {field: getattr(args, flag) for flag, field in VLLM_ENGINE_FLAGS.items()
                           if getattr(args, flag, None) is not None}
    if args.spec == "off":
        if args.drafter is not None:
            raise ConfigError(f"--drafter {args.drafter} with --spec off: SGLang would launch without it; "
                              "drop one of the two")
        out["speculative_algorithm"] = "none"
    elif args.spec is not None:
        out["adaptive"] = args.spec == "adaptive"
    if args.drafter is not None:
        out["draft_model_path"] = args.drafter
    if getattr(args, "spec_threshold", None) is not None:
        out["spec_batch_threshold"] = args.spec_threshold
    arms = getattr(args, "spec_arms", None)
    if arms is not None:
        adaptive = out.get("adaptive")
        if adaptive is None:  # no --spec: the [sglang] section decides, as the replicas will read it
            adaptive = load_config(SGLangBackendConfig, "sglang", args.preset, environ=environ).adaptive
        if adaptive or "," in arms or "/" in arms:
            raise ConfigError(f"--spec-arms {arms!r} with --backend sglang: SGLang's adaptive mode chooses only a "
                              "chain depth per batch size; set [sglang] adaptive_steps for it, or give one arm "
                              "with --spec static")
        try:
            arm = Arm.parse(arms)
        except ValueError as e:
            raise ConfigError(f"--spec-arms: {e}") from None
        if arm.is_plain:
            raise ConfigError("--spec-arms plain with --backend sglang: use --spec off for plain decoding")
        out.update(num_steps=arm.steps, eagle_topk=arm.topk, num_draft_tokens=arm.draft_tokens)
    return out


# the flag each `sglang_flags` field comes from, for the errors: "--dtype", not the TLT_SGLANG__* it is handed on in
SGLANG_FIELD_FLAGS = {**{field: f"--{flag.replace('_', '-')}" for flag, field in VLLM_ENGINE_FLAGS.items()},
                      "speculative_algorithm": "--spec off", "adaptive": "--spec", "draft_model_path": "--drafter",
                      "spec_batch_threshold": "--spec-threshold", "num_steps": "--spec-arms",
                      "eagle_topk": "--spec-arms", "num_draft_tokens": "--spec-arms"}


def export_sglang_flags(args: argparse.Namespace, environ: dict | None = None) -> None:
    """Put `sglang_flags` in `TLT_SGLANG__*` for the replica processes (flags win over the preset and the
    environment, as they do for the native engine). Values are written as TOML literals, so a folder named
    `123` stays text. Checked first, as the replicas will read them: ConfigError naming the flag of a bad value
    (read back from the environment, `--dtype float64` was refused as from TLT_SGLANG__*, which the user never set)."""
    import json
    import os

    from tlt.services.common.config import env_prefix, load_config
    from tlt.services.rollout.sglang_backend.config import SGLangBackendConfig

    env = os.environ if environ is None else environ
    flags = sglang_flags(args, dict(env))
    load_config(SGLangBackendConfig, "sglang", args.preset or env.get("TLT_PRESET") or None, flags, environ=env,
                overrides_origin={field: SGLANG_FIELD_FLAGS.get(field, "command line") for field in flags})
    for name, value in flags.items():
        env[f"{env_prefix('sglang')}{name.upper()}"] = json.dumps(value)


def check_before_start(model: str, config: Any) -> None:
    """Raise the user's error (CheckpointError, DrafterError, ConfigError) that each replica process would
    otherwise hit while loading, and report as a replica failure with its traceback."""
    from tlt.model.drafter import check_drafter_folder
    from tlt.model.folder import check_checkpoint

    check_checkpoint(model, architecture=config.backend == "native")  # SGLang serves architectures we do not
    if config.backend == "native":
        from tlt.model.folder import read_model_config
        from tlt.services.rollout.engine.config import context_limit

        from tlt.model.loader import check_weight_headers

        from tlt.model.tokenizer import load_tokenizer

        model_config = read_model_config(model)
        check_weight_headers(model, model_config)
        load_tokenizer(model)  # each replica loads it too
        context_limit(config.engine.max_model_len, model_config)
        check_push_limit(model_config, config.max_weight_bytes)
    spec = config.spec  # (an unknown backend: refused as the config loads, RolloutConfig._known_backend)
    if config.backend == "native" and (unused := spec.unused_buckets()):
        from tlt.services.common.logging import get_logger

        get_logger("rollout").warning("spec_buckets_unused", problem=unused)
    if config.backend == "native" and spec.mode != "off" and spec.drafter == "learned":
        check_drafter_folder(spec.drafter_path)  # --drafter, or [rollout.spec] drafter_path
        check_drafter_fits(spec.drafter_path, model, model_config)
    if config.backend == "sglang":
        from tlt.services.rollout.sglang_backend.engine import resolve_config
        from tlt.services.rollout.sglang_backend.launch import check_draft_model

        check_draft_model(resolve_config(None))  # what each replica resolves: TLT_PRESET, TLT_SGLANG__*


def check_drafter_fits(folder: str, model: str, model_config: Any) -> None:
    """DrafterError unless the drafter in `folder` can run on the model (cheap: reads drafter_config.json only).
    It shares the model's embedding and lm_head and reads its features: another vocabulary or hidden size is found
    only after every replica loaded the model (reported as the model failing to load)."""
    from tlt.model.drafter import DrafterError, read_drafter_config

    drafter = read_drafter_config(folder, model)
    ours = (drafter.vocab_size, drafter.hidden_size)
    theirs = (model_config.vocab_size, model_config.hidden_size)
    if ours != theirs:
        raise DrafterError(
            f"drafter {folder} has vocab_size {ours[0]} and hidden_size {ours[1]}, the model {model} has {theirs[0]} "
            f"and {theirs[1]}: pass a drafter made for this model (`tlt drafter warmup --model {model} --out DIR`)")


def check_push_limit(model_config: Any, max_weight_bytes: int) -> bool:
    """Warn (and False) when even a bf16 push of the model's weights is over max_weight_bytes: a trainer's policy
    updates would all be refused, after the rollout started and served (a 14B policy is 27.5 GiB, the default
    limit 16 GiB). A warning, not a refusal: a server that only serves inference never takes a push."""
    import math

    from tlt.model.loader import expected_tensors
    from tlt.services.common.logging import get_logger

    smallest = 2 * sum(math.prod(shape) for shape in expected_tensors(model_config).values())
    if smallest <= max_weight_bytes:
        return True
    get_logger("rollout").warning(
        "weights_over_push_limit", push_gib=round(smallest / 2**30, 1), max_weight_bytes=max_weight_bytes,
        hint=f"a trainer's weight pushes would all be refused: raise [rollout] max_weight_bytes to at least "
             f"{smallest} (more for an fp32 trainer)")
    return False


def export_preset(preset: str | None, environ: dict | None = None) -> None:
    """Name `--preset` in TLT_PRESET for the replica processes: the SGLang backend reads its [sglang]
    section from there (compose and k8s set it; `--preset` alone left the section's values unused)."""
    import os

    from tlt.services.common.config import preset_path

    env = os.environ if environ is None else environ
    if preset:
        env["TLT_PRESET"] = str(preset_path(preset).resolve())


async def started_unless_stopped(start: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Run `start` unless `stop` is set first; then cancel it and return False. A SIGTERM while the replicas load
    (minutes for a large model on a GPU) must stop the server then, not once it is up and its ready file written
    (an orchestrator's grace period runs out first, and a launcher waiting on the file connects to a dying server)."""
    starting = asyncio.ensure_future(start)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if starting.done():
        starting.result()  # raises why the server could not start
        return True
    starting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await starting  # what the start had brought up so far is shut down as it is cancelled
    return False


def run(args: argparse.Namespace) -> int:
    import os
    import signal
    from pathlib import Path

    from tlt.services.common.logging import get_logger
    from tlt.services.rollout.server import RolloutServer

    log = get_logger("rollout.serve")
    config = build_config(args)
    export_preset(args.preset)
    if config.backend == "sglang":  # type: ignore[attr-defined]
        export_sglang_flags(args)
    if not Path(args.model, "config.json").exists():
        log.error("model_not_found", model=args.model, hint="build one with `tlt model build --out DIR`")
        return 2
    check_before_start(args.model, config)  # what the replicas would fail on: one line, exit 2, nothing started

    async def main() -> None:
        server = RolloutServer(args.model, config, freeze_gc=config.gc_freeze)  # type: ignore[arg-type]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            if not await started_unless_stopped(server.start(), stop):
                log.info("rollout_stopping", during="startup")
                return
            if args.ready_file:
                from tlt.services.common.ready import write_ready_file

                write_ready_file(args.ready_file, {
                    "http_port": server.http_port, "grpc_port": server.grpc_port, "pid": os.getpid(),
                    "replica_pids": server.replica_pids(),
                    **({"capacity_pub": server.capacity.pub_endpoint,
                        "capacity_snapshot": server.capacity.snapshot_endpoint} if server.capacity is not None else {})})
            await stop.wait()
            log.info("rollout_stopping")
        finally:
            await server.stop()

    asyncio.run(main())
    return 0
