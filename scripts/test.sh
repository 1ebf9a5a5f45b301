#!/usr/bin/env bash
# Install what is needed, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
exec .venv/bin/python -m pytest -q "$@"
