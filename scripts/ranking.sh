#!/usr/bin/env bash
# The credit ranking in the harder-task cell (config/ranking.yaml): every credit method, 6 seeds, into
# results/ranking_hard_n8/ (main.md, efficiency table and figure there). Resumable: run it again after an
# interruption and only unfinished jobs run. Installs what it needs. Extra arguments (targets, options) go
# to snakemake, before the --configfile (whose list would otherwise swallow a target). Its budget variants
# (3 seeds): OAR_RANKING_CONFIG=config/ranking_budget.yaml bash scripts/ranking.sh   (160 RL steps, 4 methods)
#            OAR_RANKING_CONFIG=config/ranking_budget_240.yaml bash scripts/ranking.sh   (240 RL steps, 3 methods)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
exec bash scripts/run.sh "$@" --configfile "${OAR_RANKING_CONFIG:-config/ranking.yaml}"
