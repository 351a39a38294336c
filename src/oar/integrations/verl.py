"""An ``oar`` credit estimator as a verl advantage estimator (``register_adv_est``).

verl's PPO trainer (``verl/trainer/ppo/ray_trainer.py``, ``compute_advantage``) computes advantages on
its driver process and calls a registered estimator with keyword arguments only:

- ``token_level_rewards``: ``(batch, time)`` float, the outcome score at the last response token
  (minus the per-token KL when ``algorithm.use_kl_in_reward``);
- ``response_mask``: ``(batch, time)``, 1 on response tokens;
- ``config``: the ``algorithm`` config (``norm_adv_by_std_in_grpo`` is read from it);
- ``index``: ``(batch,)`` object array of uid strings, one per prompt (passed when the batch has
  ``non_tensor_batch["uid"]``, which verl's trainer always sets);
- ``reward_baselines`` (ReMax) and other estimator-specific keys, ignored here.

and stores the returned ``(advantages, returns)``, both ``(batch, time)``, in ``data.batch``. The
actor's policy loss multiplies its ratio by ``advantages`` token by token, so an oar estimator's
``(batch, time)`` token advantages go in unchanged.

No token ids, prompts or model are passed. Estimators that need only rewards, groups and the mask
(``grpo``, ``drgrpo``, a user estimator weighting by position) work through the registry as is.
Those that read the response token ids (``ktae``, the ``oracle_*`` controls) need them passed as
``responses=data.batch["responses"]`` (and the oracles ``prompts=data.batch["prompts"]``,
``attention_mask=data.batch["attention_mask"]`` and a tokenizer): a trainer whose advantage step adds
them; without them the call fails with one line naming ``responses``. Estimators that call the
policy (OAR-P, OAR-G, ``shuffled``, ``inverted``, ``mc_value``) are refused: the policy lives in
verl's worker group, not on the driver.

verl itself is imported only by :func:`register_with_verl`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from oar.credit import CreditBatch
from oar.integrations.common import bridgeable_estimator, with_norm_by_std

__all__ = ["RESPONSES_KEY", "PROMPTS_KEY", "ATTENTION_MASK_KEY", "NORM_CONFIG_KEY", "HARDWIRED_NAMES", "SPEC_ATTR",
           "verl_group_ids", "verl_advantage_fn", "register_with_verl"]

#: The keyword that carries the ``(batch, time)`` response token ids (verl's ``data.batch["responses"]``).
RESPONSES_KEY = "responses"
#: The keyword that carries the ``(batch, prompt)`` left-padded prompt ids (verl's ``data.batch["prompts"]``).
PROMPTS_KEY = "prompts"
#: The keyword that carries the ``(batch, prompt + time)`` attention mask (verl's ``data.batch["attention_mask"]``).
ATTENTION_MASK_KEY = "attention_mask"
#: The key of verl's ``algorithm`` config that chooses GRPO's std division (oar's ``norm_by_std``).
NORM_CONFIG_KEY = "norm_adv_by_std_in_grpo"
#: Estimator names verl's ``compute_advantage`` hard-wires: it never calls the registry for them.
HARDWIRED_NAMES: tuple[str, ...] = ("gae", "grpo")

#: The attribute of a function built by :func:`verl_advantage_fn` that says what it computes.
SPEC_ATTR = "oar_spec"


class _MissingTokenIds(torch.Tensor):
    """Stands for ``CreditBatch.response_ids`` that verl did not pass: any use raises its ``message``."""

    message: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        found = next((a for a in args if isinstance(a, _MissingTokenIds)), None)
        raise ValueError(getattr(found, "message", "oar: the response token ids were not passed"))

    def __repr__(self) -> str:
        return "<response token ids not passed>"


def _missing_response_ids(estimator: str) -> torch.Tensor:
    """A stand-in for the response ids that raises a one-line ValueError when the estimator reads it."""
    ids = torch.Tensor._make_subclass(_MissingTokenIds, torch.empty(0, dtype=torch.long))
    ids.message = (f"oar estimator {estimator!r} reads the response token ids, which verl's advantage call does not "
                   f"pass; call it with {RESPONSES_KEY}=data.batch[{RESPONSES_KEY!r}] (a trainer whose advantage step "
                   "adds it) or use an estimator that needs only rewards, groups and the mask (grpo, drgrpo)")
    return ids


def verl_group_ids(index: Any, size: int, device: torch.device) -> torch.Tensor:
    """``(batch,)`` long group ids from verl's ``index`` (uid strings): equal uids get equal ids,
    numbered by first appearance (verl reorders rows to balance them, so position means nothing).

    Raises:
        ValueError: ``index`` is None (the batch has no ``uid``) or not of length ``size``.
    """
    if index is None:
        raise ValueError("oar's verl adapter needs index (verl passes it when data.non_tensor_batch has 'uid', "
                         "one per prompt): set the uids before computing advantages")
    uids = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(uids) != size:
        raise ValueError(f"oar's verl adapter: index has {len(uids)} uids for {size} responses; pass one uid per "
                         "response")
    first: dict[Any, int] = {}
    return torch.tensor([first.setdefault(u, len(first)) for u in uids], dtype=torch.long, device=device)


def _norm_from_config(config: Any) -> bool | None:
    """verl's ``algorithm.norm_adv_by_std_in_grpo``, or None when there is no config or no such key."""
    get = getattr(config, "get", None)
    if get is None:
        return None
    value = get(NORM_CONFIG_KEY, None)
    return None if value is None else bool(value)


def _prompts(kwargs: Mapping[str, Any], T: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(prompt_ids, prompt_mask)`` from the optional ``prompts`` and ``attention_mask`` keywords
    (the mask's first ``prompt`` columns, when it spans prompt and response)."""
    prompts = kwargs.get(PROMPTS_KEY)
    attention = kwargs.get(ATTENTION_MASK_KEY)
    if prompts is None:
        return None, None
    if attention is not None and attention.shape[-1] == prompts.shape[-1] + T:
        return prompts, attention[:, : prompts.shape[-1]]
    return prompts, None


def _credit_batch(estimator: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any,
                  tokenizer: Any, kwargs: Mapping[str, Any]) -> CreditBatch:
    """The oar batch of one verl advantage call (see :func:`verl_advantage_fn`)."""
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.dim() != 2:
        raise ValueError(f"oar's verl adapter: token_level_rewards {tuple(token_level_rewards.shape)} and "
                         f"response_mask {tuple(response_mask.shape)} must both be (batch, time)")
    B, T = response_mask.shape
    responses = kwargs.get(RESPONSES_KEY)
    if responses is None:
        responses = _missing_response_ids(estimator)
    elif tuple(responses.shape) != (B, T):
        raise ValueError(f"oar's verl adapter: {RESPONSES_KEY} is {tuple(responses.shape)}, response_mask "
                         f"{(B, T)}; pass data.batch[{RESPONSES_KEY!r}]")
    prompt_ids, prompt_mask = _prompts(kwargs, T)
    return CreditBatch(
        response_ids=responses, response_mask=response_mask, rewards=token_level_rewards.sum(dim=-1),
        group_ids=verl_group_ids(index, B, token_level_rewards.device), prompt_ids=prompt_ids,
        prompt_mask=prompt_mask, tokenizer=tokenizer,
    )


def verl_advantage_fn(estimator: str, *, tokenizer: Any = None,
                      **options: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """A verl advantage estimator that runs the oar estimator ``estimator``.

    The returned function takes exactly what verl's ``compute_advantage`` passes a registered
    estimator (keywords only: ``token_level_rewards``, ``response_mask``, ``index``, ``config`` and
    any others through ``**kwargs``) and returns ``(advantages, returns)``, both the estimator's
    ``(batch, time)`` token advantages, 0 outside ``response_mask``, in the dtype of the rewards.
    The batch it builds: ``rewards = token_level_rewards.sum(-1)``, ``group_ids`` from ``index``
    (:func:`verl_group_ids`), ``response_ids`` from the ``responses`` keyword when given (else a
    stand-in that raises one line when read), ``prompt_ids`` / ``prompt_mask`` from ``prompts`` and
    ``attention_mask`` when given, ``tokenizer``. ``norm_by_std`` comes from ``options``, else from
    the config's ``norm_adv_by_std_in_grpo`` (verl's default True: it makes ``drgrpo`` GRPO unless
    ``norm_by_std=False`` is among ``options``), else the estimator's default; it is passed only
    when the estimator takes it, as oar passes a recipe's.

    Args:
        estimator: an oar estimator name (built-in, ``module:attr`` or an entry point).
        tokenizer: the policy's tokenizer, for estimators that decode (the oracles) or read its eos
            id (``ktae``'s default ``ignore_token_ids``); None otherwise.
        **options: the estimator's options, as in a method's config entry.

    Raises:
        ValueError: one line, for an estimator that needs the policy or continuations.
        KeyError: an unknown estimator.
    """
    fn = bridgeable_estimator(estimator, "verl")
    fixed = dict(options)

    def oar_advantage(*, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                      config: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        batch = _credit_batch(estimator, token_level_rewards, response_mask, index, tokenizer, kwargs)
        with torch.no_grad():
            result = fn(batch, **with_norm_by_std(fn, fixed, _norm_from_config(config)))
        adv = result.token_advantages.to(device=response_mask.device, dtype=token_level_rewards.dtype)
        adv = adv * response_mask.to(adv.dtype)
        return adv, adv

    oar_advantage.__qualname__ = f"oar_advantage[{estimator}]"
    setattr(oar_advantage, SPEC_ATTR, {"estimator": estimator, "tokenizer": tokenizer, "options": fixed})
    return oar_advantage


def register_with_verl(name: str, estimator: str, *, tokenizer: Any = None,
                       **options: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """Register :func:`verl_advantage_fn` of ``estimator`` with verl as ``name``
    (``verl.trainer.ppo.core_algos.register_adv_est``); configs then say
    ``algorithm.adv_estimator=<name>``.

    Idempotent: registering the same estimator, tokenizer and options under ``name`` again returns
    the function already there (verl raises when a name is registered to a different function).
    Call it in the process that computes advantages (verl's driver, the ``TaskRunner``), e.g. in a
    module that the trainer's entry point imports.

    Returns:
        The function registered under ``name``.

    Raises:
        ValueError: one line, when ``name`` is one of :data:`HARDWIRED_NAMES` (verl never looks them
            up), when ``name`` is registered to another function, or for an estimator that needs the
            policy or continuations.
        ModuleNotFoundError: verl is not installed.
    """
    if name in HARDWIRED_NAMES:
        raise ValueError(f"verl advantage estimator name {name!r} is hard-wired in verl's compute_advantage, which "
                         "never calls the registry for it; register under another name, e.g. 'oar_" + estimator + "'")
    fn = verl_advantage_fn(estimator, tokenizer=tokenizer, **options)
    from verl.trainer.ppo import core_algos

    existing = core_algos.ADV_ESTIMATOR_REGISTRY.get(name)
    if existing is not None:
        spec = getattr(existing, SPEC_ATTR, None)
        if spec is not None and spec["estimator"] == estimator and spec["tokenizer"] is tokenizer \
                and spec["options"] == dict(options):
            return existing
        raise ValueError(f"verl advantage estimator {name!r} is already registered to "
                         f"{getattr(existing, '__qualname__', existing)!s} ({spec or 'not oar'}); choose another name")
    core_algos.register_adv_est(name)(fn)
    return fn
