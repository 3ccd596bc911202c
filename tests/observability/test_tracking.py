"""Experiment tracking against a real MLflow tracking server (PyPI's mlflow, SQLite store,
served artifacts) on loopback: what a run logs is read back with MlflowClient; a server that
stops mid-run never stops training; one that comes back receives what it missed."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.observability.servers import MlflowServer
from tests.training.cpu_run import train_on_cpu
from training.config import config_from_dict, load_yaml
from training.data.precompute import main as precompute
from training.data.shards import write_synthetic_features
from training.model.tiny import TINY_RESOLUTION, build_tiny_components, write_image_caption_folder
from training.observability import RunIdentity, TrackingConfig
from training.observability.tracking import MlflowTracker

pytestmark = pytest.mark.slow
MID_RUN_STEPS = 300
PROMPTS = ["a red circle on a blue background", "a small green square"]


@pytest.fixture(scope="module")
def validation_features(tmp_path_factory) -> Path:
    """Features with precomputed validation prompts, from the real precompute on tiny models."""
    base = tmp_path_factory.mktemp("tracking")
    models = build_tiny_components(base / "models")
    write_image_caption_folder(base / "raw", num=8, seed=3)
    (base / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    precompute(["--input", str(base / "raw"), "--out", str(base / "features"), "--vae", str(models["vae"]),
                "--text-encoder", str(models["text_encoder"]), "--tokenizer", str(models["tokenizer"]),
                "--resolution", str(TINY_RESOLUTION), "--max-text-tokens", "16", "--device", "cpu",
                "--dtype", "fp32", "--validation-prompts", str(base / "prompts.txt"),
                "--buckets", "square"])  # one 32 px square: validation renders multiples of 32
    return base / "features"


def tiny_config(features: Path, out: Path, *, max_steps: int, tracking: dict, validation: dict | None = None):
    tree = load_yaml(REPO / "training/configs/tiny-cpu.yaml")
    tree.update(max_steps=max_steps, output_dir=str(out), tensorboard=False, log_every=2)
    tree["data"].update(path=str(features), prefetch=0)
    tree["checkpoint"].update(every_steps=0)
    tree["prometheus"] = {"enabled": False}
    tree["tracking"] = {"backend": "mlflow", "experiment": "sana-tests", **tracking}
    if validation:
        tree["validation"] = validation
    return config_from_dict(tree)


def the_run(uri: str, experiment: str = "sana-tests"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def test_params_metrics_and_validation_grids_reach_mlflow(validation_features: Path, tmp_path: Path) -> None:
    server = MlflowServer(tmp_path / "mlflow").start()
    try:
        out = tmp_path / "run"
        cfg = tiny_config(validation_features, out, max_steps=4, tracking={"uri": server.uri, "run_name": "tiny-val"},
                          validation={"every_steps": 2, "num_inference_steps": 2})
        train_on_cpu(cfg)
        client, run = the_run(server.uri)
        assert run.info.run_name == "tiny-val" and run.info.status == "FINISHED"
        params = run.data.params
        assert params["config.optim.lr"] == "0.001" and params["config.max_steps"] == "4"
        assert params["config.validation.every_steps"] == "2"
        assert [k for k in params if k.startswith("provenance.text_conditioning.")]  # what the features were made with
        assert {"sana.job_id", "sana.user", "sana.run_name", "sana.node"} <= run.data.tags.keys()
        local = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        for key in ("loss", "samples_per_s", "tokens_per_s", "step_time_s", "checkpoint_stall_s"):
            history = client.get_metric_history(run.info.run_id, key)
            assert [m.step for m in history] == [2, 4], key
            assert [m.value for m in history] == pytest.approx([r[key] for r in local]), key
        assert all(m.value > 0 for m in client.get_metric_history(run.info.run_id, "samples_per_s"))
        names = {a.path for a in client.list_artifacts(run.info.run_id)} | \
            {a.path for a in client.list_artifacts(run.info.run_id, "validation")}
        assert {"config.json", "metrics.jsonl", "validation/step-00000002.png", "validation/step-00000004.png"} <= names
        grid = Path(client.download_artifacts(run.info.run_id, "validation/step-00000004.png", str(tmp_path)))
        assert grid.read_bytes() == (out / "validation/step-00000004.png").read_bytes()
        assert json.loads(Path(client.download_artifacts(run.info.run_id, "config.json", str(tmp_path)))
                          .read_text())["max_steps"] == 4
    finally:
        server.stop()


def test_training_goes_on_when_the_server_stops_mid_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    features = tmp_path / "features"
    write_synthetic_features(features, num_samples=16, latent_shape=(4, 8, 8), text_dim=8, max_text_tokens=8)
    server = MlflowServer(tmp_path / "mlflow").start()
    out = tmp_path / "run"
    stopped_at: list[int] = []

    def stop_the_server_once_it_has_the_run() -> None:
        """Stop the server (SIGTERM) once the MLflow run exists (it is made before step 0) and
        training has logged step 4: the rest of the run happens without a server."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(server.uri)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:  # (a busy server may answer late; ask again)
                experiment = client.get_experiment_by_name("sana-tests")
                has_run = bool(experiment and client.search_runs([experiment.experiment_id]))
            except Exception:  # noqa: BLE001
                has_run = False
            lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
            if has_run and lines and json.loads(lines[-1])["step"] >= 4:
                stopped_at.append(json.loads(lines[-1])["step"])
                server.stop()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=stop_the_server_once_it_has_the_run)
    watcher.start()
    cfg = tiny_config(features, out, max_steps=MID_RUN_STEPS, tracking={"uri": server.uri, "retry_s": 0.5,
                                                                         "close_timeout_s": 3})
    try:
        with caplog.at_level(logging.WARNING, logger="training.observability.tracking"):
            started = time.monotonic()
            result = train_on_cpu(cfg)
            elapsed = time.monotonic() - started
    finally:
        watcher.join()
        server.stop()
    assert stopped_at, "the server was never stopped"
    assert result.steps == MID_RUN_STEPS and stopped_at[0] < MID_RUN_STEPS  # trained on after the stop
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(2, MID_RUN_STEPS + 1, 2))  # every metric kept locally
    outage = [r for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(outage) == 1, [r.getMessage() for r in caplog.records]
    assert elapsed < 120
    # What reached the server before it stopped is there (it comes back on the same store).
    server.start()
    try:
        client, run = the_run(server.uri)
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
        # whatever was sent before the stop, in order, and nothing after it
        assert steps == list(range(2, 2 * len(steps) + 1, 2)) and all(step < MID_RUN_STEPS for step in steps)
        assert run.data.params["config.max_steps"] == str(MID_RUN_STEPS)
        assert run.info.status == "RUNNING"  # its end never reached the server
    finally:
        server.stop()


def test_a_server_that_comes_back_receives_what_it_missed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = MlflowServer(tmp_path / "mlflow").start()
    identity = RunIdentity(job_id="7", user="researcher", run_name="backfill", node="gpu-1")
    cfg = TrackingConfig(backend="mlflow", uri=server.uri, experiment="sana-tests", retry_s=0.5,
                         close_timeout_s=60)
    with caplog.at_level(logging.WARNING, logger="training.observability.tracking"):
        tracker = MlflowTracker(cfg, identity, run_config={"max_steps": 3}, provenance={}, output_dir=tmp_path)
        tracker.log(1, {"loss": 1.0})
        deadline = time.monotonic() + 60
        while tracker.run_id is None or len(tracker._pending):  # step 1 delivered
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.stop()
        tracker.log(2, {"loss": 0.5})
        tracker.log(3, {"loss": 0.25})
        while not tracker.unsent_warned:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.start()  # same port, same store
        tracker.close("FINISHED")
    try:
        client, run = the_run(server.uri)
        history = client.get_metric_history(run.info.run_id, "loss")
        assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5), (3, 0.25)]
        assert run.info.status == "FINISHED"
        assert len([r for r in caplog.records if "does not answer" in r.getMessage()]) == 1
        assert not [r for r in caplog.records if "were not sent" in r.getMessage()]
        # A resumed run (same output_dir, same URI) continues the same MLflow run.
        resumed = MlflowTracker(cfg, identity, run_config={"max_steps": 4}, provenance={}, output_dir=tmp_path)
        assert resumed.run_id == run.info.run_id
        resumed.log(4, {"loss": 0.125})
        resumed.close("FINISHED")
        history = client.get_metric_history(run.info.run_id, "loss")
        assert [m.step for m in history] == [1, 2, 3, 4]
        assert len(client.search_runs([run.info.experiment_id])) == 1
    finally:
        server.stop()


def test_a_failing_run_does_not_wait_for_a_server_that_does_not_answer(tmp_path: Path) -> None:
    """The failure path ends within seconds (training/failure/): a tracker whose server never
    answers holds the end of a FAILED run for at most FAILED_CLOSE_S."""
    import socket

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cfg = TrackingConfig(backend="mlflow", uri=uri, timeout_s=3, close_timeout_s=60)
        identity = RunIdentity(job_id="8", user="u", run_name="failing", node="n")
        started = time.monotonic()
        tracker = MlflowTracker(cfg, identity, run_config={}, provenance={}, output_dir=tmp_path)
        made = time.monotonic() - started
        tracker.log(1, {"loss": 1.0})
        started = time.monotonic()
        tracker.close("FAILED")
        assert time.monotonic() - started < MlflowTracker.FAILED_CLOSE_S + 1
    assert made < 35  # the run's creation is bounded by timeout_s too
