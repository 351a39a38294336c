#!/usr/bin/env bash
# Run the regime map (config/regimes.yaml): each cell is an ordinary, resumable run of the workflow
# into results/regimes_<cell>/, one cell after the other; then the map's table and figure in
# results/regimes/. Arguments: cell names to run (default: every cell). Installs what it needs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
CONFIG="${OAR_REGIMES_CONFIG:-config/regimes.yaml}"
mapfile -t CELLS < <(oar regimes cells --config "$CONFIG" --out results/regime_cells)
for cell in "${CELLS[@]}"; do
    name="$(basename "$cell" .yaml)"
    if [ "$#" -gt 0 ]; then
        wanted=""
        for arg in "$@"; do [ "$name" = "regimes_$arg" ] || [ "$name" = "$arg" ] && wanted=1; done
        [ -n "$wanted" ] || continue
    fi
    echo "regimes.sh: cell $name" >&2
    bash scripts/run.sh --configfile "$cell"
done
oar regimes report --config "$CONFIG"
