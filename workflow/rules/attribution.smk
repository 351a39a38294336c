# Attribution-fidelity benchmark of the token-importance estimators on the starting model
# (only when attribution.enabled).


rule attribution:
    input:
        **start_inputs(),
    output:
        csv=f"{R}/attribution/fidelity.csv",
        png=report(
            f"{R}/attribution/fidelity.png",
            caption="../report/fidelity.rst",
            category="Figures",
            labels={"figure": "attribution fidelity"},
        ),
    params:
        config=CONFIG_FILE,
        model=start_model_param,
        out_dir=lambda wc, output: os.path.dirname(output.csv),
        fingerprint=fingerprint(section("attribution", "model", "task", "sft")),
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
        "../../environment.yml"
    shell:
        "(oar attribution --config {params.config:q} --model {params.model:q}"
        " --output {params.out_dir:q}) > {log:q} 2>&1"
