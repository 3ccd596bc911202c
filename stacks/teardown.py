"""The step of `make teardown-all` that is not a `cdk destroy` (runbooks/teardown.md).

    python -m stacks.teardown unprotect-accounting [-c key=value ...]

With slurmAccounting=true and dataRemovalPolicy=retain the accounting database has deletion
protection on and a Snapshot removal policy (stacks/accounting.py): CloudFormation cannot delete a
protected cluster ("You can't delete a DB cluster when deletion protection is enabled",
DeletionProtection of AWS::RDS::DBCluster), so `cdk destroy <project>-storage` would fail half-way.
This turns the protection off with the AWS CLI (ModifyDBCluster --no-deletion-protection); the
stack's deletion then takes the final snapshot, which keeps the job history. Without accounting
it does nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

# As app.py: Node 20 is past its end of life on the build machines; jsii's banner would bury the line.
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

from stacks.accounting import cluster_identifier  # noqa: E402  (after the environment above)
from stacks.config import ConfigError  # noqa: E402
from stacks.cost import config_from_args  # noqa: E402


def unprotect_command(identifier: str, region: str) -> list[str]:
    return ["aws", "rds", "modify-db-cluster", "--db-cluster-identifier", identifier, "--no-deletion-protection",
            "--apply-immediately", *(["--region", region] if region else [])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stacks.teardown", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("unprotect-accounting",))
    parser.add_argument("-c", "--context", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args.context)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not cfg.slurmAccounting or cfg.dataRemovalPolicy != "retain":
        print("teardown: no protected accounting database (slurmAccounting=false or dataRemovalPolicy=destroy)")
        return 0
    command = unprotect_command(cluster_identifier(cfg.retained_prefix), cfg.region)
    print(f"teardown: {shlex.join(command)}  (the storage stack's deletion then snapshots the database)", flush=True)
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"error: turning off the accounting database's deletion protection failed: {last}; the storage "
              "stack cannot be deleted while it is on", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
