"""The real CDK CLI shows a bad context value as one clear line (no traceback)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_bad_context_value_via_cli_prints_one_line(tmp_path, cdk):
    proc = cdk("synth", "--quiet", "--no-notices", "--output", str(tmp_path / "out"),
                   "-c", "gpuInstanceType=ml.trn1.32xlarge")
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert ("error: invalid context value gpuInstanceType='ml.trn1.32xlarge': a Trainium type is not "
            "allowed in the GPU group (set trnInstanceType instead); allowed: ml.p5.48xlarge") in output
    assert "Traceback" not in output


def test_bad_context_value_via_python_api_fails_before_any_stack_is_built():
    from stacks.config import ConfigError
    from stacks.platform import build_app

    with pytest.raises(ConfigError) as err:
        build_app({"fsxStorageGiB": "1000"})
    assert str(err.value) == ("invalid context value fsxStorageGiB=1000: allowed: 1200 or a multiple of 2400 "
                              "(FSx for Lustre PERSISTENT_2)")


def test_app_entry_point_prints_the_one_line_and_exits_2():
    # A subprocess: the CLI hands context to app.py in CDK_CONTEXT_JSON, read by jsii's node
    # process at start, so it cannot be changed inside this already-running test process.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CDK_CONTEXT_JSON": json.dumps({"gpuInstanceCount": "0", "trnInstanceCount": "0"})}
    proc = subprocess.run([sys.executable, "app.py"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: invalid context value gpuInstanceCount=0: at least one worker group is needed: set "
        "gpuInstanceCount or trnInstanceCount to 1 or more"]


@pytest.mark.parametrize(("context", "line"), [
    ({"slurmAccounting": "true", "continuousProvisioning": "false"},
     "error: invalid context value slurmAccounting=True: an external accounting database is supported only "
     "with Continuous node provisioning: set continuousProvisioning=true or slurmAccounting=false"),
    ({"clusterUsers": "ana:2001,ben:2001"},
     "error: invalid context value clusterUsers='ana:2001,ben:2001': duplicate uid 2001; allowed: each uid once"),
])
def test_app_refuses_bad_users_and_accounting_without_continuous_in_one_line(context, line):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "CDK_CONTEXT_JSON": json.dumps(context)}
    proc = subprocess.run([sys.executable, "app.py"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [line]
