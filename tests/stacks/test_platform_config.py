"""PlatformConfig: defaults, parsing of `-c` strings, and every bad value's one-line message (no synth)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from stacks.config import ConfigError, PlatformConfig, PosixAccount, az_id_prefix, check_known_keys

REPO = Path(__file__).resolve().parents[2]


def test_cdk_json_context_equals_the_dataclass_defaults():
    import json

    context = json.loads((REPO / "cdk.json").read_text())["context"]
    ours = {k: v for k, v in context.items() if re.fullmatch(r"[a-z][a-zA-Z0-9]*", k)}
    assert ours == PlatformConfig.context_defaults()
    # ...and cdk.json's values parse back to exactly the dataclass defaults.
    assert PlatformConfig.from_context(ours) == PlatformConfig()
    assert set(ours) == {f.name for f in dataclasses.fields(PlatformConfig)}


def test_strings_from_cli_are_parsed():
    cfg = PlatformConfig.from_context({
        "gpuInstanceCount": "3", "trnInstanceCount": " 0 ", "deepHealthChecks": "False",
        "fsxStorageGiB": "4800", "fsxThroughputPerTiB": "500", "loginInstanceCount": "0",
    })
    assert (cfg.gpuInstanceCount, cfg.trnInstanceCount, cfg.deepHealthChecks) == (3, 0, False)
    assert (cfg.fsxStorageGiB, cfg.fsxThroughputPerTiB) == (4800, 500)
    assert cfg.groups == {"controller": "controller", "gpu": "gpu"}
    assert PlatformConfig.from_context({"deepHealthChecks": "yes"}).deepHealthChecks is True


def test_derived_subnets_split_the_vpc():
    cfg = PlatformConfig(vpcCidr="10.20.0.0/20")
    assert (cfg.private_subnet_cidr, cfg.public_subnet_cidr) == ("10.20.0.0/21", "10.20.8.0/28")


@pytest.mark.parametrize(("region", "prefix"), [
    ("us-east-1", "use1"), ("us-west-2", "usw2"), ("ap-northeast-1", "apne1"), ("eu-central-1", "euc1"),
    ("ap-southeast-2", "apse2"), ("sa-east-1", "sae1"),
])
def test_az_id_prefix(region, prefix):
    assert az_id_prefix(region) == prefix


BAD = [
    ({"fsxStorageGiB": "1000"}, "invalid context value fsxStorageGiB=1000: allowed: 1200 or a multiple of 2400"),
    ({"fsxStorageGiB": 3600}, "invalid context value fsxStorageGiB=3600: allowed: 1200 or a multiple of 2400"),
    ({"fsxThroughputPerTiB": "300"}, "invalid context value fsxThroughputPerTiB=300: allowed: 125, 250, 500, 1000"),
    ({"gpuInstanceType": "ml.trn1.32xlarge"},
     "invalid context value gpuInstanceType='ml.trn1.32xlarge': a Trainium type is not allowed in the GPU group"),
    ({"trnInstanceType": "ml.p5.48xlarge"},
     "invalid context value trnInstanceType='ml.p5.48xlarge': a GPU type is not allowed in the Trainium group"),
    ({"gpuInstanceType": "ml.p9.48xlarge"}, "invalid context value gpuInstanceType='ml.p9.48xlarge': allowed: ml.p5.48xlarge"),
    ({"controllerInstanceType": "ml.p5.48xlarge"},
     "invalid context value controllerInstanceType='ml.p5.48xlarge': allowed: ml.m5.large"),
    ({"gpuInstanceCount": "0", "trnInstanceCount": "0"},
     "invalid context value gpuInstanceCount=0: at least one worker group is needed"),
    ({"gpuInstanceCount": "-1"}, "invalid context value gpuInstanceCount=-1: allowed: an integer from 0 to 1000"),
    ({"gpuInstanceCount": "two"}, "invalid context value gpuInstanceCount='two': allowed: an integer"),
    ({"controllerInstanceCount": "0"}, "invalid context value controllerInstanceCount=0: allowed: 1"),
    ({"loginInstanceCount": "9"}, "invalid context value loginInstanceCount=9: allowed: an integer from 0 to 4"),
    ({"clusterName": "sana_cluster"}, "invalid context value clusterName='sana_cluster': allowed: 1-63 letters"),
    ({"clusterName": "-sana"}, "invalid context value clusterName='-sana': allowed: 1-63 letters"),
    ({"clusterName": "a" * 64}, f"invalid context value clusterName='{'a' * 64}': allowed: 1-63 letters"),
    ({"projectName": "Sana"}, "invalid context value projectName='Sana': allowed: 2-20 characters"),
    ({"account": "1234"}, "invalid context value account='1234': allowed: empty or a 12-digit AWS account ID"),
    ({"region": "mars-1"}, "invalid context value region='mars-1': allowed: empty or an AWS region name"),
    ({"availabilityZoneId": "us-east-1a"},
     "invalid context value availabilityZoneId='us-east-1a': allowed: an availability zone ID such as use1-az4"),
    ({"region": "us-west-2"}, "invalid context value availabilityZoneId='use1-az4': allowed: an AZ ID of region "
                              "us-west-2, i.e. usw2-az<N>"),
    ({"vpcCidr": "10.0.0.0/8"}, "invalid context value vpcCidr='10.0.0.0/8': allowed: a private IPv4 network"),
    ({"vpcCidr": "8.8.0.0/16"}, "invalid context value vpcCidr='8.8.0.0/16': allowed: a private IPv4 network"),
    ({"gpuEbsGiB": "0"}, "invalid context value gpuEbsGiB=0: allowed: an integer from 1 to 16384"),
    ({"deepHealthChecks": "maybe"}, "invalid context value deepHealthChecks='maybe': allowed: true or false"),
    ({"nodeRecovery": "auto"}, "invalid context value nodeRecovery='auto': allowed: Automatic, None"),
    ({"dataRemovalPolicy": "delete"}, "invalid context value dataRemovalPolicy='delete': allowed: retain, destroy"),
    # cluster users and group
    ({"clusterUsers": "ana:2001,ana:2002"},
     "invalid context value clusterUsers='ana:2001,ana:2002': duplicate user name 'ana'; allowed: each name once"),
    ({"clusterUsers": ["ana:2001", "ben:2001"]},
     "invalid context value clusterUsers=['ana:2001', 'ben:2001']: duplicate uid 2001; allowed: each uid once"),
    ({"clusterUsers": "ana:999"}, "invalid context value clusterUsers='ana:999': user id 999 is reserved; allowed: "
                                  "2000-59999 (below 2000: system accounts, the AMI's ubuntu user and ssm-user"),
    ({"clusterUsers": "ana:1000"}, "invalid context value clusterUsers='ana:1000': user id 1000 is reserved"),
    # ssm-user's UID: the SSM agent creates it with the next free UID (1001 after ubuntu).
    ({"clusterUsers": "ana:1001"}, "invalid context value clusterUsers='ana:1001': user id 1001 is reserved"),
    ({"clusterUsers": "ana:2002,ben:1999"},
     "invalid context value clusterUsers='ben:1999': user id 1999 is reserved; allowed: 2000-59999"),
    ({"clusterUsers": "ana:65534"}, "invalid context value clusterUsers='ana:65534': user id 65534 is reserved; "
                                    "allowed: 2000-59999"),
    ({"clusterUsers": "ana:60000"}, "invalid context value clusterUsers='ana:60000': user id 60000 is reserved"),
    ({"clusterUsers": "Ana:2001"}, "invalid context value clusterUsers='Ana:2001': bad user name 'Ana'; allowed: "
                                   "1-32 characters, a lower-case letter or '_' first"),
    ({"clusterUsers": "1ana:2001"}, "invalid context value clusterUsers='1ana:2001': bad user name '1ana'"),
    ({"clusterUsers": "a" * 33 + ":2001"}, "invalid context value clusterUsers='" + "a" * 33 + ":2001': bad user name"),
    ({"clusterUsers": "ubuntu:2001"}, "invalid context value clusterUsers='ubuntu:2001': user name 'ubuntu' already "
                                      "exists on HyperPod nodes"),
    ({"clusterUsers": "ssm-user:2001"}, "invalid context value clusterUsers='ssm-user:2001': user name 'ssm-user'"),
    ({"clusterUsers": "ana"}, "invalid context value clusterUsers='ana': allowed: user specs written name:id"),
    ({"clusterUsers": "ana:x1"}, "invalid context value clusterUsers='ana:x1': user id 'x1' is not a number"),
    ({"clusterUsers": " , "}, "invalid context value clusterUsers=' , ': allowed: at least one name:uid"),
    ({"clusterUsers": []}, "invalid context value clusterUsers=[]: allowed: at least one name:uid"),
    ({"clusterUsers": 2001}, "invalid context value clusterUsers=2001: allowed: a list of name:uid strings"),
    ({"clusterGroup": "sana:2001"}, "invalid context value clusterGroup='sana:2001': gid 2001 is user researcher's uid"),
    ({"clusterGroup": "researcher:3000"},
     "invalid context value clusterGroup='researcher:3000': name 'researcher' is a user's name"),
    ({"clusterGroup": "sana:500"}, "invalid context value clusterGroup='sana:500': group id 500 is reserved"),
    ({"clusterGroup": "sana:1001"}, "invalid context value clusterGroup='sana:1001': group id 1001 is reserved"),
    ({"clusterGroup": "docker:3000"}, "invalid context value clusterGroup='docker:3000': group name 'docker' already"),
    ({"clusterGroup": "sana"}, "invalid context value clusterGroup='sana': allowed: group specs written name:id"),
    # admins: cluster users with sudo, through a group of their own
    ({"clusterAdmins": "mallory"}, "invalid context value clusterAdmins='mallory': not a clusterUsers name (an "
                                   "admin is a cluster user who may sudo); allowed: researcher"),
    ({"clusterUsers": "ana:2001,ben:2002", "clusterAdmins": ["ana", "ana"]},
     "invalid context value clusterAdmins='ana': listed twice; allowed: each name once"),
    ({"clusterAdminGroup": "sana:2999"}, "invalid context value clusterAdminGroup='sana:2999': is clusterGroup's name"),
    ({"clusterAdminGroup": "ops:2000"}, "invalid context value clusterAdminGroup='ops:2000': is clusterGroup's gid"),
    ({"clusterAdminGroup": "ops:2001"}, "invalid context value clusterAdminGroup='ops:2001': user researcher has that uid"),
    ({"clusterAdminGroup": "researcher:2999"},
     "invalid context value clusterAdminGroup='researcher:2999': user researcher has that name"),
    ({"clusterAdminGroup": "sudo:2999"}, "invalid context value clusterAdminGroup='sudo:2999': group name 'sudo' already"),
    ({"clusterAdminGroup": "ops:999"}, "invalid context value clusterAdminGroup='ops:999': group id 999 is reserved"),
    # the generation of a redeploy after a full teardown
    ({"deploymentGeneration": "0"}, "invalid context value deploymentGeneration=0: allowed: an integer from 1 to 99"),
    ({"deploymentGeneration": "100"}, "invalid context value deploymentGeneration=100: allowed: an integer from 1 to 99"),
    ({"projectName": "a" * 18, "deploymentGeneration": "2"},
     "invalid context value deploymentGeneration=2: projectName with its generation is 'aaaaaaaaaaaaaaaaaa-g2', "
     "over 20 characters"),
    ({"containerRuntime": "maybe"}, "invalid context value containerRuntime='maybe': allowed: true or false"),
    ({"continuousProvisioning": "sometimes"},
     "invalid context value continuousProvisioning='sometimes': allowed: true or false"),
    ({"slurmAccounting": "true", "continuousProvisioning": "false"},
     "invalid context value slurmAccounting=True: an external accounting database is supported only with "
     "Continuous node provisioning: set continuousProvisioning=true or slurmAccounting=false"),
]


@pytest.mark.parametrize(("context", "expected"), BAD, ids=[next(iter(c)) + "-" + str(i) for i, (c, _) in enumerate(BAD)])
def test_bad_value_fails_with_one_line_naming_key_value_and_allowed(context, expected):
    with pytest.raises(ConfigError) as err:
        PlatformConfig.from_context(context)
    message = str(err.value)
    assert message.startswith(expected)
    assert "\n" not in message


def test_unknown_platform_key_is_rejected_but_cdk_keys_pass():
    check_known_keys({"@aws-cdk/core:foo": True, "aws:cdk:enable-path-metadata": True, "cli-telemetry": False})
    with pytest.raises(ConfigError, match=r"^invalid context value gpuInstanceCont='2': unknown context key; "
                                          r"known keys: .*gpuInstanceCount"):
        check_known_keys({"gpuInstanceCont": "2"})


def test_cluster_users_from_cdk_json_list_and_from_cli_string():
    from_list = PlatformConfig.from_context({"clusterUsers": ["ana:2001", "ben:2002"], "clusterGroup": "lab:3000"})
    from_cli = PlatformConfig.from_context({"clusterUsers": " ana:2001 , ben:2002 ", "clusterGroup": " lab:3000 "})
    assert from_list == from_cli
    assert from_list.clusterUsers == (PosixAccount("ana", 2001), PosixAccount("ben", 2002))
    assert from_list.clusterGroup == PosixAccount("lab", 3000)
    assert PlatformConfig().clusterUsers == (PosixAccount("researcher", 2001),)
    # Boundaries of the allowed ID range are accepted.
    assert PlatformConfig.from_context({"clusterUsers": "lo:2000,hi:59999", "clusterGroup": "lab:3000"}).clusterUsers[1].id == 59999


def test_users_built_in_python_are_validated_too():
    with pytest.raises(ConfigError, match=r"^invalid context value clusterUsers=.*user id 0 is reserved"):
        PlatformConfig(clusterUsers=(PosixAccount("ana", 0),))


def test_settings_carry_users_group_home_root_and_accounting():
    cfg = PlatformConfig.from_context({"clusterUsers": "ana:2001,ben:2002", "clusterGroup": "lab:3000",
                                       "slurmAccounting": "true"})
    settings = cfg.settings(region="us-east-1", data_bucket="d", artefacts_bucket="a", lifecycle_bucket="l",
                            package_hash="0" * 16)
    assert settings["cluster_group"] == {"name": "lab", "gid": 3000}
    assert settings["cluster_users"] == [{"name": "ana", "uid": 2001}, {"name": "ben", "uid": 2002}]
    assert settings["home_root"] == "/fsx/home"
    assert settings["slurm_accounting"] is True
    assert settings["container_runtime"] is True  # default: enroot + pyxis on gpu, trn and login
    off = PlatformConfig.from_context({"containerRuntime": "false"})
    assert off.settings(region="us-east-1", data_bucket="d", artefacts_bucket="a", lifecycle_bucket="l",
                        package_hash="0" * 16)["container_runtime"] is False


def test_accounting_subnets_are_two_27s_after_the_nat_subnet():
    cfg = PlatformConfig()
    assert cfg.public_subnet_cidr == "10.0.128.0/28"
    assert cfg.accounting_subnet_cidrs == ("10.0.128.32/27", "10.0.128.64/27")
    small = PlatformConfig(vpcCidr="10.20.0.0/22")
    assert small.accounting_subnet_cidrs == ("10.20.2.32/27", "10.20.2.64/27")


def test_admins_and_their_group_reach_the_node_settings():
    cfg = PlatformConfig.from_context({"clusterUsers": "ana:2001,ops-ana:2101", "clusterAdmins": "ops-ana",
                                       "clusterAdminGroup": "wheelers:2998"})
    settings = cfg.node_settings()
    assert settings["cluster_admins"] == ["ops-ana"]
    assert settings["admin_group"] == {"name": "wheelers", "gid": 2998}
    assert PlatformConfig().node_settings()["cluster_admins"] == []


def test_generation_one_keeps_the_first_deployments_names_and_later_ones_add_it():
    assert PlatformConfig().retained_prefix == "sana"
    assert PlatformConfig(deploymentGeneration=3).retained_prefix == "sana-g3"
    assert PlatformConfig(projectName="a" * 16, deploymentGeneration=99).retained_prefix == "a" * 16 + "-g99"
