# RL training of one method and seed. Resumable: an interrupted run continues from
# <run>/checkpoint when the workflow is started again (train_summary.json marks a finished run);
# a run folder whose fingerprint changed starts over (scripts/reset_if_changed.sh). The fingerprint
# is the method's config sections plus a checksum of the rule's inputs (the data manifest and the
# start model's sft_summary.json, rewritten whenever SFT reruns), so after `--forcerun sft` (or a
# changed data set) every training job drops its checkpoint, model and metrics and starts over from
# the new start model instead of "resuming" a finished run trained from the old one.
# Signals (SLURM's time limit, preemption, scancel; Ctrl-C): the trainer finishes its step, writes a
# checkpoint and exits 75 (oar.trainer.preemption). On SLURM the job asks for SIGTERM
# train.preemption.signal_seconds before its time limit (train_resources: slurm_extra), the rules'
# shell outlives the signal (common.smk: shell.prefix), torchrun waits that long for its workers,
# and the SLURM profile's retries resubmit the job, which resumes from the checkpoint.


rule train:
    input:
        **start_inputs(),
        **plan_inputs(),  # GPU training waits for `oar plan` (rules/plan.smk)
        verifier=verifier_input,  # credit step_verifier: the verifier this config trains (rules/verifier.smk)
    output:
        summary=TREE.run_summary("{method}", "{seed}"),
    params:
        config=CONFIG_FILE,
        # the inputs whose checksum joins the fingerprint (not the plan: a new plan is no new run)
        checksummed=lambda wc, input: " ".join(shlex.quote(f) for k, f in input.items() if k != "plan"),
        run_dir=lambda wc, output: os.path.dirname(output.summary),
        init=start_init_param,  # the SFT output or the fetched model (common.smk)
        # what identifies the run (its store entry's key): a folder whose key changed is moved aside
        fingerprint=lambda wc: run_key(config, METHODS[wc.method], sft=SFT),
        # the keys a run may change and continue: a changed value reruns the job, which continues
        resumable=fingerprint(resumable_train_values(config)),
        reset=RESET_SCRIPT,
        launcher=train_launcher,
    log:
        TREE.log("train", "{method}", "seed{seed}"),
    benchmark:
        TREE.benchmark("train", "{method}", "seed{seed}")
    threads: res("train", "threads")
    resources:
        mem_mb=res("train", "mem_mb"),
        runtime=res("train", "runtime"),
        **train_resources(),  # gpu, nodes (and for several nodes the SLURM task layout)
    conda:
        CONDA_ENV
    shell:
        "(bash {params.reset:q} {params.run_dir:q} {params.fingerprint:q}-$(cat {params.checksummed} | cksum | cut -d' ' -f1)"
        " checkpoint model metrics.jsonl"
        " && {params.launcher} train --config {params.config:q} --method {wildcards.method:q}"
        " --seed {wildcards.seed:q} --output {params.run_dir:q} {params.init} --no-progress) > {log:q} 2>&1"
