#!/usr/bin/env bash
# The test command (README): every CPU test; GPU tests are skipped without CUDA. The 30 slowest
# tests are listed at the end, so CI's time (kept under 45 minutes) shows where it goes.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q -p no:cacheprovider --durations=30 tests "$@"
