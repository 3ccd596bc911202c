"""``status``'s one-line cause, read from what the package's own programs print when they fail
(each produced here by running the real program, then dressed as srun --label and torchrun
--tee lay it out in job.log: training/slurm/launch.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from training.pipeline.status import cause_from_logs

REPO = Path(__file__).resolve().parents[3]


def as_in_job_log(text: str, rank_label: bool = True) -> str:
    """Lines as job.log shows a node's local rank 0: srun's "0: ", torchrun's "[default0]:"."""
    return "\n".join(f"0: [default0]:{line}" if rank_label else line for line in text.splitlines())


def test_an_entrypoint_user_error_is_the_cause_not_the_launchers_lines_after_it(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "training.gpu", "--config", "training/configs/tiny-cpu.yaml",
                           "--set", "optim.lr=-1"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2
    job_log = "\n".join([
        "launch.sh: job 5 (sana-train-2eb6b92621c7) kind=gpu nodes=1 [vm] restart=0 user=r",
        as_in_job_log(proc.stderr),
        "E1204 18:29:30.123 torch/distributed/elastic/multiprocessing/api.py failed (exitcode: 2) local_rank: 0",
        "srun: error: vm: task 0: Exited with exit code 1",
        "launch.sh: job 5 step finished with exit code 1"])
    assert cause_from_logs([job_log, ""]) == "error: config key optim.lr: must be > 0"


def test_a_crash_on_one_rank_of_many_is_named_with_its_rank() -> None:
    code = ("import sys; sys.path.insert(0, '.')\n"
            "from training.failure.leave import leave\n"
            "try:\n    raise RuntimeError('injected fault on rank 1 at step 5')\n"
            "except RuntimeError as exc:\n    leave(exc, rank=1, board=None)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1
    peer = "[rank 0] stopping: rank 1 (vm, pid 9) failed: RuntimeError: injected fault on rank 1 at step 5"
    log = as_in_job_log(proc.stderr) + "\n" + as_in_job_log(peer)
    assert cause_from_logs([log]) == "[rank 1] RuntimeError: injected fault on rank 1 at step 5"


def test_a_launcher_that_stops_before_any_task_is_the_cause(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SANA_"))}
    proc = subprocess.run(["bash", str(REPO / "training/slurm/launch.sh"), "job", "gpu"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=60)
    assert proc.returncode == 1
    out = "launch.sh: loaded node profile /etc/profile.d/sana-platform.sh\n" + proc.stderr
    assert cause_from_logs(["", out]) == ("launch.sh: not inside a Slurm job; submit with sbatch "
                                          "(runbooks/train-slurm.md)")


def test_a_python_traceback_gives_its_exception_line() -> None:
    proc = subprocess.run([sys.executable, "-c", "import json; json.loads('{')"], capture_output=True, text=True,
                          timeout=60)
    cause = cause_from_logs([as_in_job_log(proc.stderr)])
    assert cause is not None and cause.startswith("json.decoder.JSONDecodeError: Expecting property name"), cause


def test_no_error_line_is_no_cause() -> None:
    assert cause_from_logs(["launch.sh: job 5 step finished with exit code 137", ""]) is None
