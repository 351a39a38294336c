#!/usr/bin/env bash
# usage: reset_if_changed.sh DIR FINGERPRINT NAME_OR_GLOB...
#
# A run folder remembers the fingerprint (what identifies it, and a checksum of its inputs: the
# start model's summary) it was started with in DIR/.fingerprint. When the fingerprint changed
# since (the start model was trained again, say), the partial state named by the remaining
# arguments (names or globs inside DIR: a checkpoint, the model, metrics, cached per-benchmark
# results) is MOVED ASIDE into DIR/superseded-<old fingerprint>/ before the command runs, so
# resuming never mixes two configurations and nothing trained is deleted. Resuming with an
# unchanged fingerprint keeps everything. (Settings that identify a run do not reach here: they
# select another folder of the results store, oar.pipeline.store.)
set -euo pipefail
dir=$1
fp=$2
shift 2
mkdir -p "$dir"
if [ -f "$dir/.fingerprint" ] && [ "$(cat "$dir/.fingerprint")" != "$fp" ]; then
    old=$(cat "$dir/.fingerprint")
    aside="$dir/superseded-$old"
    n=1
    while [ -e "$aside" ]; do aside="$dir/superseded-$old.$n"; n=$((n + 1)); done
    moved=()
    for pattern in "$@"; do
        while IFS= read -r -d '' path; do
            mkdir -p "$aside"
            mv "$path" "$aside/"
            moved+=("$(basename "$path")")
        done < <(find "$dir" -mindepth 1 -maxdepth 1 -name "$pattern" -print0)
    done
    if [ ${#moved[@]} -gt 0 ]; then
        echo "reset_if_changed: the inputs of $dir changed since it was started; moved aside into $aside: ${moved[*]}" >&2
    fi
fi
printf '%s\n' "$fp" > "$dir/.fingerprint"
