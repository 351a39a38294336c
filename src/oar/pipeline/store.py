"""Where the workflow's results live: one content-addressed store shared by every config, seen
through each config's own folder.

Every result that costs compute (the data, the SFT, the start model's evaluation, each training
run with its evaluation) lives once in ``<results_dir>/store/<kind>/<key>/``, where the key is the
fingerprint of what identifies it (the settings it was made from, the start model it trained
from; :mod:`oar.config.identity` defines each key). A config sees its results as
``<results_dir>/<name>/<entry>``, a symbolic link into the store
(``results/ablations/grpo -> ../store/runs/grpo-3f0c...``). So:

- two configs whose resolved settings, start model and seed are equal share one run: running
  ``config/ablations.yaml`` after the default run trains the ablations only, and one ablation
  target schedules its training and evaluation, nothing else;
- a changed setting that identifies a run points the config's link at a new store folder; the old
  run stays in the store, untouched (nothing trained is deleted), and changing the setting back
  points the link at it again;
- a change of a key a run may change and continue (:data:`oar.config.identity.RESUMABLE_TRAIN_KEYS`: steps,
  save cadence, preemption, ...) keeps the key, so the run continues where it stopped.

The links are relative (``../store/...``), so a results tree can be moved or copied whole.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from oar.config.identity import (attribution_uses_trained_verifier, base_key, data_key, run_key, sft_key,
                                 uses_trained_verifier, verifier_key)
from oar.config.tree import STORE_DIR, VERIFIER_VIEW

__all__ = [
    "LayoutError",
    "StoreEntry",
    "store_entries",
    "link_view",
    "link_views",
    "target_problems",
]


class LayoutError(ValueError):
    """A config's folder cannot be linked to the store (the message names the path and what to do)."""


@dataclass(frozen=True)
class StoreEntry:
    """One entry of a config's view: ``<results_dir>/<name>/<view>`` links to ``<results_dir>/store/<target>``."""

    view: str
    target: str


def store_entries(config: Mapping[str, Any], methods: Mapping[str, Any], *, sft: bool) -> list[StoreEntry]:
    """Every entry of a config's view, in a fixed order: data, sft (when enabled), base, the step
    verifier (when a method or an attribution signal reads the one the config trains), one per method."""
    entries = [StoreEntry("data", f"data/{data_key(config)}")]
    if sft:
        entries.append(StoreEntry("sft", f"sft/{sft_key(config)}"))
    entries.append(StoreEntry("base", f"base/{base_key(config, sft=sft)}"))
    if any(uses_trained_verifier(m) for m in methods.values()) or attribution_uses_trained_verifier(config):
        entries.append(StoreEntry(VERIFIER_VIEW, f"verifier/{verifier_key(config, sft=sft)}"))
    entries += [StoreEntry(name, f"runs/{name}-{run_key(config, m, sft=sft)}") for name, m in methods.items()]
    return entries


def link_view(view: str | os.PathLike, target: str | os.PathLike, *, create: bool = True) -> str:
    """Make ``view`` a relative symbolic link to the folder ``target`` (created if missing).

    An existing link is replaced atomically (another process may be reading the view at the same
    moment: a SLURM job parses the workflow too); the folder it pointed at is left as it is. A real
    folder at ``view`` (a results tree from before the store) is used in place and left as it is:
    it is never moved or merged (its run folders' own fingerprints decide, as before the store).

    With ``create`` False (a dry run) nothing new is made: a link is made or changed only when
    ``target`` exists already (a finished result the plan must see), else ``"absent"`` is returned.

    Returns:
        What was done: ``"kept"`` (the link or the real folder stays), ``"linked"``, ``"relinked"``
        or ``"absent"``.

    Raises:
        LayoutError: ``view`` is a file.
    """
    view, target = Path(view), Path(target)
    if not create and not target.is_dir():
        return "absent"
    view.parent.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(target, view.parent)
    action = "linked"
    if view.is_symlink():
        if os.readlink(view) == rel:
            target.mkdir(parents=True, exist_ok=True)
            return "kept"
        action = "relinked"
    elif view.is_dir():
        return "kept"
    elif view.exists():
        raise LayoutError(f"{view}: a file where the workflow keeps a link into the results store; move it away")
    target.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{view.name}.", suffix=".link", dir=view.parent)
    os.close(fd)
    os.unlink(tmp)
    os.symlink(rel, tmp)
    os.replace(tmp, view)
    return action


def link_views(results_dir: str | os.PathLike, view_dir: str | os.PathLike,
               entries: Iterable[StoreEntry], *, create: bool = True) -> dict[str, str]:
    """:func:`link_view` for each entry: ``<view_dir>/<entry.view>`` -> ``<results_dir>/store/<entry.target>``
    (``create`` False: a dry run, which makes no folder and links only to results that exist).

    Returns:
        ``{view name: action}`` for the entries whose link was made or changed (not those kept or absent).
    """
    store = Path(results_dir) / STORE_DIR
    done = {}
    for e in entries:
        action = link_view(Path(view_dir) / e.view, store / e.target, create=create)
        if action not in ("kept", "absent"):
            done[e.view] = action
    return done


def target_problems(targets: Iterable[str], *, results_dir: str, name: str, methods: Iterable[str],
                    seeds: Iterable[int], reserved: Iterable[str]) -> list[str]:
    """Why a Snakemake target under this config's folder ``<results_dir>/<name>/`` names nothing the
    workflow makes: a method the config does not have (the nearest name suggested), a seed not in
    ``seeds``; one sentence each (Snakemake itself only says ``MissingRuleException``). A target
    elsewhere (another config's folder, a rule name) is left to Snakemake."""
    from oar.config.source import suggest

    root = Path(results_dir) / name
    methods, seeds = list(methods), [int(s) for s in seeds]
    out = []
    for target in targets:
        try:
            parts = Path(os.path.normpath(target)).relative_to(os.path.normpath(root)).parts
        except ValueError:
            continue
        if len(parts) < 2:  # a file of the config's folder itself (plan.txt, config.yaml)
            continue
        head = parts[0]
        if head not in methods and head not in set(reserved):
            near = suggest(head, methods)
            hint = f"did you mean {near}?" if near else f"its methods: {', '.join(methods)}"
            out.append(f"target {target}: this config ({name}) has no method {head!r}; {hint}")
        elif head in methods and len(parts) > 1 and parts[1].startswith("seed"):
            seed = parts[1][len("seed"):]
            if not seed.isdigit() or int(seed) not in seeds:
                out.append(f"target {target}: {parts[1]!r} is not a seed of this config ({name}: seeds "
                           f"{', '.join(map(str, seeds))}); name one of them, or add it to seeds")
    return out
