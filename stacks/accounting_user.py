"""slurmdbd's database login, created by a deploy-time function through the RDS Data API.

The Aurora admin login (RDS-managed password) is used only here, by a function that runs during
`cdk deploy`: it reads slurmdbd's generated password from its secret and runs, with the admin
secret, through the RDS Data API (rds-data ExecuteStatement with secretArn,
https://docs.aws.amazon.com/AmazonRDS/latest/AuroraUserGuide/data-api.html):

    CREATE USER IF NOT EXISTS 'slurm'@'%' IDENTIFIED WITH mysql_native_password AS '<hash>' REQUIRE SSL
    ALTER USER 'slurm'@'%' IDENTIFIED WITH mysql_native_password AS '<hash>' REQUIRE SSL
    GRANT ALL PRIVILEGES ON `<schema>`.* TO 'slurm'@'%'

The statements carry the password's mysql_native_password hash ('*' + upper-hex
SHA1(SHA1(password)), the form MySQL stores and `IDENTIFIED ... AS` takes: MySQL 8.0 reference,
"Native Pluggable Authentication"), never the password, so no request or log holds it. Rights:
the accounting schema only, nothing global. The statements converge (IF NOT EXISTS, ALTER), so
running the function again after a new password was put into the secret sets it.
"""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_rds as rds
from aws_cdk import aws_secretsmanager as secretsmanager
from constructs import Construct

from stacks.common import acknowledge, ignore_cfn_lint, log_group

# Inline (CloudFormation ZipFile) code: the cfnresponse module is provided for it
# (https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/cfn-lambda-function-code-cfnresponsemodule.html).
HANDLER = """\
import hashlib, json, boto3, cfnresponse

def statements(props, password):
    digest = "*" + hashlib.sha1(hashlib.sha1(password.encode()).digest()).hexdigest().upper()
    user = "'%s'@'%%'" % props["User"]
    auth = "IDENTIFIED WITH mysql_native_password AS '%s' REQUIRE SSL" % digest
    return ["CREATE USER IF NOT EXISTS %s %s" % (user, auth), "ALTER USER %s %s" % (user, auth),
            "GRANT ALL PRIVILEGES ON `%s`.* TO %s" % (props["Schema"], user)]

def handler(event, context):
    props = event["ResourceProperties"]
    try:
        if event["RequestType"] != "Delete":
            secret = boto3.client("secretsmanager").get_secret_value(SecretId=props["UserSecretArn"])
            data = boto3.client("rds-data")
            for sql in statements(props, json.loads(secret["SecretString"])["password"]):
                data.execute_statement(resourceArn=props["ClusterArn"], secretArn=props["AdminSecretArn"], sql=sql)
        cfnresponse.send(event, context, cfnresponse.SUCCESS, {}, "slurmdbd-" + props["User"])
    except Exception as e:
        print("slurmdbd user: %s: %s" % (type(e).__name__, e))
        cfnresponse.send(event, context, cfnresponse.FAILED, {}, "slurmdbd-" + props["User"])
"""


#: slurmdbd's own database user (least privilege on its schema only; the admin login stays with RDS)
SLURMDBD_USER = "slurm"


class SlurmdbdUser(Construct):
    def __init__(self, scope: Construct, id: str, *, cluster: rds.DatabaseCluster,
                 user_secret: secretsmanager.ISecret, schema: str, key: kms.IKey, retention_days: int) -> None:
        super().__init__(scope, id)
        admin_secret = cluster.secret
        assert admin_secret is not None
        # Named under /aws/lambda/<stack name>-*, the pattern the key policy admits CloudWatch Logs for.
        logs = log_group(self, "Logs", retention_days=retention_days, key=key, removal=cdk.RemovalPolicy.DESTROY,
                         name=f"/aws/lambda/{cdk.Stack.of(self).stack_name}-slurmdbd-user")
        role = iam.Role(self, "Role", assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
                        description="Deploy-time: creates slurmdbd's database user through the RDS Data API")
        self.policy = iam.ManagedPolicy(self, "Access", roles=[role], statements=[
            iam.PolicyStatement(sid="ReadBothLogins", actions=["secretsmanager:GetSecretValue"],
                                resources=[user_secret.secret_arn, admin_secret.secret_arn]),
            iam.PolicyStatement(sid="DecryptSecrets", actions=["kms:Decrypt"], resources=[key.key_arn]),
            iam.PolicyStatement(sid="RunStatements", actions=["rds-data:ExecuteStatement"],
                                resources=[cluster.cluster_arn]),
            iam.PolicyStatement(sid="WriteOwnLogs", actions=["logs:CreateLogStream", "logs:PutLogEvents"],
                                resources=[logs.log_group_arn, f"{logs.log_group_arn}:*"]),
        ])
        self.function = lambda_.Function(
            self, "Function", runtime=lambda_.Runtime.PYTHON_3_14, handler="index.handler",
            code=lambda_.Code.from_inline(HANDLER), timeout=cdk.Duration.minutes(2), role=role,
            log_group=logs, description="Deploy-time: slurmdbd's database user (RDS Data API)")
        self.function.node.add_dependency(self.policy)
        acknowledge(self.policy, f"AwsSolutions::AwsSolutions-IAM5[Resource::<{cdk.Stack.of(self).get_logical_id(logs.node.default_child)}.Arn>:*]",
                    "The log streams of the function's own log group (stream names are made by Lambda).")
        self.resource = cdk.CustomResource(self, "Resource", service_token=self.function.function_arn, properties={
            "ClusterArn": cluster.cluster_arn, "AdminSecretArn": admin_secret.secret_arn,
            "UserSecretArn": user_secret.secret_arn, "User": SLURMDBD_USER, "Schema": schema})
        # The Data API needs a running writer instance.
        for instance in ("Writer", "Reader"):
            child = cluster.node.try_find_child(instance)
            if child is not None:
                self.resource.node.add_dependency(child)
        self._acknowledge()

    def _acknowledge(self) -> None:
        deploy_only = ("A deploy-time function: CloudFormation runs it to create slurmdbd's database user "
                       "through the RDS Data API; it handles no PHI or training data. ")
        fn = self.function.node.default_child
        ignore_cfn_lint(fn, "W3005")  # aws-cdk-lib's Function adds a DependsOn its role that the GetAtt implies
        for rule, why in (
                ("HIPAA.Security::HIPAA.Security-LambdaConcurrency",
                 "CloudFormation invokes it once per deployment; reserved concurrency adds nothing."),
                ("HIPAA.Security::HIPAA.Security-LambdaDLQ",
                 "CloudFormation invokes it synchronously and fails the deployment on error; there is no "
                 "asynchronous event to dead-letter."),
                ("HIPAA.Security::HIPAA.Security-LambdaInsideVPC",
                 "It reaches the database through the RDS Data API endpoint, not the network: attaching it "
                 "to the VPC would open a path from it to the database for no benefit.")):
            acknowledge(fn, rule, deploy_only + why)
