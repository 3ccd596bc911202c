"""A stand-in for the EC2 instance metadata service (IMDS), for tests/lifecycle/test_imds_block.py.

Serves the two calls that hand out a node's credentials, as IMDSv2 does them
(https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instance-metadata-retrieval.html and
"Retrieve security credentials from instance metadata", instancedata-data-retrieval.html):

    PUT /latest/api/token   (header X-aws-ec2-metadata-token-ttl-seconds)  -> a session token
    GET /latest/meta-data/iam/security-credentials/<role>  (header X-aws-ec2-metadata-token)
                                                           -> the role's temporary credentials

on 169.254.169.254:80 and [fd00:ec2::254]:80, the addresses the real service answers on. A GET
without a valid token is refused with 401, as IMDS does when IMDSv2 is required.

    python3 imds_standin.py READY_FILE      (binds both addresses, then writes READY_FILE)
"""

from __future__ import annotations

import json
import secrets
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROLE = "sana-hyperpod-nodes"
CREDENTIALS = {"Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": "ASIASTANDINNODEROLE0",
               "SecretAccessKey": "standin-secret", "Token": "standin-session-token",
               "Expiration": "2099-01-01T00:00:00Z"}
TOKENS: set[str] = set()


class Handler(BaseHTTPRequestHandler):
    def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
        if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            self._reply(400, "bad token request")
            return
        token = secrets.token_hex(16)
        TOKENS.add(token)
        self._reply(200, token)

    def do_GET(self) -> None:  # noqa: N802
        if self.headers.get("X-aws-ec2-metadata-token") not in TOKENS:
            self._reply(401, "")
            return
        if self.path == "/latest/meta-data/iam/security-credentials/":
            self._reply(200, ROLE)
        elif self.path == f"/latest/meta-data/iam/security-credentials/{ROLE}":
            self._reply(200, json.dumps(CREDENTIALS))
        else:
            self._reply(404, "")

    def _reply(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


class V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def main(ready: str) -> None:
    servers = [ThreadingHTTPServer(("169.254.169.254", 80), Handler), V6Server(("fd00:ec2::254", 80), Handler)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    with open(ready, "w") as f:
        f.write("ready\n")
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1])
