"""``python -m training.serve.smoke`` (make serve-smoke): the whole check runs with --target cpu here;
on a host that is not inf2/trn, auto refuses in one line."""

from __future__ import annotations

import json

import pytest

from training.serve.smoke import detect_target, main


@pytest.mark.slow
def test_smoke_passes_every_step_on_cpu(capsys):
    results = main(["--target", "cpu", "--requests", "1", "--steps", "2"])
    out, err = capsys.readouterr()
    assert [line.split()[0] for line in out.splitlines() if line.split()[0] in ("PASS", "FAIL")] == ["PASS"] * 6
    assert json.loads(out.strip().splitlines()[-1]) == results
    assert results["backend"] == "compiled-cpu" and results["mean_pixel_difference_vs_cpu"] == 0.0
    assert "serve-smoke: PASS (cpu, compiled-cpu" in err


def test_auto_refuses_on_a_host_that_is_not_a_neuron_instance(capsys, monkeypatch):
    from training.model import flops
    monkeypatch.setattr(flops, "host_instance_type", lambda: "ml.m5.large")
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("error: --target auto: this host is ml.m5.large, not inf2/trn1/trn2; run on a "
                                       "Neuron host, or pass --target cpu to run the same check with torch.jit.trace\n")


@pytest.mark.parametrize(("instance", "target"), [("ml.inf2.xlarge", "inf2"), ("inf2.48xlarge", "inf2"),
                                                  ("ml.trn1n.32xlarge", "trn1"), ("trn2.48xlarge", "trn2")])
def test_target_from_the_instance_type(instance, target):
    assert detect_target(instance) == target
