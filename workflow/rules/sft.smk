# Warm-start SFT on reference solutions (synthetic task, or a format warm-up on GSM8K); only when sft.enabled.
# Writes the model (save_pretrained) and sft_summary.json into results/<name>/sft/model/.


rule sft:
    input:
        manifest=MANIFEST,
        **model_inputs(),  # a hub model.source: its fetched folder, which `oar sft` loads (rules/model.smk)
    output:
        summary=SFT_SUMMARY,
    params:
        oar=oar_command,
        config=CONFIG_FILE,
        model_dir=lambda wc, output: os.path.dirname(output.summary),
        fingerprint=sft_key(config),
    log:
        TREE.log("sft"),
    benchmark:
        TREE.benchmark("sft")
    threads: res("sft", "threads")
    resources:
        gpu=res("sft", "gpu"),
        mem_mb=res("sft", "mem_mb"),
        runtime=res("sft", "runtime"),
    conda:
        CONDA_ENV
    shell:
        "({params.oar} sft --config {params.config:q} --output {params.model_dir:q}) > {log:q} 2>&1"
