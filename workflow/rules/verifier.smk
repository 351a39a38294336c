# The step verifier of credit step_verifier (oar.credit.verifier), trained when a method reads the one its
# config trains (option verifier: trained, the default): the start model fine-tuned on the task's
# demonstrations with the next-token loss on the right steps' results only; results/<name>/verifier/model/
# (save_pretrained, verifier_summary.json with its held-out step accuracy), in the store by its key
# (oar.config.identity.verifier_key: the verifier section, the task, the start model).


rule verifier:
    input:
        **start_inputs(),
    output:
        summary=VERIFIER_SUMMARY,
    params:
        oar=oar_command,
        config=CONFIG_FILE,
        model=start_model_param,
        out_dir=lambda wc, output: os.path.dirname(output.summary),
        fingerprint=verifier_key(config, sft=SFT),
    log:
        TREE.log("verifier"),
    benchmark:
        TREE.benchmark("verifier")
    threads: res("sft", "threads")
    resources:
        gpu=res("sft", "gpu"),
        mem_mb=res("sft", "mem_mb"),
        runtime=res("sft", "runtime"),
    conda:
        CONDA_ENV
    shell:
        "({params.oar} verifier --config {params.config:q} --model {params.model:q} --output {params.out_dir:q}"
        " --no-progress) > {log:q} 2>&1"
