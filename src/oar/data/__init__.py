"""Data inputs: the synthetic arithmetic task, real math benchmarks and prompt templates.

- :mod:`oar.data.synthetic` -- ``generate(split, n, seed=..., **task_options)``, the embedded default task.
- :mod:`oar.data.benchmarks` -- ``load_benchmark(name, source, **options)``, one entry point for
  every benchmark (real ones from local files or the hub, and the synthetic splits).
- :mod:`oar.data.prompts` -- ``render_prompt(template, question, tokenizer=None)``.
- :mod:`oar.data.records` -- ``training_records(task)``: the training set of a config's task, the
  one loader RL training, SFT and ``oar data`` share.

The data stage built on them (``oar data``: the manifest, and the checks against the model and the
reward) is :mod:`oar.pipeline.data_stage` and :mod:`oar.evaluate.prompt_checks`, above the model and evaluation layers.
"""

from oar.data.benchmarks import BENCHMARK_NAMES, HubUnavailableError, load_benchmark
from oar.data.prompts import TEMPLATES, render_prompt
from oar.data.synthetic import generate

__all__ = ["BENCHMARK_NAMES", "HubUnavailableError", "TEMPLATES", "generate", "load_benchmark", "render_prompt"]
