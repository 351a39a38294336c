#!/usr/bin/env bash
# Create .venv (if missing) and install oar into it: torch first (the CPU wheel when nothing
# else is asked), then the package with its test extra. Idempotent and quick when up to date.
# Usage: source scripts/setup.sh   (or: bash scripts/setup.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OAR_VENV:-$ROOT/.venv}"
TORCH_SPEC="${OAR_TORCH_SPEC:-torch==2.13.0}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
STAMP="$VENV/.oar-setup-stamp"
WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    # torch first: a bare 'torch' requirement with nothing installed pulls a multi-GB CUDA build
    "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
    "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
