#!/usr/bin/env python3
"""CDK entry point: PlatformConfig from context -> stacks -> cdk-nag packs (see stacks/__init__.py).

A bad context value prints ONE line naming the key, the value and what is allowed, and
exits 2; open cdk-nag findings are printed by CDK's validation report and exit 1.
"""

from __future__ import annotations

import os
import sys

# Node 20 on the build machines is past its end of life; jsii's banner would bury the output.
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

from stacks.platform import ConfigError, build_app  # noqa: E402  (after the environment above)


def main() -> int:
    try:
        platform = build_app()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        platform.app.synth()
    except RuntimeError as err:
        if "ValidationFailed" not in str(err):
            raise
        print("error: cdk-nag found unacknowledged findings (listed above); fix them or acknowledge "
              "them with a reason (runbooks/compliance.md)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
