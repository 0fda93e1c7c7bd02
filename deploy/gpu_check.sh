#!/usr/bin/env bash
# The GPU-only checks, in one command for a session lent a GPU machine (first run in session 30, on an H200).
#
#   here, once:        bash deploy/gpu_check.sh --fetch      # wheels the GPU image lacks -> .whl/ (.gitignore)
#   on the machine:    the session's device tool: run(command="bash deploy/gpu_check.sh [STEP...]",
#                      carry=[".whl", "artifacts/tiny", "artifacts/drafter-tiny"]); STEPs: tests kernels rollout serve
#                      profile (default: all five, in that order), or engine: tests/test_engine_cuda.py alone, or
#                      tune: the tree-verify kernel's variants timed (-> $OUT/tune.json), or rollout-eager: the
#                      whole rollout on the eager path alone, or e2e: `tlt bench e2e` with every service on the GPU,
#                      or e2e-lend: the same with trainer.lend_rollout_devices on, or e2e-frozen: e2e-lend with
#                      TLT's drafter frozen (no drafter service), or e2e-wide: e2e-lend with 32 x 8 sequences a step
#                      and SD up to batch 256 (e2e-wide-dg: with drafter graphs), or drafter-graphs: the rollout
#                      benches with the drafter's chains replayed from CUDA graphs (--drafter-graphs cuda), or
#                      dg-ab: the whole eager rollout with and without drafter graphs, alternating, twice, or
#                      e2e-shape: the e2e's 8 x 8 rollout through the engine alone. E2E_PAIRS=K runs each e2e step
#                      as K alternating TLT / baseline pairs; each e2e step's files come back as one $OUT/NAME.tgz
#                      (the device tool brings back 8 files a call). The steps' time limits add
#                      up past the device tool's 10 minutes a call: split them, e.g. `tests kernels rollout` and
#                      `serve profile e2e` (session 31: tests + rollout + profile ran 225 s, e2e 170 s)
#
# The GPU image has Python 3.12 with torch 2.11, triton 3.6, transformers 5.17, grpcio, protobuf, pytest,
# scipy (docs: /work/.library/device/KINDS.md) and nothing can be fetched there; the wheels carry the rest of
# what the engine and kernel tests import. What it runs, with logs under $OUT (what comes back):
#   1. pytest -m gpu: the kernels' parity on CUDA (fp32/fp16/bf16) and tests/test_engine_cuda.py (engine vs
#      transformers on CUDA, Triton + CUDA decode graphs vs the PyTorch path, per-arm verify graphs lossless)
#   2. tlt bench kernels: kernel vs PyTorch timings at Qwen2.5-7B shapes -> $OUT/kernels.json, kernels.log
#   3. with artifacts/tiny and artifacts/drafter-tiny carried too: tlt bench rollout on the GPU, issue #4's tail
#      and whole-rollout commands, on Triton kernels + CUDA graphs and on the eager PyTorch path
#      -> $OUT/rollout_{tail,whole}_{graphs,eager}.json
#   4. with the same artifacts: deploy/gpu_serve_check.py, `tlt rollout serve` on the GPU with adaptive speculation,
#      its greedy completions over HTTP against transformers' -> $OUT/serve.log
#   5. with the same artifacts: deploy/gpu_profile.py, torch.profiler tables of one off and one learned tail run
#      on Triton + CUDA graphs -> $OUT/profile.log (step 3 writes a summary line per mode in $OUT/gpu.txt)
#   6. (e2e, not in the default list) with the same artifacts and the deepspeed wheel: issue #6's `tlt bench e2e` on
#      the cpu-tiny preset with the rollout, drafter and trainer on the GPU -> $OUT/e2e.log, $OUT/e2e.tgz (first run
#      in session 31)
# Each step runs under its own time limit (a hang costs that step, not the lease) and a failed step does not stop the
# next. First run in session 30 on an H200 (BENCHMARKS.md, "GPU").
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0 structlog==26.1.0 pyzmq==27.3.0
        # the server (step serve): its HTTP stack, and the gRPC / protobuf runtimes tlt/v1's generated code needs
        fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 sniffio==1.3.1 protobuf==7.36.2 grpcio==1.85.1
        opentelemetry-api==1.45.2  # fastapi 0.165 imports it
        hjson==3.1.0)  # deepspeed's one dependency the image lacks (step e2e); deepspeed itself is built below

if [ "${1:-}" = "--fetch" ]; then
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
  # deepspeed ships only an sdist: a wheel of its Python code (no ops compiled; the trainer passes a torch optimizer)
  [ -x .venv/bin/python ] || { echo "no .venv: run 'make test' once first (the deepspeed wheel is built with it)"; exit 2; }
  DS_BUILD_OPS=0 .venv/bin/python -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir -w .whl deepspeed==0.19.8
  ls -la .whl
  exit 0
fi

# the steps that need artifacts/tiny and artifacts/drafter-tiny, after those that do not
ARTIFACT_STEPS="rollout rollout-eager drafter-graphs dg-ab e2e-shape serve profile e2e e2e-lend e2e-frozen e2e-wide e2e-wide-dg"
ALL_STEPS="tests engine tune kernels $ARTIFACT_STEPS"
STEPS="${*:-tests kernels rollout serve profile}"
for step in $STEPS; do
  [[ " $ALL_STEPS " == *" $step "* ]] || { echo "unknown step '$step': choose from $ALL_STEPS"; exit 2; }
done
: "${OUT:=/tmp/gpu-check-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: run 'bash deploy/gpu_check.sh --fetch' here first"; exit 2; }
rm -rf /tmp/site build  # a warm machine keeps both: pip --target would keep the last call's tlt, build/ a deleted module
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target /tmp/site .
export PYTHONPATH=/tmp/site  # the installed copy (services/ and kernels/ mapped under tlt); -P below keeps
                             # the source folder ./tlt, which lacks them, off the front of sys.path
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
  'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"

want() { [[ " $STEPS " == *" $1 "* ]]; }
status=0
gpu_pytest() {  # time limit, test files...
  local limit=$1; shift
  timeout "$limit" python3 -P -m pytest -m gpu -q -rs -p no:cacheprovider --timeout 150 --durations 12 "$@" 2>&1 \
    | tee "$OUT/pytest_gpu.log" || status=1
}
bench_kernels() {  # time limit, output name, extra flags...
  local limit=$1 name=$2; shift 2
  timeout "$limit" python3 -P -m tlt.cli bench kernels --batch 1 32 --ctx 4096 32768 --json "$OUT/$name.json" "$@" \
    2>&1 | tee "$OUT/$name.log" || status=1
}
if want tests; then gpu_pytest 240 tests/test_engine_cuda.py tests/test_kernels_*.py; fi
if want engine; then gpu_pytest 60 tests/test_engine_cuda.py; fi
# tune: the tree-verify kernel's candidates (BENCHMARKS.md "GPU"): blocks per iteration x rows per tile
if want tune; then bench_kernels 200 tune --tree-pages 1 2 4 --tree-block-m 0 32 16; fi
if want kernels; then bench_kernels 90 kernels; fi

needed=0
for step in $ARTIFACT_STEPS; do if want "$step"; then needed=1; fi; done
if [ $needed = 0 ]; then exit $status; fi
[ -f artifacts/tiny/.complete ] && [ -d artifacts/drafter-tiny ] || {
  echo "no artifacts/tiny or artifacts/drafter-tiny carried: $ARTIFACT_STEPS not run"; exit 1; }
TAIL="--workload task --min-tokens 100 --prompts 4 --n 1 --max-tokens 256 --arms 12_1_13,8_1_9,5_1_6,plain
      --threshold 16 --temperature 1.0 --repeats 5"
WHOLE="--workload task --prompts 32 --n 8 --temperature 1.0 --max-tokens 320 --threshold 256 --verify-budget 0
       --buckets 1,2,5,17,64 --repeats 3
       --arms 12_1_13,8_1_9,5_1_6,plain/12_1_13,8_1_9,5_1_6,plain/8_1_9,5_1_6,3_1_4,plain/5_1_6,3_1_4,plain/3_1_4,2_1_3,plain"
rollout() {  # name, time limit, flags...
  local name=$1 limit=$2; shift 2
  echo "== tlt bench rollout $name: $*" | tee -a "$OUT/gpu.txt"
  timeout "$limit" python3 -P -m tlt.cli bench rollout --model artifacts/tiny --drafter artifacts/drafter-tiny \
    --modes off,learned --bandit keep --clock wall --device cuda --dtype bfloat16 --json "$@" >"$OUT/rollout_$name.json" \
    2>>"$OUT/gpu.txt" || { echo "   failed (rc $?)" | tee -a "$OUT/gpu.txt"; status=1; return; }
  python3 - "$OUT/rollout_$name.json" <<'PY' | tee -a "$OUT/gpu.txt" || true
import json, sys
r = json.load(open(sys.argv[1]))
for m in r["results"]:
    print(f"   {m['mode']:<8} wall {m['wall_s']:.3f} s  x{m.get('speedup_vs_off') or 1:.2f} {m.get('speedup_vs_off_range') or ''}  "
          f"tail4 x{m.get('tail4_speedup') or 0:.2f}  accept {m.get('mean_accept_len') or 0:.2f}")
PY
}
if want rollout; then
  rollout tail_graphs 45 $TAIL --kernels triton --graphs cuda
  rollout whole_graphs 55 $WHOLE --kernels triton --graphs cuda
  rollout tail_eager 30 $TAIL --kernels torch
fi
if want rollout || want rollout-eager; then
  # the GPU presets' default engine (kernels = "torch", no graphs), with the model-free drafter too
  rollout whole_eager 150 $WHOLE --kernels torch --modes off,learned,ngram
fi
if want drafter-graphs; then
  # the learned drafter's chains replayed from CUDA graphs (SpecConfig.drafter_graphs, written in session 31 after its
  # device time was spent): the tail on both engine paths and the whole rollout on the eager one
  rollout tail_graphs_dg 60 $TAIL --kernels triton --graphs cuda --drafter-graphs cuda
  rollout tail_eager_dg 45 $TAIL --kernels torch --drafter-graphs cuda
  rollout whole_eager_dg 150 $WHOLE --kernels torch --drafter-graphs cuda
fi
if want dg-ab; then
  # the whole rollout with and without drafter graphs, alternating in one call (session 57 measured them in two calls
  # whose `off` runs differed by 40% on identical work): a host that slows down mid-call hits both arms
  for i in 1 2; do
    rollout "whole_eager_ab$i" 150 $WHOLE --kernels torch
    rollout "whole_eager_dg_ab$i" 150 $WHOLE --kernels torch --drafter-graphs cuda
  done
fi
if want e2e-shape; then
  # the e2e's rollout (8 prompts x 8, threshold 64, the cpu-tiny preset's arms) through the engine alone: what the
  # engine gains on that shape, and its step time against the e2e's (its server path)
  E2E_SHAPE="--workload task --prompts 8 --n 8 --temperature 1.0 --max-tokens 320 --threshold 64 --buckets 1,2,5
             --arms 12_1_13,8_1_9,5_1_6,plain/12_1_13,8_1_9,5_1_6,plain/8_1_9,5_1_6,3_1_4,plain --repeats 3 --kernels torch"
  rollout e2e_shape 60 $E2E_SHAPE
  rollout e2e_shape_dg 60 $E2E_SHAPE --drafter-graphs cuda
fi
if want serve; then
  timeout 240 python3 -P deploy/gpu_serve_check.py 2>&1 | tee "$OUT/serve.log" || status=1
fi
if want profile; then
  timeout 60 python3 -P deploy/gpu_profile.py --kernels triton --graphs cuda 2>&1 | grep -v engine_ready \
    | tee "$OUT/profile.log" || status=1
fi
e2e() {  # name, extra --set flags...
  # issue #6 on the GPU: the cpu-tiny preset's RL step with every service on the GPU, TLT (adaptive SD, online drafter
  # started from the warm-up drafter) against the baseline; run folders in /tmp, their files back as $OUT/NAME.tgz
  # E2E_PAIRS=K: K TLT / baseline pairs in alternating order (a GPU host's run-to-run noise: in session 32 the same
  # baseline's mean step was 2.40 s in one pair and 3.49 s in the next)
  # E2E_LIMIT: seconds per pair (default 130: session 31-32's 8 x 8 pairs took 100-110 s; the 32 x 8 steps get 240)
  local name=$1 pairs=${E2E_PAIRS:-1} limit=${E2E_LIMIT:-130}; shift
  case "$name" in e2e_wide*) limit=${E2E_LIMIT:-240};; esac
  rm -rf "/tmp/$name"  # a warm machine keeps the last call's runs: none of them may end up in this call's archive
  timeout $((60 + limit * pairs)) python3 -P -m tlt.cli bench e2e --preset cpu-tiny --steps 6 --noise-seed -1 \
    --pairs "$pairs" --model artifacts/tiny \
    --out "/tmp/$name" --set rollout.engine.device=cuda --set rollout.engine.dtype=bfloat16 \
    --set rollout.engine.kernels=torch --set rollout.spec.threshold=64 --set drafter.device=cuda \
    --set trainer.max_tokens=320 --set trainer.eval_problems=0 --set run.drafter_init=artifacts/drafter-tiny "$@" \
    2>&1 | tail -60 | tee "$OUT/$name.log" || status=1
  # one archive: the device tool brings back at most 8 files a call (session 32 lost 16 to that limit)
  (cd "/tmp/$name" && tar czf "$OUT/$name.tgz" --ignore-failed-read results.json reward.png ./*.out ./*/metrics.jsonl \
    ./*/rollout_status.json ./*/drafter.jsonl 2>/dev/null) || true
}
if want e2e; then e2e e2e; fi
# the same with the drafter kept off the GPU while the trainer updates, as deploy/configs/1gpu.toml does (in session
# 31's second e2e run TLT's steps spent ~0.3 s more than the baseline's outside the rollout, ~0.08 s in the first)
if want e2e-lend; then e2e e2e_lend --set trainer.lend_rollout_devices=true; fi
# e2e-lend with TLT's drafter frozen (the warm-up drafter, no drafter service: no features collected, no training,
# no hot-swap): what the online drafter costs the rollout (session 32: the 8 x 8 rollout gains 2.5x through the
# engine alone, 1.36x in the e2e)
if want e2e-frozen; then e2e e2e_frozen --set trainer.lend_rollout_devices=true --set run.drafter=false; fi
# and with the whole-rollout bench's shape: 32 prompts x 8 per step, SD up to batch 256 without a verify budget (an
# 8 x 8 rollout has little tail: BENCHMARKS.md, "Session 31: the whole rollout"), 4 updates a step as before
# (session 37 ran it without the two rollout.engine settings: the cpu-tiny engine's max_num_seqs = 64 then ran each
# step's 256 sequences as four waves of 64, never the bench's batch-256 shape)
WIDE="--set trainer.lend_rollout_devices=true --set trainer.prompts_per_step=32 --set trainer.mini_batch_size=64
      --set trainer.micro_batch_size=16 --set rollout.spec.threshold=256 --set rollout.spec.verify_token_budget=0
      --set rollout.engine.max_num_seqs=256 --set rollout.engine.kv_cache_mb=1024"
if want e2e-wide; then e2e e2e_wide $WIDE; fi
# e2e-wide with the learned drafter's chains replayed from CUDA graphs in TLT's rollout
if want e2e-wide-dg; then e2e e2e_wide_dg $WIDE --set rollout.spec.drafter_graphs=cuda; fi
exit $status
