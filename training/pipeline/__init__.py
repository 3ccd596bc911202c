"""One recipe, one command: raw images -> features -> training -> export -> report, as chained
Slurm jobs with lineage (runbooks/pipelines.md).

    python -m training.pipeline submit RECIPE.yaml    queue what is not finished; one table
    python -m training.pipeline status RUN            each stage's state; a failure's cause in one line
    python -m training.pipeline cancel RUN            cancel the chain's queued and running jobs
    python -m training.pipeline lineage MODEL_DIR     features, config, code and env of a model

Each stage is a job of the package's own scripts (training/slurm/*.sbatch through launch.sh),
in a directory named by the content hash of its inputs, with ``run.json`` as its only
"finished" mark: resubmitting an unchanged recipe runs nothing, a changed training override
re-runs train, export and report only, and a failed stage is continued by the next submit.

Modules: ``recipe`` (the YAML's dataclasses and validation), ``keys`` (content hashes),
``site`` (roots, via ``launch.sh paths``), ``plan`` (recipe -> stages), ``slurm`` (the
commands), ``records`` (stage.json, run.json, submitted.json), ``submit``, ``status``,
``record`` (a stage job's last step), ``report`` (the report stage), ``lineage``, ``cli``.
"""
