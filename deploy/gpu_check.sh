#!/usr/bin/env bash
# The GPU-only checks, in one command for a session lent a GPU machine (every session so far had none).
#
#   here, once:        bash deploy/gpu_check.sh --fetch      # wheels the GPU image lacks -> .whl/ (.gitignore)
#   on the machine:    the session's device tool: run(command="bash deploy/gpu_check.sh", carry=[".whl"])
#
# The GPU image has Python 3.12 with torch 2.11, triton 3.6, transformers 5.17, grpcio, protobuf, pytest,
# scipy (docs: /work/.library/device/KINDS.md) and nothing can be fetched there; the wheels carry the rest of
# what the engine and kernel tests import. What it runs, with logs under $OUT (what comes back):
#   1. pytest -m gpu: the kernels' parity on CUDA (fp32/fp16/bf16) and tests/test_engine_cuda.py (engine vs
#      transformers on CUDA, Triton + CUDA decode graphs vs the PyTorch path, per-arm verify graphs lossless)
#   2. tlt bench kernels: kernel vs PyTorch timings at Qwen2.5-7B shapes -> $OUT/kernels.json
# Until it has run on a GPU, everything it checks stays UNVERIFIED in BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0 structlog==26.1.0 pyzmq==27.3.0)

if [ "${1:-}" = "--fetch" ]; then
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
  ls -la .whl
  exit 0
fi

: "${OUT:=/tmp/gpu-check-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: run 'bash deploy/gpu_check.sh --fetch' here first"; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target /tmp/site .
export PYTHONPATH=/tmp/site  # the installed copy (services/ and kernels/ mapped under tlt); -P below keeps
                             # the source folder ./tlt, which lacks them, off the front of sys.path
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
  'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"

status=0
python3 -P -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_kernels_*.py tests/test_engine_cuda.py 2>&1 | tee "$OUT/pytest_gpu.log" || status=1
python3 -P -m tlt.cli bench kernels --batch 1 32 --ctx 4096 32768 --json "$OUT/kernels.json" 2>&1 \
  | tee "$OUT/bench_kernels.log" || status=1
exit $status
