#!/usr/bin/env bash
# Run the default pipeline (data -> SFT -> RL training of every method x seed -> evaluation ->
# attribution benchmark -> tables and figures). Installs what it needs. Resumable: run it again
# after an interruption and only unfinished jobs run.
# Extra arguments go to snakemake, e.g.  bash scripts/run.sh --configfile config/smoke.yaml
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
# workflow/profiles/default (2 cores, resumable) applies automatically
exec snakemake "$@"
