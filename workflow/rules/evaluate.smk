# Evaluation (greedy pass@1, sampled avg@k) on every benchmark of eval.benchmarks: the starting
# model ("base" row) and every trained method and seed. The fingerprint of an eval folder includes
# a checksum of the rule's inputs (the model's summary), so cached per-benchmark results of an
# older model are dropped (scripts/reset_if_changed.sh) instead of being reused.


rule evaluate_base:
    input:
        **start_inputs(),
    output:
        summary=TREE.eval_summary(BASE_ROW),
    params:
        oar=oar_command,
        config=CONFIG_FILE,
        model=start_model_param,
        out_dir=lambda wc, output: os.path.dirname(output.summary),
        fingerprint=fingerprint(eval_fingerprint(config), start_model()),
        reset=RESET_SCRIPT,
    log:
        TREE.log("evaluate", "base"),
    benchmark:
        TREE.benchmark("evaluate", "base")
    threads: res("evaluate_base", "threads")
    resources:
        gpu=res("evaluate_base", "gpu"),
        mem_mb=res("evaluate_base", "mem_mb"),
        runtime=res("evaluate_base", "runtime"),
    conda:
        CONDA_ENV
    shell:
        "(bash {params.reset:q} {params.out_dir:q} {params.fingerprint:q}-$(cat {input:q} | cksum | cut -d' ' -f1)"
        " '*.json' '*.jsonl'"
        " && {params.oar} evaluate --config {params.config:q} --model {params.model:q} --output {params.out_dir:q}"
        ") > {log:q} 2>&1"


rule evaluate:
    input:
        train=TREE.run_summary("{method}", "{seed}"),
    output:
        summary=TREE.eval_summary("{method}", "{seed}"),
    params:
        oar=oar_command,
        config=CONFIG_FILE,
        model=lambda wc, input: os.path.join(os.path.dirname(input.train), "model"),
        out_dir=lambda wc, output: os.path.dirname(output.summary),
        fingerprint=eval_fingerprint(config),
        reset=RESET_SCRIPT,
    log:
        TREE.log("evaluate", "{method}", "seed{seed}"),
    benchmark:
        TREE.benchmark("evaluate", "{method}", "seed{seed}")
    threads: res("evaluate", "threads")
    resources:
        gpu=res("evaluate", "gpu"),
        mem_mb=res("evaluate", "mem_mb"),
        runtime=res("evaluate", "runtime"),
    conda:
        CONDA_ENV
    shell:
        "(bash {params.reset:q} {params.out_dir:q} {params.fingerprint:q}-$(cksum < {input.train:q} | cut -d' ' -f1)"
        " '*.json' '*.jsonl'"
        " && {params.oar} evaluate --config {params.config:q} --model {params.model:q} --output {params.out_dir:q}"
        " --seed {wildcards.seed:q}) > {log:q} 2>&1"


# The transfer evaluation (eval.transfer): the benchmarks of eval.transfer.benchmarks, with the same
# settings, on the start model and on every seed of the methods of eval.transfer.methods only, reported
# apart with no claim (the report's "Transfer (no claim)" section). Its fingerprint is its own
# (oar.config.identity.transfer_fingerprint), as the main evaluation's leaves eval.transfer out: changing the
# transfer benchmarks reruns these jobs alone, and adding them reruns no main evaluation.


rule evaluate_transfer_base:
    input:
        **start_inputs(),
    output:
        summary=TREE.eval_summary(BASE_ROW, folder=TRANSFER_FOLDER),
    params:
        oar=oar_command,
        config=CONFIG_FILE,
        model=start_model_param,
        out_dir=lambda wc, output: os.path.dirname(output.summary),
        fingerprint=fingerprint(transfer_fingerprint(config), start_model()),
        reset=RESET_SCRIPT,
    log:
        TREE.log("evaluate_transfer", "base"),
    benchmark:
        TREE.benchmark("evaluate_transfer", "base")
    threads: res("evaluate_transfer_base", "threads")
    resources:
        gpu=res("evaluate_transfer_base", "gpu"),
        mem_mb=res("evaluate_transfer_base", "mem_mb"),
        runtime=res("evaluate_transfer_base", "runtime"),
    conda:
        CONDA_ENV
    shell:
        "(bash {params.reset:q} {params.out_dir:q} {params.fingerprint:q}-$(cat {input:q} | cksum | cut -d' ' -f1)"
        " '*.json' '*.jsonl'"
        " && {params.oar} evaluate --transfer --config {params.config:q} --model {params.model:q}"
        " --output {params.out_dir:q}) > {log:q} 2>&1"


rule evaluate_transfer:
    wildcard_constraints:
        method=names_pattern(TRANSFER_METHODS),
    input:
        train=TREE.run_summary("{method}", "{seed}"),
    output:
        summary=TREE.eval_summary("{method}", "{seed}", folder=TRANSFER_FOLDER),
    params:
        oar=oar_command,
        config=CONFIG_FILE,
        model=lambda wc, input: os.path.join(os.path.dirname(input.train), "model"),
        out_dir=lambda wc, output: os.path.dirname(output.summary),
        fingerprint=transfer_fingerprint(config),
        reset=RESET_SCRIPT,
    log:
        TREE.log("evaluate_transfer", "{method}", "seed{seed}"),
    benchmark:
        TREE.benchmark("evaluate_transfer", "{method}", "seed{seed}")
    threads: res("evaluate_transfer", "threads")
    resources:
        gpu=res("evaluate_transfer", "gpu"),
        mem_mb=res("evaluate_transfer", "mem_mb"),
        runtime=res("evaluate_transfer", "runtime"),
    conda:
        CONDA_ENV
    shell:
        "(bash {params.reset:q} {params.out_dir:q} {params.fingerprint:q}-$(cksum < {input.train:q} | cut -d' ' -f1)"
        " '*.json' '*.jsonl'"
        " && {params.oar} evaluate --transfer --config {params.config:q} --model {params.model:q}"
        " --output {params.out_dir:q} --seed {wildcards.seed:q}) > {log:q} 2>&1"
