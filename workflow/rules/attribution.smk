# Attribution benchmark of the token-credit signals on the starting model (only when
# attribution.enabled): error localisation, stability, cost, and pivotal-vs-filler fidelity; and on
# the trained policies listed in attribution.trained (rule attribution_trained).


rule attribution:
    input:
        **start_inputs(),
        **attribution_verifier_inputs(),  # a step_verifier signal's verifier (rules/verifier.smk)
    output:
        csv=f"{TREE.attribution_dir()}/fidelity.csv",
        localisation=f"{TREE.attribution_dir()}/localisation.csv",
        stability=f"{TREE.attribution_dir()}/stability.csv",
        cost=f"{TREE.attribution_dir()}/cost.csv",
        md=f"{TREE.attribution_dir()}/attribution.md",
        png=report(
            f"{TREE.attribution_dir()}/fidelity.png",
            caption="../report/fidelity.rst",
            category="Figures",
            labels={"figure": "attribution fidelity"},
        ),
        localisation_png=report(
            f"{TREE.attribution_dir()}/localisation.png",
            caption="../report/localisation.rst",
            category="Figures",
            labels={"figure": "error localisation"},
        ),
    params:
        oar=oar_command,
        config=CONFIG_FILE,
        model=start_model_param,
        out_dir=lambda wc, output: os.path.dirname(output.csv),
        fingerprint=attribution_fingerprint(config),
    log:
        TREE.log("attribution"),
    benchmark:
        TREE.benchmark("attribution")
    threads: res("attribution", "threads")
    resources:
        gpu=res("attribution", "gpu"),
        mem_mb=res("attribution", "mem_mb"),
        runtime=res("attribution", "runtime"),
    conda:
        CONDA_ENV
    shell:
        "({params.oar} attribution --config {params.config:q} --model {params.model:q}"
        " --output {params.out_dir:q}) > {log:q} 2>&1"


rule attribution_trained:
    input:
        **start_inputs(),
        **attribution_verifier_inputs(),
        summary=TREE.run_summary("{method}", "{seed}"),
    output:
        md=f"{TREE.attribution_dir('{method}', '{seed}')}/attribution.md",
        localisation=f"{TREE.attribution_dir('{method}', '{seed}')}/localisation.csv",
    params:
        oar=oar_command,
        config=CONFIG_FILE,
        model=lambda wc, input: os.path.join(os.path.dirname(input.summary), "model"),
        out_dir=lambda wc, output: os.path.dirname(output.md),
        fingerprint=attribution_fingerprint(config),
    log:
        TREE.log("attribution", "{method}_seed{seed}"),
    benchmark:
        TREE.benchmark("attribution", "{method}_seed{seed}")
    threads: res("attribution", "threads")
    resources:
        gpu=res("attribution", "gpu"),
        mem_mb=res("attribution", "mem_mb"),
        runtime=res("attribution", "runtime"),
    conda:
        CONDA_ENV
    shell:
        "({params.oar} attribution --config {params.config:q} --model {params.model:q}"
        " --output {params.out_dir:q}) > {log:q} 2>&1"
