#!/usr/bin/env bash
# usage: reset_if_changed.sh DIR FINGERPRINT NAME_OR_GLOB...
#
# A run folder remembers the fingerprint (hash of the config sections and inputs) it was started
# with in DIR/.fingerprint. When the fingerprint changed since, the partial state named by the
# remaining arguments (names or globs inside DIR: a checkpoint, metrics, cached per-benchmark
# results) is removed before the command runs, so resuming never mixes two configurations.
# Resuming an interrupted run with an unchanged fingerprint keeps everything.
set -euo pipefail
dir=$1
fp=$2
shift 2
mkdir -p "$dir"
if [ -f "$dir/.fingerprint" ] && [ "$(cat "$dir/.fingerprint")" != "$fp" ]; then
    echo "reset_if_changed: config or inputs changed since $dir was started; removing: $*"
    for pattern in "$@"; do
        find "$dir" -mindepth 1 -maxdepth 1 -name "$pattern" -exec rm -rf {} +
    done
fi
printf '%s\n' "$fp" > "$dir/.fingerprint"
