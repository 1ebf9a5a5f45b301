#!/usr/bin/env bash
# Install tandem into .venv at the repository root: torch first (the CPU wheel unless a GPU is
# present, so a CPU machine never downloads a CUDA build), then the package.
#   scripts/install.sh          what `tandem serve` needs
#   scripts/install.sh --test   plus the test dependencies (transformers as the oracle, the
#                               OpenAI SDK, pytest, triton for the kernels' interpreter tests,
#                               on a GPU flash-linear-attention for the oracle's kernels)
#                               and Debian's chromium for the console test
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q "torch>=2.4"
  else
    # TANDEM_TORCH_INDEX may name a CPU wheel index where torch==2.13.0 is not a local CPU file.
    pip install -q ${TANDEM_TORCH_INDEX:+--index-url "$TANDEM_TORCH_INDEX"} "torch==2.13.0"
  fi
fi

if [ "$want_test" = 1 ]; then
  pip install -q -e ".[test]"
  # Triton, for the kernels' tests under its interpreter (tests/kernels/test_triton_*.py). A CUDA
  # torch brings the triton it was built with: keep that one. --no-deps, so that nothing it
  # names can ever pull a CUDA torch onto a CPU machine; serving never needs it on a CPU. 3.7 at
  # least: an older interpreter fails our loops (tests/kernels/conftest.py skips them there).
  if ! .venv/bin/python -c "import triton" 2>/dev/null; then
    pip install -q --no-deps "triton>=3.7" \
      || echo "install.sh: triton not installed; the Triton kernels' tests will skip" >&2
  fi
  # flash-linear-attention on a GPU: transformers' Qwen3.5 / Qwen3-Next take its kernels, the
  # oracle scripts/bench_engine.py measures tandem against. torch held where it is.
  if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
      && ! .venv/bin/python -c "import fla" 2>/dev/null; then
    pip install -q "flash-linear-attention>=0.6" \
      -c <(.venv/bin/python -c "import torch; print('torch==' + torch.__version__)") \
      || echo "install.sh: flash-linear-attention not installed; the bench runs transformers' torch path" >&2
  fi
  if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
      && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
      >/dev/null 2>&1 || echo "install.sh: chromium not installed; the console's browser test will skip" >&2
  fi
else
  pip install -q -e .
fi
