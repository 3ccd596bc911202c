"""What counts as a finished stage, the submit lock, and the roots the launcher reports."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training.errors import UserError
from training.pipeline.record import record
from training.pipeline.records import RUN_FORMAT, STAGE_FORMAT, finished_run, write_json_atomic
from training.pipeline.site import PACKAGE_ROOT, resolve_site
from training.pipeline.submit import submit_lock

KEY = "ab" * 32


def a_run(stage_dir: Path, output: Path) -> dict:
    return {"format": RUN_FORMAT, "key": KEY, "stage": "precompute", "outputs": {"paths": {"features": str(output)}}}


def test_only_a_whole_run_json_of_the_stages_key_with_its_outputs_present_is_finished(tmp_path: Path) -> None:
    features = tmp_path / "features"
    features.mkdir()
    assert finished_run(tmp_path, KEY) is None  # nothing yet
    run = a_run(tmp_path, features)
    text = json.dumps(run)
    (tmp_path / "run.json").write_text(text[: len(text) // 2])  # a torn write
    assert finished_run(tmp_path, KEY) is None
    (tmp_path / "run.json").unlink()
    (tmp_path / ".run.json.tmp-123").write_text(text)  # a writer that died before its rename
    assert finished_run(tmp_path, KEY) is None
    write_json_atomic(tmp_path / "run.json", run)
    assert finished_run(tmp_path, KEY) == run
    assert finished_run(tmp_path, "cd" * 32) is None  # another key's record
    features.rmdir()  # the output was deleted: the stage must run again
    assert finished_run(tmp_path, KEY) is None


def test_an_atomic_write_killed_midway_leaves_the_old_record_whole(tmp_path: Path) -> None:
    target = tmp_path / "run.json"
    write_json_atomic(target, {"version": 1})
    # A child writing a big record is SIGKILLed while it writes (no rename happened).
    code = (f"import sys; sys.path.insert(0, {str(PACKAGE_ROOT)!r})\n"
            "from pathlib import Path\nfrom training.pipeline.records import write_json_atomic\n"
            f"write_json_atomic(Path({str(target)!r}), {{'v': ['x' * 1000] * 10**6}})\n")
    child = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".run.json.tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert json.loads(target.read_text()) == {"version": 1}


def precompute_stage(tmp_path: Path) -> Path:
    """A precompute stage's directory and stage.json as submit writes them; returns the stage file."""
    stage_dir = tmp_path / "sana-precompute-abababababab"
    (stage_dir / "features").mkdir(parents=True)
    spec = {"format": STAGE_FORMAT, "stage": "precompute", "key": KEY, "job_name": stage_dir.name,
            "dir": str(stage_dir), "outputs": {"features": str(stage_dir / "features")}, "section": {}, "inputs": {},
            "recipe": {"name": "t", "path": "/r.yaml", "sha256": "0", "content": {}},
            "package": {"root": "/p", "hash": "h"}, "attempts": [{"job_id": "7", "submitted_at": "now"}]}
    write_json_atomic(stage_dir / "stage.json", spec)
    return stage_dir / "stage.json"


def test_the_record_step_writes_run_json_with_the_feature_index_hash_and_the_jobs_provenance(tmp_path: Path) -> None:
    from training.data.shards import write_synthetic_features

    stage_file = precompute_stage(tmp_path)
    features = stage_file.parent / "features"
    write_synthetic_features(features, num_samples=4, samples_per_shard=2)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SANA_", "SLURM_"))}
    env.update(SANA_RUN_DIR=str(stage_file.parent), SANA_PACKAGE_ROOT="/fsx/platform/3f2a9c1d0b7e",
               SANA_PACKAGE_HASH="3f2a9c1d0b7e", SANA_ENV_PATH="/fsx/envs/gpu-a1b2", SANA_ENV_HASH="a1b2",
               SLURM_JOB_ID="4711", SLURM_RESTART_COUNT="1", SANA_STEP_STARTED_AT="2026-01-01T00:00:00Z")
    proc = subprocess.run([sys.executable, "-m", "training.pipeline", "record", str(stage_file)], env=env,
                          capture_output=True, text=True, cwd=PACKAGE_ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    run = finished_run(stage_file.parent, KEY)
    assert run is not None
    assert run["outputs"]["feature_index_sha256"] == hashlib.sha256((features / "index.json").read_bytes()).hexdigest()
    assert (run["outputs"]["samples"], run["outputs"]["shards"]) == (4, 2)
    assert run["package"] == {"root": "/fsx/platform/3f2a9c1d0b7e", "hash": "3f2a9c1d0b7e"}
    assert run["env"] == {"path": "/fsx/envs/gpu-a1b2", "hash": "a1b2"}
    assert (run["job"]["id"], run["job"]["restarts"], run["started_at"]) == ("4711", 1, "2026-01-01T00:00:00Z")
    assert [entry["stage"] for entry in run["lineage"]] == ["precompute"]

    # A file system that refuses the write: one line naming the file, no run.json.
    (stage_file.parent / "run.json").unlink()
    (stage_file.parent / "run.json").mkdir()
    (stage_file.parent / "run.json" / "x").write_text("")
    proc = subprocess.run([sys.executable, "-m", "training.pipeline", "record", str(stage_file)], env=env,
                          capture_output=True, text=True, cwd=PACKAGE_ROOT, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: "), proc.stderr


def test_the_record_step_refuses_an_output_that_is_not_whole(tmp_path: Path, monkeypatch) -> None:
    stage_dir = precompute_stage(tmp_path).parent
    (stage_dir / "features" / "shard-00000.tar").write_bytes(b"half")  # shards, but no index.json
    monkeypatch.setenv("SANA_RUN_DIR", str(stage_dir))
    with pytest.raises(UserError, match=r"index.json: missing or not a .* index; the precompute did not finish"):
        record(stage_dir / "stage.json")
    assert not (stage_dir / "run.json").exists()
    monkeypatch.setenv("SANA_RUN_DIR", str(tmp_path / "another-job-name"))
    with pytest.raises(UserError, match="this job's directory is"):
        record(stage_dir / "stage.json")


def test_a_second_submit_waits_for_the_lock_and_gives_up_in_one_line(tmp_path: Path) -> None:
    lock = tmp_path / "pipelines" / ".submit.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        f"import sys, time; sys.path.insert(0, {str(PACKAGE_ROOT)!r})\n"
        "from pathlib import Path\nfrom training.pipeline.submit import submit_lock\n"
        f"with submit_lock(Path({str(lock)!r})):\n    print('held', flush=True)\n    time.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        with pytest.raises(UserError) as info, submit_lock(lock, wait_s=1.0):
            pass
        assert 1.0 <= time.monotonic() - start < 10
        assert str(info.value) == (f"{lock}: another submit has held the lock for 1 s; wait for it (or end it), "
                                   "then submit again")
    finally:
        holder.kill()
        holder.wait()
    with submit_lock(lock, wait_s=5.0):  # released when its holder died, however it died
        pass


def test_the_roots_are_the_launchers_own_profile_then_environment(tmp_path: Path, monkeypatch) -> None:
    """``launch.sh paths`` resolves the roots the way a job will: the node profile, then
    what the submitting shell exported over it, then the /fsx defaults."""
    profile = tmp_path / "profile.sh"
    profile.write_text(f"export SANA_FSX={tmp_path}/fsx\nexport SANA_CHECKPOINT_ROOT={tmp_path}/fsx/ckpt\n")
    for name in [n for n in os.environ if n.startswith("SANA_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SANA_PROFILE", str(profile))
    monkeypatch.setenv("SANA_LOG_ROOT", str(tmp_path / "my-logs"))
    site = resolve_site()
    assert site.checkpoint_root == tmp_path / "fsx" / "ckpt"
    assert site.log_root == tmp_path / "my-logs"  # exported at submit: wins over the profile
    assert site.package_root == PACKAGE_ROOT
    assert site.package_hash.startswith("tree-") and len(site.package_hash) == len("tree-") + 12  # a checkout


def test_the_users_checkpoint_directory_is_made_private_or_refused_like_launch_sh_own_dir(tmp_path: Path) -> None:
    from training.pipeline.site import Site, current_user

    site = Site(checkpoint_root=tmp_path / "my-root", log_root=tmp_path / "logs", package_root=PACKAGE_ROOT,
                package_hash="h", user=current_user())
    site.check_user_dir()  # a root of the user's own: the directory is made, 0700
    assert site.user_dir.is_dir() and site.user_dir.stat().st_mode & 0o777 == 0o700
    site.user_dir.chmod(0o770)
    with pytest.raises(UserError, match=r"is not yours alone \(owner uid \d+, mode 770\)"):
        site.check_user_dir()
    site.user_dir.chmod(0o700)
    if os.getuid() == 0:  # another user's directory where ours should be
        os.chown(site.user_dir, 54321, 54321)
        with pytest.raises(UserError, match=r"is not yours alone \(owner uid 54321"):
            site.check_user_dir()
