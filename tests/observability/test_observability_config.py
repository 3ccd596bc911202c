"""The training config's ``prometheus`` and ``tracking`` sections: a mistake is one line naming
the key and the fix, before anything starts."""

from __future__ import annotations

import pytest

from training.config import config_from_dict
from training.errors import UserError
from training.observability import RunIdentity, TrackingConfig
from training.observability.tracking import MlflowTracker


@pytest.mark.parametrize("section,message", [
    ({"tracking": {"backend": "wandb"}}, "config key tracking.backend: 'wandb'; choose one of none, mlflow"),
    ({"tracking": {"run_name": "my run"}}, "config key tracking.run_name: 'my run'; use letters, digits"),
    ({"tracking": {"timeout_s": 0}}, "config key tracking.timeout_s: must be > 0"),
    ({"prometheus": {"port": 70000}}, "config key prometheus.port: 70000 is not a TCP port (0 = a free one)"),
    ({"prometheus": {"enabled": "yes please"}}, "config key prometheus.enabled: expected true/false"),
])
def test_a_bad_key_is_one_line(section, message):
    with pytest.raises(UserError) as err:
        config_from_dict(section)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_mlflow_without_a_uri_says_where_to_give_one(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(UserError, match=r"^tracking\.uri: empty and MLFLOW_TRACKING_URI is not set; give the MLflow "):
        MlflowTracker(TrackingConfig(backend="mlflow"), RunIdentity(job_id="1", user="u", run_name="r", node="n"),
                      run_config={}, provenance={}, output_dir=tmp_path)


def test_defaults_serve_metrics_and_track_nothing():
    cfg = config_from_dict({})
    assert cfg.prometheus.enabled and cfg.prometheus.port == 0 and cfg.tracking.backend == "none"
