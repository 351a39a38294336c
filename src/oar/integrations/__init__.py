"""Adapters that take an ``oar`` credit estimator into other RL trainers.

- :mod:`oar.integrations.verl`: a function verl's ``register_adv_est`` accepts
  (:func:`~oar.integrations.verl.verl_advantage_fn`, :func:`~oar.integrations.verl.register_with_verl`);
- :mod:`oar.integrations.trl`: ``OarGRPOTrainer``, a subclass of TRL's ``GRPOTrainer`` whose loss
  receives the estimator's ``(batch, time)`` token advantages.

Only estimators that need no policy model and no continuations can be bridged
(:func:`oar.integrations.common.bridgeable_estimator`): verl computes advantages on its driver, where
no model exists, and the TRL subclass does not hand the policy to the estimator. Neither verl nor
TRL is imported until an adapter is built, so this package imports without them.
"""
