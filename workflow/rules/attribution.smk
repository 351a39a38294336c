# Attribution benchmark of the token-credit signals on the starting model (only when
# attribution.enabled): error localisation, stability, cost, and pivotal-vs-filler fidelity; and on
# the trained policies listed in attribution.trained (rule attribution_trained).


rule attribution:
    input:
        **start_inputs(),
        **attribution_verifier_inputs(),  # a step_verifier signal's verifier (rules/verifier.smk)
    output:
        csv=f"{R}/attribution/fidelity.csv",
        localisation=f"{R}/attribution/localisation.csv",
        stability=f"{R}/attribution/stability.csv",
        cost=f"{R}/attribution/cost.csv",
        md=f"{R}/attribution/attribution.md",
        png=report(
            f"{R}/attribution/fidelity.png",
            caption="../report/fidelity.rst",
            category="Figures",
            labels={"figure": "attribution fidelity"},
        ),
        localisation_png=report(
            f"{R}/attribution/localisation.png",
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
        f"{R}/logs/attribution.log",
    benchmark:
        f"{R}/benchmarks/attribution.tsv"
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
        summary=f"{R}/{{method}}/seed{{seed}}/train_summary.json",
    output:
        md=f"{R}/attribution/{{method}}_seed{{seed}}/attribution.md",
        localisation=f"{R}/attribution/{{method}}_seed{{seed}}/localisation.csv",
    params:
        oar=oar_command,
        config=CONFIG_FILE,
        model=lambda wc, input: os.path.join(os.path.dirname(input.summary), "model"),
        out_dir=lambda wc, output: os.path.dirname(output.md),
        fingerprint=attribution_fingerprint(config),
    log:
        f"{R}/logs/attribution/{{method}}_seed{{seed}}.log",
    benchmark:
        f"{R}/benchmarks/attribution/{{method}}_seed{{seed}}.tsv"
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
