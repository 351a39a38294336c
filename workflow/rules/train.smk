# RL training of one method and seed. Resumable: an interrupted run continues from
# <run>/checkpoint when the workflow is started again (train_summary.json marks a finished run);
# a run folder whose config fingerprint changed starts over (scripts/reset_if_changed.sh).


rule train:
    input:
        **start_inputs(),
    output:
        summary=f"{R}/{{method}}/seed{{seed}}/train_summary.json",
    params:
        config=CONFIG_FILE,
        run_dir=lambda wc, output: os.path.dirname(output.summary),
        init=lambda wc, input: f"--init {os.path.dirname(input.start)}" if SFT else "",
        fingerprint=lambda wc: method_fingerprint(wc.method),
        reset=RESET_SCRIPT,
        launcher=train_launcher,
    log:
        f"{R}/logs/train/{{method}}/seed{{seed}}.log",
    benchmark:
        f"{R}/benchmarks/train/{{method}}/seed{{seed}}.tsv"
    threads: res("train", "threads")
    resources:
        gpu=res("train", "gpu"),
        mem_mb=res("train", "mem_mb"),
        runtime=res("train", "runtime"),
    conda:
        "../../environment.yml"
    shell:
        "(bash {params.reset} {params.run_dir} {params.fingerprint} checkpoint model metrics.jsonl"
        " && {params.launcher} train --config {params.config} --method {wildcards.method} --seed {wildcards.seed}"
        " --output {params.run_dir} {params.init} --no-progress) > {log} 2>&1"
