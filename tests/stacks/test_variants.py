"""Context variants: each synthesizes (nag-clean, else synth raises) and has the asked-for shape.

``gpu_only`` goes through the real CDK CLI with ``-c`` overrides (see conftest.py).
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_gpu_only_p4d_without_login_via_cli_overrides(gpu_only):
    groups = gpu_only.groups()
    assert list(groups) == ["controller", "gpu"]
    gpu = groups["gpu"]
    assert (gpu["InstanceType"], gpu["InstanceCount"]) == ("ml.p4d.24xlarge", 4)
    assert gpu["SlurmConfig"] == {"NodeType": "Compute", "PartitionNames": ["gpu"]}
    assert gpu["ThreadsPerCore"] == 1
    assert "OnStartDeepHealthChecks" not in gpu  # -c deepHealthChecks=false


def test_gpu_only_settings_list_only_existing_groups(gpu_only):
    (settings_file,) = gpu_only.outdir.glob("asset.*/platform-settings.json")
    assert '"groups":{"controller":"controller","gpu":"gpu"}' in settings_file.read_text()


def test_trainium_only_trn2_with_login_pinned_to_region(trn_only):
    groups = trn_only.groups()
    assert list(groups) == ["controller", "login", "trn"]
    trn = groups["trn"]
    assert (trn["InstanceType"], trn["InstanceCount"]) == ("ml.trn2.48xlarge", 2)
    assert trn["SlurmConfig"] == {"NodeType": "Compute", "PartitionNames": ["trn"]}
    assert trn["OnStartDeepHealthChecks"] == ["InstanceStress", "InstanceConnectivity"]
    assert groups["login"]["SlurmConfig"] == {"NodeType": "Login"}
    subnets = trn_only.resources("Network", "AWS::EC2::Subnet").values()
    assert {s["Properties"]["AvailabilityZoneId"] for s in subnets} == {"use2-az3"}
    manifest = json.loads((trn_only.outdir / "manifest.json").read_text())
    assert manifest["artifacts"]["sana-cluster"]["environment"] == "aws://unknown-account/us-east-2"


def test_both_groups_with_login_is_the_default(default):
    assert list(default.groups()) == ["controller", "login", "gpu", "trn"]


@pytest.mark.parametrize("variant", ["default", "gpu_only", "trn_only"])
def test_every_group_shares_role_lifecycle_and_fsx(synthesized, variant):
    synth = synthesized(variant)
    groups = list(synth.groups().values())
    assert len({json.dumps(g["ExecutionRole"]) for g in groups}) == 1
    assert len({json.dumps(g["LifeCycleConfig"]) for g in groups}) == 1
    assert all(g["InstanceStorageConfigs"][1]["FsxLustreConfig"]["MountPath"] == "/fsx" for g in groups)
