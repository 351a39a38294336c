# Load every data set the config names (training set, evaluation benchmarks) once, fail early on a
# missing file or an offline hub id, and record provenance (resolved path, sha256, record counts).


rule data:
    output:
        MANIFEST,
    params:
        oar=oar_command,
        config=CONFIG_FILE,
        fingerprint=data_key(config),
    log:
        TREE.log("data"),
    benchmark:
        TREE.benchmark("data")
    threads: res("data", "threads")
    resources:
        gpu=res("data", "gpu"),
        mem_mb=res("data", "mem_mb"),
        runtime=res("data", "runtime"),
    conda:
        CONDA_ENV
    shell:
        "({params.oar} data --config {params.config:q} --output {output:q}) > {log:q} 2>&1"
