"""A sandbox for code a model wrote: each program runs in a bubblewrap container with no network, a
file system of the Python runtime (read-only) and an empty scratch directory of its own (a sized
tmpfs: the only place it may write, gone after it), and limits on CPU time, memory, processes,
file size and wall time. A program that breaks a limit ends with an `Outcome` that says which;
nothing it does reaches the process that runs it.

Why bubblewrap: it installs from the OS packages (``apt install bubblewrap``), it is what Flatpak
runs every application in (so its namespaces and mounts are well trodden), and it needs no daemon
and no privileges beyond user namespaces. nsjail is not packaged here; a WebAssembly Python
(wasmtime) would isolate more strictly, but without the C extensions users' code expects and at
several times the start-up cost.

How the limits hold: the program runs as ``nobody`` outside its user namespace when sluice runs as
root (``RLIMIT_NPROC`` does not bind root), so a fork bomb stops at `Limits.processes`; its PID
namespace ends with it, so nothing it started outlives it; ``RLIMIT_AS`` turns a memory hog into a
``MemoryError``, ``RLIMIT_CPU`` stops a busy loop, and the wall clock stops a sleeping one. Run
by a user other than root, the process limit counts that user's every process and thread: give
the worker a user of its own.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
INSIDE_UID = 1000  # the program's uid inside its namespace
SCRATCH = "/scratch"
PROGRAM = "/program/main.py"  # (read-only, beside the scratch directory, not in it)
STALE_S = 600  # a run's files left this long were a worker's killed mid-run: swept at start


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (no bubblewrap, or user namespaces are disabled)."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 << 20  # address space, so somewhat above what the program touches
    processes: int = 64  # of the sandbox's user, over every program running at once
    file_bytes: int = 16 << 20  # the largest file it may write, its output included
    scratch_bytes: int = 64 << 20  # all it may write: its scratch directory is a tmpfs this big
    output_chars: int = 16_000  # of stdout and of stderr, kept from the end


@dataclass(frozen=True)
class Outcome:
    ok: bool
    stdout: str
    stderr: str
    exit_code: int | None  # None: stopped at the wall-clock limit
    why: str | None = None  # which limit ended it, or its exit status; None when ok
    seconds: float = 0.0

    def summary(self) -> str:
        """What a model is told of a failed run: why, then the end of its error output."""
        tail = self.stderr.strip()[-2000:]
        return f"{self.why}\n{tail}" if tail else str(self.why)


def _interpreter() -> str:
    """The Python the sandbox runs: the OS's, whose files under /usr the sandbox can show."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    raise SandboxUnavailable("no python3 under /usr/bin or /usr/local/bin for the sandbox to run")


class Sandbox:
    def __init__(self, limits: Limits | None = None, python: str | None = None):
        self.limits = limits or Limits()
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailable(
                "bubblewrap is not installed (apt install bubblewrap): the python tool runs "
                "programs in it"
            )
        self.bwrap = bwrap
        self.python = python or _interpreter()
        self.as_nobody = os.geteuid() == 0
        _sweep_stale()
        probe = self.run_python("print('ok')")
        if not probe.ok or probe.stdout.strip() != "ok":
            raise SandboxUnavailable(f"bubblewrap does not start a program here: {probe.summary()}")

    def _command(self, program: str) -> list[str]:
        mounts = ["--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            target = Path("/") / link
            if target.is_symlink():
                mounts += ["--symlink", os.readlink(target), f"/{link}"]
            elif target.is_dir():
                mounts += ["--ro-bind", str(target), f"/{link}"]
        return [
            self.bwrap,
            "--die-with-parent",  # and, as its PID namespace's end, everything it started
            "--new-session",
            "--unshare-all",  # no network, no view of other processes
            "--uid",
            str(INSIDE_UID),
            "--gid",
            str(INSIDE_UID),
            "--hostname",
            "sandbox",
            *mounts,
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--size",
            str(self.limits.scratch_bytes),
            "--tmpfs",
            SCRATCH,
            "--ro-bind",
            program,
            PROGRAM,
            "--chdir",
            SCRATCH,
            "--clearenv",
            "--setenv",
            "HOME",
            SCRATCH,
            "--setenv",
            "TMPDIR",
            SCRATCH,
            "--setenv",
            "PATH",
            "/usr/local/bin:/usr/bin:/bin",
            self.python,
            "-I",  # isolated: no user site, no PYTHON* variables
            PROGRAM,
        ]

    def _limit(self) -> None:
        """In the child, before bubblewrap starts: its user and its limits (inherited by all)."""
        lim = self.limits
        if self.as_nobody:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        resource.setrlimit(resource.RLIMIT_NPROC, (lim.processes, lim.processes))
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_bytes, lim.memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_bytes, lim.file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def run_python(self, code: str) -> Outcome:
        """Run `code` as a Python program in a fresh scratch directory."""
        lim = self.limits
        with tempfile.TemporaryDirectory(prefix=TEMP_PREFIX) as home:
            program = Path(home) / "main.py"
            program.write_text(code, encoding="utf-8")
            os.chmod(program, 0o644)  # (its output files stay the runner's: it only holds them)
            os.chmod(home, 0o711)
            started = time.monotonic()
            out_path, err_path = Path(home) / "out", Path(home) / "err"
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                proc = subprocess.Popen(
                    self._command(str(program)),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    preexec_fn=self._limit,  # (only setuid and setrlimit: safe beside threads)
                    start_new_session=True,
                )
                try:
                    code_ = proc.wait(timeout=lim.wall_s)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    code_ = None
            seconds = time.monotonic() - started
            stdout = _tail(out_path, lim.output_chars)
            stderr = _tail(err_path, lim.output_chars)
        why = _why(code_, stderr, lim)
        return Outcome(code_ == 0, stdout, stderr, code_, why, round(seconds, 3))


TEMP_PREFIX = "sluice-sandbox-"


def _sweep_stale() -> None:
    """Remove the files of runs whose worker was killed mid-run (a run's take seconds)."""
    now = time.time()
    for old in Path(tempfile.gettempdir()).glob(f"{TEMP_PREFIX}*"):
        try:
            if now - old.stat().st_mtime > STALE_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


def _tail(path: Path, chars: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 4 * chars))
        text = f.read().decode("utf-8", "replace")
    return text[-chars:]


def _why(exit_code: int | None, stderr: str, lim: Limits) -> str | None:
    """Which limit ended a run (bubblewrap exits 128 + N for a program ended by signal N)."""
    if exit_code == 0:
        return None
    if exit_code is None:
        return f"stopped at the wall-clock limit of {lim.wall_s:g} s"
    signum = exit_code - 128 if exit_code > 128 else None
    if signum == signal.SIGXCPU:
        return f"stopped at the CPU time limit of {lim.cpu_s} s"
    if signum == signal.SIGXFSZ or "File too large" in stderr:
        return f"stopped at the file size limit of {lim.file_bytes >> 20} MiB"
    if "MemoryError" in stderr:
        return f"stopped at the memory limit of {lim.memory_bytes >> 20} MiB"
    if "Resource temporarily unavailable" in stderr:  # (fork's EAGAIN at RLIMIT_NPROC)
        return f"stopped at the process limit of {lim.processes}"
    if signum is not None:
        return f"ended by signal {signal.Signals(signum).name}"
    return f"exit status {exit_code}"
