# Fetch a hub model.source (an org/name id, not a local folder or file) once, on the submitting host
# (a local rule: compute nodes often cannot reach the hub), into <models_dir>/<org>--<name>/,
# atomically, oar_fetch.json written last (src/oar/models/fetch.py; models_dir null: <results_dir>/models).
# Every job that loads the model (sft; without sft train, evaluate_base, attribution) takes the
# marker as an input and reads that folder (common.smk: model_source, model_inputs). Offline, a
# complete copy in the local Hugging Face cache is used; without one the rule fails in one line
# naming model.source and what to do. Not defined for a local model (tiny, smollm2, a folder).

if HUB_MODEL:

    rule fetch_model:
        output:
            HUB_MODEL.marker,
        params:
            oar=oar_command,
            source=HUB_MODEL.repo_id,
            folder=lambda wc, output: os.path.dirname(output[0]),  # HUB_MODEL.folder
            gguf=f"--gguf-file {shlex.quote(HUB_MODEL.gguf_file)}" if HUB_MODEL.gguf_file else "",
        log:
            TREE.log("fetch_model"),
        localrule: True
        conda:
            CONDA_ENV
        shell:
            "{params.oar} fetch-model --source {params.source:q} --output {params.folder:q} {params.gguf}"
            " 2>&1 | tee {log:q}"
