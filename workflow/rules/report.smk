# Tables (main comparison with paired intervals and the minimum detectable difference, steps to a
# held-out accuracy, efficiency; with eval.transfer, the transfer table, no claim) and figures (learning
# curves, training curves, credit concentration) from every evaluation and training run of the config
# (src/oar/report/).

REPORT_OUTPUTS.update(
    learning=TREE.figure("learning_curves.png"),
    steps=TREE.table("steps_to_threshold.csv"),
    speed=TREE.table("learning_speed.csv"),
)
# the transfer table: only with eval.transfer.benchmarks (then `all` builds the transfer evaluations)
TRANSFER_OUTPUTS = {"transfer": TREE.table("transfer.csv")} if TRANSFER else {}
REPORT_OUTPUTS.update(TRANSFER_OUTPUTS)


rule report:
    input:
        evals=eval_summaries(),
        transfer=transfer_summaries(),
        runs=train_summaries(),
        attribution=report_attribution_inputs(),
    output:
        main=report(
            REPORT_OUTPUTS["main"],
            caption="../report/main.rst",
            category="Tables",
            labels={"table": "main comparison"},
        ),
        md=REPORT_OUTPUTS["md"],
        tex=REPORT_OUTPUTS["tex"],
        steps=report(
            REPORT_OUTPUTS["steps"],
            caption="../report/steps_to_threshold.rst",
            category="Tables",
            labels={"table": "steps to threshold"},
        ),
        speed=report(
            REPORT_OUTPUTS["speed"],
            caption="../report/learning_speed.rst",
            category="Tables",
            labels={"table": "learning speed"},
        ),
        learning=report(
            REPORT_OUTPUTS["learning"],
            caption="../report/learning_curves.rst",
            category="Figures",
            labels={"figure": "learning curves"},
        ),
        efficiency=report(
            REPORT_OUTPUTS["efficiency"],
            caption="../report/efficiency.rst",
            category="Tables",
            labels={"table": "efficiency"},
        ),
        curves=report(
            REPORT_OUTPUTS["curves"],
            caption="../report/training_curves.rst",
            category="Figures",
            labels={"figure": "training curves"},
        ),
        concentration=report(
            REPORT_OUTPUTS["concentration"],
            caption="../report/credit_concentration.rst",
            category="Figures",
            labels={"figure": "credit concentration"},
        ),
        **TRANSFER_OUTPUTS,
    params:
        oar=oar_command,
        config=CONFIG_FILE,
        results=lambda wc, output: os.path.dirname(os.path.dirname(output.main)),
        fingerprint=report_fingerprint(config, METHODS),
    log:
        TREE.log("report"),
    benchmark:
        TREE.benchmark("report")
    threads: res("report", "threads")
    resources:
        gpu=res("report", "gpu"),
        mem_mb=res("report", "mem_mb"),
        runtime=res("report", "runtime"),
    conda:
        CONDA_ENV
    shell:
        "({params.oar} report --config {params.config:q} --results {params.results:q}) > {log:q} 2>&1"
