#!/usr/bin/env bash
# Create .venv (if missing) and install oar into it: torch first (the CPU wheel when nothing
# else is asked), then the package with its test extra. Idempotent and quick when up to date.
# Usage: source scripts/setup.sh   (or: bash scripts/setup.sh)
# Sourced, it leaves the caller's shell options as they were (the install runs strict, in a subshell)
# and only puts the venv first on PATH; a failed install returns its status instead of closing the
# caller's shell.
_OAR_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_OAR_VENV="${OAR_VENV:-$_OAR_ROOT/.venv}"
# a subshell, not an `if`/`||` condition: there bash would ignore `set -e` inside it
(
    set -euo pipefail
    ROOT="$_OAR_ROOT"
    VENV="$_OAR_VENV"
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
)
_OAR_STATUS=$?
if [ "$_OAR_STATUS" -eq 0 ]; then
    export PATH="$_OAR_VENV/bin:$PATH"
else
    echo "setup.sh: installing into $_OAR_VENV failed (exit $_OAR_STATUS)" >&2
fi
unset _OAR_ROOT _OAR_VENV
# sourced: return the status to the caller; run with bash: exit with it
return "$_OAR_STATUS" 2>/dev/null || exit "$_OAR_STATUS"
