"""oar: fine-grained credit assignment for reinforcement learning of LLMs on math reasoning.

Subpackages and modules:

- :mod:`oar.credit` -- token credit: advantage estimators (GRPO, Dr. GRPO, KTAE, OAR-P, OAR-G, mc_value,
  the controls), registered by name.
- :mod:`oar.rollout` -- rollout engines (``base``: the :class:`~oar.rollout.Rollout` batch and padding;
  ``lean``, ``hf``, ``vllm``) and :func:`~oar.rollout.make_engine`.
- :mod:`oar.integrations` -- an oar estimator inside verl (``register_adv_est``) or TRL (a ``GRPOTrainer``).
- :mod:`oar.attribution` -- the attribution benchmark (``oar attribution``): does a credit signal blame the mistake.
- :mod:`oar.task` -- the synthetic task's grammar and token parsing, below the credit layer (its oracles, OAR-P's tie, the step splitter).
- :mod:`oar.report` -- the comparison tables and figures of a results tree (``oar report``).
- :mod:`oar.data` -- the synthetic arithmetic task, real benchmark loaders, prompt templates and the
  data manifest (``oar data``).
- :mod:`oar.schemas` -- the config's JSON schema (YAML).
- :mod:`oar.manifest` -- the data stage (``oar data``): every data set a config names, loaded, checked, described.
- :mod:`oar.data_checks` -- the records against the model and the reward: prompts against the context, unreadable golds.
- :mod:`oar.train` -- the RL training loop shared by every method (``oar train``).
- :mod:`oar.run_setup` -- setting up a training run: model, optimizer, data, engine, tracker (:class:`~oar.run_setup.TrainingRun`).
- :mod:`oar.batch` -- one step's batch: the prompts' resumable order, sampling, scoring, dynamic sampling, step seeds.
- :mod:`oar.update` -- the policy update: PPO epochs over packed micro-batches, the optimizer step, the schedule.
- :mod:`oar.checkpoint` -- writing a training checkpoint; a full disk named in one line.
- :mod:`oar.run_end` -- how a training run ends: the final model, ``train_summary.json``, the interrupted summary.
- :mod:`oar.loss` -- PPO-clip policy loss, aggregation modes and the k3 KL estimator.
- :mod:`oar.packing` -- micro-batch layouts of the policy update and their response log-probs.
- :mod:`oar.strategy` -- how the policy is spread over processes and its training precision.
- :mod:`oar.plan` -- the memory plan of a config (``oar plan``) and the training job's layout.
- :mod:`oar.launch` -- how the workflow sizes and starts its jobs (resources, torchrun / srun, conda env).
- :mod:`oar.models` -- policy loading (local dir, hub id, GGUF) and the tiny model factory.
- :mod:`oar.fetch` -- a hub model fetched once into a local folder before any job reads it.
- :mod:`oar.preflight` -- checks before anything runs: every path the config names, the
  profile's placeholders.
- :mod:`oar.sft` -- warm-start supervised fine-tuning on reference solutions.
- :mod:`oar.optim` -- the learning-rate schedule and weight-decay groups SFT and RL training share.
- :mod:`oar.reward` -- answer checking with math-verify in a pool of worker processes.
- :mod:`oar.answer` -- locating final answers in model outputs and reference solutions.
- :mod:`oar.evaluate` -- evaluation of a checkpoint on benchmarks (``oar evaluate``).
- :mod:`oar.heldout` -- the held-out evaluation during training.
- :mod:`oar.learning_curves` -- held-out learning curves and steps to a threshold.
- :mod:`oar.regimes` -- the regime map (``config/regimes.yaml``).
- :mod:`oar.seeds` -- the seed derivations: one run seed gives each random draw of a run its own seed.
- :mod:`oar.stats` -- the reports' statistics: seed-level intervals and power, problem-level bootstrap.
- :mod:`oar.markdown` -- the one markdown-table writer behind every table the reports print.
- :mod:`oar.config` -- loading, validating and resolving a YAML config (also the workflow's: defaults,
  ``extends``, typed ``--config`` overrides).
- :mod:`oar.identity` -- what identifies each result (fingerprints, the results store's keys) and which keys a run may change and continue.
- :mod:`oar.layout` -- the results store shared by every config, and each config's links into it.
- :mod:`oar.runs` -- a training run's output folder (contents, ownership, resume, checkpoint checks).
- :mod:`oar.preemption` -- stopping training cleanly on a signal, and checkpoints by step or by time.
- :mod:`oar.tracking` -- experiment tracking: MLflow plus ``metrics.jsonl``.
- :mod:`oar.stage_runs` -- one MLflow run per pipeline stage (SFT, training, evaluation, attribution,
  report), tagged and related so the runs table shows methods x seeds with their scores.
- :mod:`oar.provenance` -- which code, software and machine made a result (summaries, MLflow tags, main.md).
- :mod:`oar.io` -- atomic, resumable file output.
- :mod:`oar.cli` -- the command line (``oar <command>``).
"""

__version__ = "0.1.0"
