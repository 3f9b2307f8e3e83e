"""Small helpers for the local stack's server processes: pid files, ports, logs."""

from __future__ import annotations

import errno
import os
import signal
import socket
import time
from pathlib import Path


class StackError(RuntimeError):
    """A local-stack problem a user can act on; the message says what and how."""


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def port_answers(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still "exists"; treat it as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def pid_cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def owned_pid(pid_file: Path, marker: str) -> int | None:
    """The pid in pid_file if that process is alive and is ours (its command line has marker).

    The marker check keeps a stale pid file, whose pid the OS has since given to another
    program, from making us signal a stranger.
    """
    pid = read_pid(pid_file)
    if pid is None or not pid_alive(pid):
        return None
    cmdline = pid_cmdline(pid)
    if cmdline and marker not in cmdline:
        return None
    return pid


def stop_pid(pid: int, timeout: float = 30.0) -> None:
    """SIGTERM, wait for a clean exit, then SIGKILL."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pid)
        if not pid_alive(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    for _ in range(50):
        _reap(pid)
        if not pid_alive(pid):
            return
        time.sleep(0.1)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])
