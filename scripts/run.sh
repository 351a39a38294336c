#!/usr/bin/env bash
# Run the default pipeline (data -> SFT -> RL training of every method x seed -> evaluation ->
# attribution benchmark -> tables and figures). Installs what it needs. Resumable: run it again
# after an interruption and only unfinished jobs run.
# Extra arguments go to snakemake, e.g.  bash scripts/run.sh --configfile config/smoke.yaml
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
# After a hard stop (kill -9, power loss) Snakemake leaves its lock in .snakemake/locks and refuses
# to start; when no Snakemake process runs in this folder the lock is stale, so release it.
if [ -n "$(ls -A .snakemake/locks 2>/dev/null)" ] && [ -d /proc ]; then
    running=""
    for pid in $(pgrep -f "bin/snakemake" || true); do
        [ "$(readlink "/proc/$pid/cwd" 2>/dev/null)" = "$ROOT" ] && running="$pid"
    done
    if [ -z "$running" ]; then
        echo "run.sh: releasing a stale Snakemake lock left by an interrupted run" >&2
        snakemake --unlock "$@" >/dev/null
    fi
fi
# workflow/profiles/default (2 cores, resumable) applies automatically
exec snakemake "$@"
