"""An ``oar`` credit estimator inside TRL's ``GRPOTrainer``: ``OarGRPOTrainer``.

TRL computes one advantage per completion inline in ``GRPOTrainer._generate_and_score_completions``
and offers no smaller hook for it (the proposed ``_transform_advantages`` hook, absent from the
releases, would see only the gathered ``(batch,)`` advantages, without ids or masks). Its loss,
``_compute_loss``, unsqueezes ``inputs["advantages"]`` only when it is 1-D, so a subclass may hand it
``(batch, time)`` token advantages, which every ``loss_type`` multiplies token by token. The subclass
here overrides two methods and no more:

- ``_calculate_rewards``: calls TRL's and keeps its result, the ``(global batch, reward funcs)``
  rewards gathered over processes;
- ``_generate_and_score_completions``: calls TRL's, then replaces ``out["advantages"]`` by the oar
  estimator's ``(batch, time)`` token advantages (:func:`token_advantages`), times the loss mask.

The estimator's batch is what TRL has: ``response_ids`` = ``completion_ids`` (right-padded),
``response_mask`` = the loss mask (``completion_mask``, times ``tool_mask`` when present),
``rewards`` = the reward functions' outputs weighted and summed as TRL's ``sum_then_normalize``
does, ``group_ids`` = TRL's layout (each prompt's ``num_generations`` completions are contiguous in
the gathered batch), ``prompt_ids`` / ``prompt_mask`` (left-padded), the tokenizer, the ``step``,
the ``seed`` and the rollout's ``old_logprobs`` (None unless TRL computed them). ``norm_by_std``
follows ``scale_rewards`` (``"group"``: True, ``"none"``: False) unless the options set it. A
completion that every reward function left unscored (all None, NaN in TRL) is put in a group of its
own, out of its prompt's baseline as in TRL, and gets advantage 0.

Not bridged: estimators that call the policy (OAR-P, OAR-G, ``shuffled``, ``inverted``) or sample
continuations from it (``mc_value``). TRL's advantage step could call the model, but these estimators
would need the unwrapped (gathered, under FSDP/ZeRO-3 on every rank in lockstep) policy there; that
is not done. Refused too: ``scale_rewards="batch"`` and ``multi_objective_aggregation=
"normalize_then_sum"`` (oar's estimators normalise per group, from one summed reward).

TRL is imported only when the class is built (:func:`oar_grpo_trainer_class`, or the module attribute
``OarGRPOTrainer``). Written against trl 1.16 (``pyproject.toml`` pins ``trl>=1.16,<1.17``): it
relies on TRL's private ``_generate_and_score_completions``, ``_calculate_rewards`` and ``_metrics``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch

from oar.credit import CreditBatch, CreditResult
from oar.integrations.common import bridgeable_estimator, with_norm_by_std

__all__ = ["TRL_REQUIREMENT", "TRL_PRIVATE_METHODS", "SCALE_REWARDS_NORM", "AGGREGATION", "METRIC_PREFIX",
           "oar_grpo_trainer_class", "check_trl_settings", "trl_group_ids", "token_advantages"]

#: The TRL this module was written against (``pyproject.toml``'s extras pin it).
TRL_REQUIREMENT = "trl>=1.16,<1.17"
#: The private methods of ``trl.GRPOTrainer`` that the subclass overrides (checked when it is built).
TRL_PRIVATE_METHODS: tuple[str, ...] = ("_generate_and_score_completions", "_calculate_rewards")
#: oar's ``norm_by_std`` for each of TRL's ``scale_rewards`` the subclass accepts.
SCALE_REWARDS_NORM: dict[str, bool] = {"group": True, "none": False}
#: The aggregation of several reward functions the subclass accepts (TRL's default).
AGGREGATION = "sum_then_normalize"
#: Prefix of the estimator's stats in TRL's logged metrics.
METRIC_PREFIX = "oar/"


def check_trl_settings(scale_rewards: str, multi_objective_aggregation: str) -> None:
    """Refuse (one-line ValueError) the ``GRPOConfig`` settings oar's estimators cannot follow."""
    if scale_rewards not in SCALE_REWARDS_NORM:
        raise ValueError(f"OarGRPOTrainer: GRPOConfig.scale_rewards={scale_rewards!r} is not supported (oar's "
                         f"estimators normalise per group); use one of {sorted(SCALE_REWARDS_NORM)}")
    if multi_objective_aggregation != AGGREGATION:
        raise ValueError(f"OarGRPOTrainer: GRPOConfig.multi_objective_aggregation={multi_objective_aggregation!r} is "
                         f"not supported (oar's estimators take one summed reward); use {AGGREGATION!r}")


def trl_group_ids(n_global: int, local: slice, num_generations: int, unscorable: torch.Tensor) -> torch.Tensor:
    """``(batch,)`` long group ids of this process's rows ``local`` of the gathered batch.

    TRL's sampler repeats each prompt ``num_generations`` times in a row, so gathered row ``i`` is of
    group ``i // num_generations``. Rows in ``unscorable`` (``(batch,)`` bool, local) get groups of
    their own (ids from ``n_global`` up), out of their prompt's baseline.

    Raises:
        ValueError: a group would straddle two processes (this process's batch is not a multiple of
            ``num_generations``).
    """
    size = local.stop - local.start
    if size % num_generations:
        raise ValueError(f"OarGRPOTrainer: each process holds {size} completions, not a multiple of "
                         f"num_generations={num_generations}, so a group straddles processes; make "
                         "per_device_train_batch_size * steps_per_generation a multiple of num_generations")
    ids = torch.arange(local.start, local.stop, device=unscorable.device) // num_generations
    lone = n_global + torch.arange(size, device=unscorable.device)
    return torch.where(unscorable, lone, ids)


def token_advantages(out: Mapping[str, Any], rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, *,
                     fn: Callable[..., CreditResult], options: Mapping[str, Any], num_generations: int,
                     process_index: int, tokenizer: Any, step: int | None = None, seed: int | None = None,
                     ) -> tuple[torch.Tensor, CreditResult]:
    """The oar estimator's ``(batch, time)`` token advantages of one TRL generation batch.

    Args:
        out: what TRL's ``_generate_and_score_completions`` returns (``completion_ids``,
            ``completion_mask``, ``prompt_ids``, ``prompt_mask``, optional ``tool_mask`` and
            ``old_per_token_logps``); ``batch`` is this process's rows, ``time`` the completion length.
        rewards_per_func: ``(global batch, funcs)`` float, TRL's gathered rewards (NaN: not scored).
        reward_weights: ``(funcs,)`` float, ``GRPOConfig.reward_weights``.
        fn, options: the estimator and its options (``norm_by_std`` included).
        num_generations: completions per prompt (train or eval).
        process_index: this process's rank (its rows are ``[rank * batch, (rank + 1) * batch)``).
        tokenizer: the policy's tokenizer.
        step, seed: TRL's global step and ``args.seed`` (``CreditBatch.step`` / ``seed``).

    Returns:
        ``(advantages, result)``: ``(batch, time)`` float32, 0 outside the loss mask and on unscored
        rows, and the estimator's :class:`~oar.credit.CreditResult`.
    """
    ids = out["completion_ids"]
    mask = out["completion_mask"] if out.get("tool_mask") is None else out["completion_mask"] * out["tool_mask"]
    B = ids.shape[0]
    local = slice(process_index * B, (process_index + 1) * B)
    rpf = rewards_per_func.to(ids.device)
    unscorable = torch.isnan(rpf).all(dim=1)[local]
    rewards = (rpf * reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)[local]
    batch = CreditBatch(response_ids=ids, response_mask=mask, rewards=rewards,
                        group_ids=trl_group_ids(rpf.shape[0], local, num_generations, unscorable),
                        prompt_ids=out.get("prompt_ids"), prompt_mask=out.get("prompt_mask"), tokenizer=tokenizer,
                        old_logprobs=out.get("old_per_token_logps"), step=step, seed=seed)
    with torch.no_grad():
        result = fn(batch, **options)
    adv = result.token_advantages.to(device=ids.device, dtype=torch.float32) * mask.to(torch.float32)
    adv[unscorable] = 0.0
    return adv, result


def _check_private_methods(trainer_cls: type) -> None:
    """Refuse a TRL whose ``GRPOTrainer`` lacks a method the subclass overrides."""
    import trl

    missing = [m for m in TRL_PRIVATE_METHODS if not callable(getattr(trainer_cls, m, None))]
    if missing:
        raise ImportError(f"OarGRPOTrainer: trl {trl.__version__}'s GRPOTrainer has no {', '.join(missing)}; install "
                          f"the TRL it was written for: pip install '{TRL_REQUIREMENT}'")


@functools.cache
def oar_grpo_trainer_class() -> type:
    """Build ``OarGRPOTrainer``, a subclass of ``trl.GRPOTrainer`` (imported here).

    ``OarGRPOTrainer(*args, oar_estimator="grpo", oar_options=None, **kwargs)`` takes
    ``GRPOTrainer``'s arguments plus the oar estimator's name (built-in, ``module:attr`` or an entry
    point) and its options (a method's config entry, without ``credit``); see the module docstring.

    Raises:
        ModuleNotFoundError: TRL is not installed.
        ImportError: the installed TRL lacks a method the subclass overrides.
    """
    from trl import GRPOTrainer

    _check_private_methods(GRPOTrainer)

    class OarGRPOTrainer(GRPOTrainer):
        """``GRPOTrainer`` whose loss receives an oar estimator's ``(batch, time)`` token advantages.

        Raises (at construction): ValueError, one line, for an estimator that needs the policy or
        continuations, and for ``scale_rewards="batch"`` or ``multi_objective_aggregation=
        "normalize_then_sum"``; KeyError for an unknown estimator.
        """

        def __init__(self, *args: Any, oar_estimator: str = "grpo", oar_options: Mapping[str, Any] | None = None,
                     **kwargs: Any) -> None:
            self.oar_estimator = oar_estimator
            self.oar_options = dict(oar_options or {})
            self.oar_fn = bridgeable_estimator(oar_estimator, "TRL")
            self.oar_rewards_per_func: torch.Tensor | None = None
            super().__init__(*args, **kwargs)
            check_trl_settings(self.scale_rewards, self.multi_objective_aggregation)

        def _calculate_rewards(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            rewards_per_func = super()._calculate_rewards(*args, **kwargs)
            self.oar_rewards_per_func = rewards_per_func
            return rewards_per_func

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            self.oar_rewards_per_func = None
            out = super()._generate_and_score_completions(inputs)
            if self.oar_rewards_per_func is None:
                raise RuntimeError("OarGRPOTrainer: TRL's _generate_and_score_completions did not call "
                                   "_calculate_rewards; install the TRL it was written for: "
                                   f"pip install '{TRL_REQUIREMENT}'")
            mode = "train" if self.model.training else "eval"
            options = with_norm_by_std(self.oar_fn, self.oar_options, SCALE_REWARDS_NORM[self.scale_rewards])
            out["advantages"], result = token_advantages(
                out, self.oar_rewards_per_func, self.reward_weights, fn=self.oar_fn, options=options,
                num_generations=self.num_generations if mode == "train" else self.num_generations_eval,
                process_index=self.accelerator.process_index,
                tokenizer=getattr(self.processing_class, "tokenizer", self.processing_class),
                step=self.state.global_step, seed=self.args.seed)
            self.oar_rewards_per_func = None
            for key, value in result.stats.items():
                self._metrics[mode][METRIC_PREFIX + key].append(float(value))
            return out

    return OarGRPOTrainer


def __getattr__(name: str) -> Any:
    """``oar.integrations.trl.OarGRPOTrainer``: the class, built on first access (imports TRL)."""
    if name == "OarGRPOTrainer":
        return oar_grpo_trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
