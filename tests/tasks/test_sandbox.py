"""The sandbox runs untrusted code: right output, hard limits, no network, nothing left behind."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leantrain.tasks import sandbox
from leantrain.tasks.sandbox import isolation, run_python


def test_prints_the_value() -> None:
    result = run_python("print(sum([3, 5, 2]))")
    assert result.ok
    assert result.stdout == "10\n"
    assert result.stderr == ""


def test_infinite_loop_is_killed_within_the_timeout() -> None:
    start = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=0.5)
    assert time.monotonic() - start < 3.0
    assert result.timed_out
    assert not result.ok


def _slow_start(tmp_path: Path, delay_s: float) -> str:
    """An interpreter that takes `delay_s` to start when it runs code (not when probed)."""
    wrapper = tmp_path / "slow-python"
    sleep = shutil.which("sleep")
    assert sleep is not None
    # isolation() probes with `-I -S -c pass`; run_python passes `-I -S -X utf8 -c ...`.
    wrapper.write_text(
        f'#!/bin/sh\nif [ "$3" = -X ]; then {sleep} {delay_s}; fi\nexec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def test_the_timeout_counts_the_code_not_the_interpreter_start(tmp_path: Path) -> None:
    python = _slow_start(tmp_path, 1.5)
    result = run_python("print('hi')", timeout_s=0.5, python=python)
    assert result.ok and result.stdout == "hi\n"
    assert result.start_s is not None and result.start_s >= 1.5
    looping = run_python("while True:\n    pass", timeout_s=0.5, python=python)
    assert looping.timed_out and looping.start_s is not None
    assert 0.5 <= looping.wall_s - looping.start_s < 2.0


def test_an_interpreter_that_does_not_start_in_time_is_killed(tmp_path: Path) -> None:
    start = time.monotonic()
    result = run_python("print('hi')", start_timeout_s=1.0, python=_slow_start(tmp_path, 60))
    assert time.monotonic() - start < 10.0
    assert result.timed_out and result.start_s is None
    assert not result.ok and result.stdout == ""


def test_memory_bomb_fails_cleanly() -> None:
    result = run_python("x = bytearray(2 * 10**9)\nprint('allocated')", memory_mb=128)
    assert not result.ok
    assert not result.timed_out
    assert "allocated" not in result.stdout
    assert "MemoryError" in result.stderr


def test_files_are_written_in_a_temporary_directory_that_is_removed() -> None:
    code = (
        "import os\nopen('out.txt', 'w').write('hi')\nprint(os.getcwd())\nprint(os.environ['HOME'])"
    )
    result = run_python(code)
    assert result.ok
    workdir, home = result.stdout.split()
    assert workdir == home
    assert Path(workdir).resolve() != Path.cwd().resolve()
    assert not Path(workdir).exists()


def test_environment_is_empty_of_our_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    result = run_python("import os\nprint(sorted(os.environ))")
    assert result.ok
    assert "HTTPS_PROXY" not in result.stdout


def test_socket_connect_to_localhost_fails() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "print('connected')"
        )
        result = run_python(code)
    assert "connected" not in result.stdout
    assert result.returncode != 0
    assert "Error" in result.stderr


def test_network_namespace_has_only_loopback() -> None:
    if not isolation().network:
        pytest.skip("network namespaces are not available here")
    # /proc/self/net/dev lists the interfaces of the reader's own network namespace.
    result = run_python("print(open('/proc/self/net/dev').read())")
    assert result.ok and result.network_isolated
    interfaces = [line.split(":")[0].strip() for line in result.stdout.splitlines()[2:] if line]
    assert interfaces == ["lo"]


def test_huge_output_is_truncated() -> None:
    result = run_python("print('x' * 10**6)", max_output_bytes=1000)
    assert result.truncated
    assert not result.ok
    assert result.stdout == "x" * 1000


def test_endless_output_is_stopped() -> None:
    result = run_python("while True:\n    print('y' * 100)", timeout_s=5.0, max_output_bytes=5000)
    assert result.truncated
    assert not result.timed_out
    assert len(result.stdout) == 5000


def test_stderr_is_captured_on_exception() -> None:
    result = run_python("print('before')\n1 / 0")
    assert result.returncode == 1
    assert result.stdout == "before\n"
    assert "ZeroDivisionError" in result.stderr
    assert 'File "main.py", line 2' in result.stderr


def test_exit_status_is_reported() -> None:
    assert run_python("import sys\nsys.exit(3)").returncode == 3


def test_big_files_are_refused() -> None:
    result = run_python(
        "open('big', 'w').write('a' * 100_000)\nprint('wrote')", max_file_bytes=1000
    )
    assert not result.ok
    assert "wrote" not in result.stdout


def test_descendants_do_not_outlive_the_run(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    os.chmod(tmp_path, 0o777)  # writable by the sandbox user, should it run as `nobody`
    later = f"import time; time.sleep(1); open({str(marker)!r}, 'w').close()"
    code = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-I', '-S', '-c', {later!r}], start_new_session=True)\n"
        "print('spawned')"
    )
    result = run_python(code)
    assert result.ok and result.stdout == "spawned\n"
    assert result.wall_s - result.start_s < 1.0  # did not wait for the grandchild
    if not isolation().network:
        pytest.skip("without a PID namespace a setsid'd grandchild can outlive the run")
    time.sleep(1.5)
    assert not marker.exists()


def test_root_drops_to_an_unprivileged_user() -> None:
    # /usr/bin/python3, unlike an interpreter under /root, is reachable by `nobody`.
    system_python = "/usr/bin/python3"
    if os.geteuid() != 0 or not os.access(system_python, os.X_OK):
        pytest.skip("needs root and a system python")
    iso = isolation(system_python)
    if iso.uid is None:
        pytest.skip("this machine refuses both unshare --setuid and Popen(user=...)")
    result = run_python("import os\nprint(os.getuid())", python=system_python)
    assert result.ok
    assert result.stdout.strip() == str(iso.uid) != "0"


def test_uses_this_interpreter_by_default() -> None:
    result = run_python("import sys\nprint(sys.version_info[:2])")
    assert result.stdout.strip() == str(sys.version_info[:2])


def test_output_written_just_before_exit_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child prints and exits between a select that saw nothing and the check that it is
    gone: what it printed is still read (under load this lost 1 output in 10)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(0.3); print(42)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )

    class ExitsAfterPrinting:
        """`proc`, whose poll() waits for the exit: the race, made certain."""

        stdout, stderr = proc.stdout, proc.stderr

        def poll(self) -> int:
            return proc.wait()

    started_read, started_write = os.pipe()
    os.close(started_write)  # the code never signals its start: the start deadline holds
    monkeypatch.setattr(sandbox, "_POLL_S", 0.05)
    try:
        result = sandbox._read(ExitsAfterPrinting(), started_read, time.monotonic() + 5, 1.0, 100)
    finally:
        os.close(started_read)
    assert result == (b"42\n", b"", None, False, False)
