#!/usr/bin/env bash
# Run the test suite (unit tests, slow integration tests and the smoke DAG). Installs what it needs.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -m "not slow"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec python -m pytest -m "not vllm" "$@"
