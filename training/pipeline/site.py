"""Where a chain's jobs will write, resolved exactly as their launcher resolves it.

``bash training/slurm/launch.sh paths`` (the launcher of the package this module belongs to)
prints the roots after the node profile and its defaults, and the package hash, so the
directories the pipeline plans, lists and checks are the ones the jobs write: every stage's
output is ``$SANA_CHECKPOINT_ROOT/<user>/<job name>`` (the launcher's SANA_RUN_DIR) and its
logs ``$SANA_LOG_ROOT/<user>/<job name>-<job id>/``.
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import subprocess
from pathlib import Path

from training.errors import UserError

#: the package this code runs from, resolved (a chain's jobs run this same package)
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Site:
    """The roots, the package and the user a chain belongs to."""

    checkpoint_root: Path
    log_root: Path
    package_root: Path
    package_hash: str
    user: str

    @property
    def user_dir(self) -> Path:
        """$SANA_CHECKPOINT_ROOT/<user>: every stage directory lives here."""
        return self.checkpoint_root / self.user

    @property
    def slurm_dir(self) -> Path:
        return self.package_root / "training" / "slurm"

    def pipeline_dir(self, name: str) -> Path:
        """Per recipe name: its last submit (submitted.json)."""
        return self.user_dir / "pipelines" / name

    def stage_dir(self, job_name: str) -> Path:
        return self.user_dir / job_name

    def job_log_dir(self, job_name: str, job_id: str) -> Path:
        return self.log_root / self.user / f"{job_name}-{job_id}"

    def slurm_out(self, job_name: str, job_id: str) -> Path:
        return self.log_root / self.user / f"{job_name}-{job_id}.out"

    def check_user_dir(self) -> None:
        """The user's own checkpoint directory, as launch.sh own_dir has it: made (0700) where the
        user may (a root of their own), else it must exist, be a directory and be theirs alone."""
        path = self.user_dir
        if not path.exists() and not path.is_symlink():
            try:
                self.checkpoint_root.mkdir(parents=True, exist_ok=True)
                path.mkdir(mode=0o700)
            except OSError:
                raise UserError(f"{path} does not exist: the lifecycle makes $SANA_CHECKPOINT_ROOT/<user> for every "
                                "cluster user (runbooks/users.md), or set SANA_CHECKPOINT_ROOT to a directory of "
                                "yours") from None
        if not path.is_dir() or path.is_symlink():
            raise UserError(f"{path} is not a directory; it must be your own directory (SANA_CHECKPOINT_ROOT)")
        info = path.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            raise UserError(f"{path} is not yours alone (owner uid {info.st_uid}, mode {info.st_mode & 0o777:o}): "
                            "another user could change what the chain's jobs read there; it must be your own "
                            "directory (SANA_CHECKPOINT_ROOT)")


def current_user() -> str:
    return pwd.getpwuid(os.getuid()).pw_name


def resolve_site(package_root: Path = PACKAGE_ROOT) -> Site:
    """Ask the package's launcher for its roots and package hash (``launch.sh paths``)."""
    launcher = package_root / "training" / "slurm" / "launch.sh"
    proc = subprocess.run(["bash", str(launcher), "paths"], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"{launcher} paths failed ({why}); is the package complete?")
    values = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    try:
        return Site(checkpoint_root=Path(values["SANA_CHECKPOINT_ROOT"]), log_root=Path(values["SANA_LOG_ROOT"]),
                    package_root=Path(values["SANA_PACKAGE_ROOT"]), package_hash=values["SANA_PACKAGE_HASH"],
                    user=current_user())
    except KeyError as exc:
        raise UserError(f"{launcher} paths printed no {exc.args[0]}; is the package complete?") from None
