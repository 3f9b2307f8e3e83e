"""A local `redis-server` from the OS packages, daemonized on loopback."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time

from sluice.connectors.processes import StackError, owned_pid, port_is_free, stop_pid, tail
from sluice.connectors.settings import LOOPBACK, REDIS_APPENDFSYNC_CHOICES, StackSettings

log = logging.getLogger(__name__)


def redis_server_executable(install: bool = True) -> str:
    """Find redis-server; install it with apt when it is missing and we run as root."""
    found = shutil.which("redis-server")
    if found:
        return found
    apt = shutil.which("apt-get")
    if install and apt and os.geteuid() == 0:
        print("redis-server is missing: installing it with apt-get...", flush=True)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        for cmd in ([apt, "update", "-q"], [apt, "install", "-y", "-q", "redis-server"]):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise StackError(
                    f"installing redis-server failed (`{' '.join(cmd)}`):\n"
                    + (proc.stdout + proc.stderr).strip()[-1500:]
                )
        # The package starts a system service on 6379; ours is separate, so stop theirs.
        subprocess.run(["service", "redis-server", "stop"], capture_output=True)
        found = shutil.which("redis-server")
    if not found:
        raise StackError(
            "redis-server was not found. Install it (`apt-get install redis-server`) "
            "or point REDIS_URL at an existing Redis."
        )
    return found


async def redis_ping(url: str, timeout: float = 2.0) -> bool:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        return bool(await client.ping())
    except Exception:
        return False
    finally:
        await client.aclose()


class LocalRedis:
    """One redis-server process of ours, with its files under `settings.home / 'redis'`."""

    def __init__(self, settings: StackSettings):
        self.settings = settings
        self.dir = settings.home / "redis"
        self.pid_file = self.dir / "redis.pid"
        self.log_file = self.dir / "redis.log"

    def pid(self) -> int | None:
        # redis-server rewrites its command line to "redis-server 127.0.0.1:PORT".
        return owned_pid(self.pid_file, f"{LOOPBACK}:{self.settings.redis_port}")

    def answers(self, timeout: float = 2.0) -> bool:
        import asyncio

        return asyncio.run(redis_ping(self.settings.redis_url, timeout))

    def start(self, timeout: float = 30.0) -> bool:
        """Start redis-server unless ours is already running. Returns True if it started one."""
        if self.pid() is not None:
            if self.answers():
                return False
            raise StackError(
                f"our redis-server (pid {self.pid()}) does not answer on "
                f"{self.settings.redis_url}. Last lines of {self.log_file}:\n" + tail(self.log_file)
            )
        exe = redis_server_executable()
        if not port_is_free(LOOPBACK, self.settings.redis_port):
            raise StackError(
                f"Redis port {LOOPBACK}:{self.settings.redis_port} is in use by another process. "
                "Stop it, or choose another port (--redis-port / SLUICE_REDIS_PORT)."
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            exe,
            "--bind",
            LOOPBACK,
            "--port",
            str(self.settings.redis_port),
            "--daemonize",
            "yes",
            "--dir",
            str(self.dir),
            "--pidfile",
            str(self.pid_file),
            "--logfile",
            str(self.log_file),
            "--save",
            "",
            *self._persistence(),
            "--protected-mode",
            "yes",
        ]
        if self.settings.redis_password:  # AUTH required (the password is also in redis_url)
            cmd += ["--requirepass", self.settings.redis_password]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise StackError(
                f"redis-server failed to start:\n{(proc.stdout + proc.stderr).strip()}"
                f"\n{tail(self.log_file)}"
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pid() is not None and self.answers(timeout=1):
                log.info("Redis up on %s (pid %s)", self.settings.redis_url, self.pid())
                return True
            time.sleep(0.2)
        raise StackError(
            f"redis-server did not answer within {timeout:.0f} s. Last lines of "
            f"{self.log_file}:\n{tail(self.log_file)}"
        )

    def _persistence(self) -> list[str]:
        """Session records survive a restart of Redis (an append-only file in its directory)."""
        fsync = self.settings.redis_appendfsync
        if fsync not in REDIS_APPENDFSYNC_CHOICES:
            raise StackError(
                f"SLUICE_REDIS_APPENDFSYNC must be one of {', '.join(REDIS_APPENDFSYNC_CHOICES)}, "
                f"not {fsync!r}"
            )
        if fsync == "off":
            return ["--appendonly", "no"]
        return ["--appendonly", "yes", "--appendfsync", fsync]

    def stop(self) -> bool:
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        stop_pid(pid, timeout=20)
        self.pid_file.unlink(missing_ok=True)
        return True
