#!/usr/bin/env bash
# The test command (README): every CPU test; GPU tests are skipped without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -p no:cacheprovider tests "$@"
