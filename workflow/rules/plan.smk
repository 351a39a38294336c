# Memory plan (`oar plan`, src/oar/plan/): per-GPU memory of training and of the vLLM engine,
# term by term, written to results/<name>/plan.txt. Only when training uses GPUs
# (resources.train.gpu > 0, e.g. config/paper.yaml): the train rule takes plan.txt as an input, so a
# config that cannot fit fails here, before any GPU training job, with a message naming the term
# that breaks it and the keys that shrink it. Runs on the submitting host (a few seconds, no GPU).


rule plan:
    output:
        PLAN_FILE,
    params:
        oar=oar_command,
        config=CONFIG_FILE,
        fingerprint=plan_fingerprint(config),
    log:
        TREE.log("plan"),
    localrule: True
    conda:
        CONDA_ENV
    shell:
        "{params.oar} plan --config {params.config:q} --output {output:q} 2>&1 | tee {log:q}"
