"""oar: fine-grained credit assignment for reinforcement learning of LLMs on math reasoning.

The packages, bottom to top (a package imports only those below it; tests/test_layers.py):

- :mod:`oar.core` -- atomic files, seeds, statistics, provenance, the markdown writer, devices.
- :mod:`oar.task`, :mod:`oar.data`, :mod:`oar.models`, :mod:`oar.reward` -- the synthetic task's grammar;
  data sets and prompts; model loading, hub fetch and packing; answers, verification and the reward pool.
- :mod:`oar.credit`, :mod:`oar.rollout` -- the advantage estimators (registered by name); the rollout engines.
- :mod:`oar.config` -- configs (loading, overrides, methods, typed settings), identity, the results tree.
- :mod:`oar.plan`, :mod:`oar.tracking` -- the memory plan (``oar plan``); MLflow and each stage's run.
- :mod:`oar.evaluate` -- benchmarks (``oar evaluate``) and the held-out evaluation during training.
- :mod:`oar.trainer` -- the RL loop (``oar train``) and its phases, SFT, the step verifier's training.
- :mod:`oar.attribution`, :mod:`oar.integrations` -- the attribution benchmark; oar's estimators in verl and TRL.
- :mod:`oar.pipeline` -- what the workflow calls: the results store, launch, pre-flight, the data stage.
- :mod:`oar.report` -- tables and figures of a results tree (``oar report``), learning curves, the regime map.
- :mod:`oar.cli` -- the command line (``oar <command>``); :mod:`oar.schemas` holds the config's JSON schema.
"""

__version__ = "0.1.0"
