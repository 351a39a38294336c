#!/usr/bin/env bash
# Run the test suite (unit tests, slow integration tests and the smoke DAG). Installs what it needs.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -m "not slow"
# Two pytest workers (OAR_TEST_WORKERS; 0 runs in one process), one test file per worker at a time
# (module fixtures run once); the whole-pipeline files start first (tests/conftest.py; xdist would
# otherwise reorder the files by their number of tests and start the longest, with few tests, last).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec python -m pytest -m "not vllm" -n "${OAR_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=30 "$@"
