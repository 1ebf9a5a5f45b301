#!/usr/bin/env bash
# Install what is needed, then serve the embedded default model on 127.0.0.1:8000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/tandem serve "$@"
