"""The optimizer's settings that SFT and RL training share: the learning-rate schedule and which
parameters weight decay applies to.

:func:`lr_factor` is the one schedule: a linear warmup over ``warmup_steps`` optimizer steps, then
``constant``, ``linear`` or ``cosine`` decay from 1 at step ``warmup_steps`` to ``min_ratio`` at step
``floor_step``. The two trainers differ only in where they put the floor: SFT at its last step
(``steps - 1``, so its last step runs at ``min_ratio``), RL one step past its last (``train.steps``,
so every RL step has a learning rate above the floor; with ``train.schedule: constant``, the
default, the floor is never used).
"""

from __future__ import annotations

import math

import torch

__all__ = ["SCHEDULES", "lr_factor", "make_scheduler", "decay_groups", "rl_param_groups"]

#: The learning-rate schedules :func:`lr_factor` knows (``train.schedule``).
SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")


def lr_factor(step: int, *, warmup_steps: int, floor_step: int, schedule: str, min_ratio: float = 0.0) -> float:
    """The learning-rate multiplier of optimizer step ``step`` (counted from 0).

    ``(step + 1) / warmup_steps`` during the warmup; then 1 (``constant``, or no decay phase:
    ``floor_step <= warmup_steps``), or a decay from 1 at ``warmup_steps`` to ``min_ratio`` at
    ``floor_step`` (``linear``: a straight line; ``cosine``: half a cosine), ``min_ratio`` after it.

    Raises:
        ValueError: an unknown ``schedule`` (valid: :data:`SCHEDULES`).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = floor_step - warmup_steps
    if schedule == "constant" or decay_steps <= 0:
        return 1.0
    progress = min(max((step - warmup_steps) / decay_steps, 0.0), 1.0)
    if schedule == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, floor_step: int, schedule: str,
                   min_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over ``optimizer`` that follows :func:`lr_factor`."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps=warmup_steps, floor_step=floor_step, schedule=schedule,
                                          min_ratio=min_ratio))


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups with weight decay on matrices (dim >= 2) only: norms and biases are not
    decayed. Tied weights appear once. SFT's optimizer uses them, and RL's when it decays
    (:func:`rl_param_groups`)."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def rl_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The RL optimizer's parameter groups: :func:`decay_groups` when ``train.weight_decay`` > 0
    (norms and biases undecayed, as in SFT); with no decay (the default) every parameter in one
    group, the layout the RL checkpoints' optimizer state has always held."""
    if weight_decay > 0:
        return decay_groups(model, weight_decay)
    return [{"params": list(model.parameters()), "weight_decay": 0.0}]
