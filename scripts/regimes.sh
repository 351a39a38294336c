#!/usr/bin/env bash
# Run the regime map (config/regimes.yaml): each cell is an ordinary, resumable run of the workflow
# into results/regimes_<cell>/, one cell after the other; then the map's table and figure in
# results/regimes/. Arguments: the cells to run (default: every cell not marked optional; an optional
# cell, such as the long n=4 ones, runs when named). Installs what it needs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
CONFIG="${OAR_REGIMES_CONFIG:-config/regimes.yaml}"
# the cell configs: a fixed folder (each run's resolved config names the file it came from)
mapfile -t CELLS < <(oar regimes cells --config "$CONFIG" --out results/regime_cells --cells "$@")
[ "${#CELLS[@]}" -gt 0 ] || { echo "regimes.sh: no cell to run" >&2; exit 1; }
for cell in "${CELLS[@]}"; do
    echo "regimes.sh: cell $(basename "$cell" .yaml)" >&2
    bash scripts/run.sh --configfile "$cell"
done
oar regimes report --config "$CONFIG"
