"""The platform as code: one module per concern.

config.py (PlatformConfig, no CDK import), network.py, storage.py, cluster.py (stacks and
their constructs), accounting.py (the optional Slurm accounting database), platform.py (build_app: config -> stacks -> cdk-nag), audit.py
(`python -m stacks.audit cdk.out`). Kept import-free so that `stacks.config` and
`stacks.audit` load without starting the jsii runtime.
"""
