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
