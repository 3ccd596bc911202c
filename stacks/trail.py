"""The platform's CloudTrail trail (``cloudTrail=true``, the default): who read or wrote which object.

S3 object-level calls (GetObject, PutObject, DeleteObject, ...) are CloudTrail *data events*,
recorded only by a trail that selects them
(https://docs.aws.amazon.com/awscloudtrail/latest/userguide/logging-data-events-with-cloudtrail.html).
This trail selects them for the data, artefacts and lifecycle buckets only, validates its log
files (a digest file per hour, `aws cloudtrail validate-logs`:
https://docs.aws.amazon.com/awscloudtrail/latest/userguide/cloudtrail-log-file-validation-intro.html),
encrypts them with the platform key, and writes them into the access-log bucket under
``cloudtrail/``, whose policy admits CloudTrail for this trail's ARN only (stacks/network.py).
Management events are left to the account's own trail (AWS Organizations or the account's
default), so they are not billed twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import aws_cloudtrail as cloudtrail
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from stacks.common import acknowledge
from stacks.names import trail_name
from stacks.network import TRAIL_PREFIX


@dataclass(kw_only=True, frozen=True)
class DataEventsTrailProps:
    project: str
    key: kms.IKey
    destination: s3.IBucket
    buckets: tuple[s3.IBucket, ...]


class DataEventsTrail(Construct):
    def __init__(self, scope: Construct, id: str, *, props: DataEventsTrailProps) -> None:
        super().__init__(scope, id)
        self.trail = cloudtrail.Trail(
            self, "Resource", trail_name=trail_name(props.project), bucket=props.destination,
            s3_key_prefix=TRAIL_PREFIX, encryption_key=props.key, enable_file_validation=True,
            include_global_service_events=False, is_multi_region_trail=False,
            management_events=cloudtrail.ReadWriteType.NONE, send_to_cloud_watch_logs=False)
        self.trail.add_s3_event_selector([cloudtrail.S3EventSelector(bucket=b) for b in props.buckets],
                                         read_write_type=cloudtrail.ReadWriteType.ALL,
                                         include_management_events=False)
        acknowledge(self.trail.node.default_child, "HIPAA.Security::HIPAA.Security-CloudTrailCloudWatchLogsEnabled",
                    "The trail records S3 data events of the platform buckets into S3, validated and encrypted "
                    "with the platform key, where they are queried (Athena, CloudTrail Lake); sending every "
                    "object access to CloudWatch Logs too would duplicate the largest log volume of the "
                    "platform. Management events, the ones alarms watch, come from the account's own trail.")
