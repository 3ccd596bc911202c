"""Root's file operations on FSx that never follow a path a cluster user controls (stdlib only).

Every cluster user can write somewhere under FSx, so a root step that runs `mkdir -p`, `chown`,
`chmod` or `>` on a path there can be pointed by a user's symlink at /etc (a check with `-L`
first is a race: the link can appear between the check and the call). Here every path is walked
component by component from a directory file descriptor: each component is opened with
O_NOFOLLOW | O_DIRECTORY relative to its parent's descriptor (openat(2)), and ownership, mode
and writes act on descriptors (fchown(2), fchmod(2), openat(O_CREAT | O_EXCL | O_NOFOLLOW),
renameat(2)). A symlink anywhere below ROOT fails the call instead of being followed, whatever
happens between the calls. ROOT itself (the FSx mount point, from root's own settings) is
trusted and opened normally.

    safe_fs.py dir ROOT UID:GID MODE REL...       platform directories: created if missing,
                                                 then owner and mode set exactly (one that
                                                 another uid made is refused, not adopted)
    safe_fs.py userdir ROOT UID:GID MODE REL...   a user's own directory: created with MODE if
                                                 missing; if present it must already be that
                                                 user's (or root's, then it is handed over), and
                                                 only its group/other write bits are removed
                                                 (the user may have opened it for reading)
    safe_fs.py write ROOT MODE REL < DATA         a file written whole (temp file + rename) in a
                                                 directory only root can write

Each REL's parent must exist (callers create parents first). A failure prints ONE line on
stderr naming the path and the fix, and exits 1.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(Exception):
    """A path the platform will not act on; the message is the one line for the log."""


def _open_dir_at(parent_fd: int, name: str, shown: str) -> int:
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as err:
        if os.path.islink(shown):
            raise Refused(f"{shown} is a symlink (to {os.readlink(shown)}); the platform expects a directory "
                          "there and never follows a link: move the link away") from None
        if err.errno == 20:  # ENOTDIR
            raise Refused(f"{shown} exists and is not a directory; move it away so the platform can manage it") from None
        raise Refused(f"cannot open {shown}: {err.strerror}") from None


def _walk(root: str, parts: list[str]) -> int:
    """A descriptor of ROOT/parts[0]/.../parts[-1], every component opened without following."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    shown = root
    try:
        for part in parts:
            shown = os.path.join(shown, part)
            child = _open_dir_at(fd, part, shown)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _split(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise Refused(f"internal: {rel!r} is not a plain relative path")
    return parts


def _owner(spec: str) -> tuple[int, int]:
    uid, _, gid = spec.partition(":")
    return int(uid), int(gid)


def ensure_dir(root: str, rel: str, owner: tuple[int, int], mode: int, *, users_own: bool) -> str:
    """Create ROOT/REL if missing and set it as described in the module docstring; returns what was done."""
    parts = _split(rel)
    shown = os.path.join(root, *parts)
    parent = _walk(root, parts[:-1])
    try:
        created = True
        try:
            os.mkdir(parts[-1], 0o700, dir_fd=parent)
        except FileExistsError:
            created = False
        fd = _open_dir_at(parent, parts[-1], shown)
    finally:
        os.close(parent)
    try:
        st = os.fstat(fd)
        uid, gid = owner
        if users_own and not created:
            if st.st_uid not in (0, uid):
                raise Refused(f"{shown} belongs to uid {st.st_uid}, not to uid {uid} whose directory it is; "
                              "someone else made it: move it away and re-run the step")
            os.fchown(fd, uid, gid)
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022 & 0o7777)
            return "kept"
        if not created and st.st_uid not in (0, uid):
            # A platform directory someone else made (e.g. while a parent was still writable):
            # what they left inside cannot be trusted, so root does not adopt it.
            raise Refused(f"{shown} was made by uid {st.st_uid}, not by the platform; move it away and "
                          "re-run the step")
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
        return "created" if created else "set"
    finally:
        os.close(fd)


def write_file(root: str, rel: str, mode: int, data: bytes) -> None:
    """ROOT/REL := data, atomically, in a directory only root may write."""
    parts = _split(rel)
    shown = os.path.join(root, *parts)
    parent = _walk(root, parts[:-1])
    try:
        st = os.fstat(parent)
        if st.st_uid != 0 or st.st_mode & 0o022:
            raise Refused(f"{os.path.dirname(shown)} is writable by others than root (uid {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):04o}); root writes status files only in root-only directories")
        tmp = f".{parts[-1]}.{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
        try:
            with os.fdopen(fd, "wb", closefd=False) as out:
                out.write(data)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        try:
            os.rename(tmp, parts[-1], src_dir_fd=parent, dst_dir_fd=parent)
        except OSError:
            os.unlink(tmp, dir_fd=parent)
            raise
    finally:
        os.close(parent)


def main(argv: list[str]) -> int:
    try:
        if len(argv) >= 4 and argv[0] in ("dir", "userdir"):
            root, owner, mode = argv[1], _owner(argv[2]), int(argv[3], 8)
            for rel in argv[4:]:
                ensure_dir(root, rel, owner, mode, users_own=argv[0] == "userdir")
            return 0
        if len(argv) == 4 and argv[0] == "write":
            write_file(argv[1], argv[3], int(argv[2], 8), sys.stdin.buffer.read())
            return 0
    except Refused as err:
        print(err, file=sys.stderr)
        return 1
    except OSError as err:
        print(f"{err.filename or argv[1]}: {err.strerror}", file=sys.stderr)
        return 1
    print("usage: safe_fs.py dir|userdir ROOT UID:GID MODE REL... | write ROOT MODE REL < DATA", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
