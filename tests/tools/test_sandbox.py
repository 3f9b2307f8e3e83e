"""The python tool's sandbox, tried from inside: reading outside the scratch directory, opening a
socket, a fork bomb, a memory hog, an endless loop and a sleeping one each end the program with a
clean error that names the limit, nothing the program started outlives it, and the sandbox then
runs the next program as if nothing had happened."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from sluice.tools.python_tool import DEFINITION, python_tool
from sluice.tools.registry import ToolError
from sluice.tools.sandbox import Limits, Sandbox, SandboxUnavailable

LIMITS = Limits(
    wall_s=4.0,
    cpu_s=2,
    memory_bytes=256 << 20,
    processes=32,
    file_bytes=4 << 20,
    scratch_bytes=16 << 20,
)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    try:
        return Sandbox(LIMITS)
    except SandboxUnavailable as e:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the sandbox must run under CI (scripts/bootstrap.sh installs it): {e}")
        pytest.skip(str(e))


def processes_with(token: str) -> list[int]:
    """Processes whose command line holds `token`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_a_program_runs_and_prints(sandbox):
    outcome = sandbox.run_python("import math\nprint(math.factorial(20))")
    assert outcome.ok and outcome.stdout == "2432902008176640000\n" and outcome.why is None


def test_outside_its_scratch_directory_a_program_reads_and_writes_nothing(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the worker's secret")
    for path in (str(secret), "/etc/passwd", str(Path.home() / ".bashrc"), os.getcwd()):
        outcome = sandbox.run_python(f"print(open({path!r}).read())")
        assert not outcome.ok and "the worker's secret" not in outcome.stdout
        assert "No such file or directory" in outcome.stderr or "Is a directory" in outcome.stderr
    written = sandbox.run_python("open('/usr/owned', 'w')")
    assert not written.ok and "Read-only file system" in written.stderr
    # its scratch directory is its own, and empty at each run
    assert sandbox.run_python("open('notes.txt', 'w').write('x')").ok
    assert sandbox.run_python("import os\nprint(os.listdir('.'))").stdout == "[]\n"
    # and it holds no more than its size, however the program writes
    filled = sandbox.run_python(
        "for i in range(20):\n    open(f'part{i}', 'wb').write(b'x' * (3 << 20))"
    )
    assert not filled.ok and "No space left on device" in filled.stderr


def test_a_program_opens_no_connection(sandbox, bootstrap_servers):
    host, port = bootstrap_servers.split(",")[0].rsplit(":", 1)
    for address in ((host, int(port)), ("1.1.1.1", 53)):  # the broker it can see; the internet
        outcome = sandbox.run_python(
            f"import socket\nsocket.create_connection({address!r}, timeout=2)\nprint('open')"
        )
        assert not outcome.ok and "open" not in outcome.stdout
        assert "unreachable" in outcome.stderr or "refused" in outcome.stderr


def test_limits_end_a_program_cleanly_and_the_sandbox_keeps_serving(sandbox):
    token = uuid.uuid4().hex
    cases = {
        "process limit": "import os\nwhile True:\n    os.fork()",
        "memory limit": "x = bytearray(2_000_000_000)",
        "CPU time limit": "while True:\n    pass",
        "wall-clock limit": f"import time\ntime.sleep(60)  # {token}",
        "file size limit": "open('big', 'wb').write(b'x' * (64 << 20))",
    }
    for limit, code in cases.items():
        outcome = sandbox.run_python(code)
        assert not outcome.ok and outcome.why is not None and limit in outcome.why, (limit, outcome)
        assert outcome.seconds < LIMITS.wall_s + 3
        assert sandbox.run_python("print('still here')").stdout == "still here\n"
    assert processes_with(token) == []  # the sleeper did not outlive its run


def test_nothing_a_program_starts_outlives_it(sandbox):
    token = uuid.uuid4().hex
    code = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)  # {token}'])\n"
        "print('left a child behind')"
    )
    assert sandbox.run_python(code).ok
    assert processes_with(token) == []


def test_the_python_tool_answers_with_the_output_or_says_why_not(sandbox):
    tool = python_tool(LIMITS)
    assert DEFINITION["function"]["name"] == "python" and tool.definition == DEFINITION
    assert tool('{"code": "print(123 * 457 + 19)"}') == "56230\n"
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        tool('{"code": "print(1 / 0)"}')
    with pytest.raises(ToolError, match="CPU time limit"):
        tool('{"code": "while True:\\n    pass"}')
    with pytest.raises(ToolError, match='"code"'):
        tool('{"program": "print(1)"}')
