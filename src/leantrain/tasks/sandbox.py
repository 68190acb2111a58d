"""Run untrusted, model-written Python in a child process with hard limits.

Each call gets a fresh temporary working directory (also HOME and TMPDIR, deleted afterwards), an
empty environment, CPU-time / address-space / file-size limits and no core dumps, and a wall-clock
deadline after which the whole process group is killed. Output beyond the limit is dropped and the
child killed (it can no longer print a right answer). The deadline counts the user's code only: the
child writes a byte on a pipe of its own as its prelude hands over, and until then a separate,
generous start-up allowance applies (an interpreter in fresh namespaces can take over a second to
start on a loaded machine, which must not eat a short timeout). Network access is blocked twice:
where the machine allows it the child runs in fresh network and PID namespaces (`unshare`: only a
loopback interface, and down; every descendant dies with the child), and a prelude inside the child
replaces the `socket` constructors with ones that refuse. When we are root the child also drops to
the `nobody` user where the interpreter is reachable by it; only then is RLIMIT_NPROC set, because
the kernel ignores it for root and for anyone else counts all of that user's processes.

In a PID namespace the interpreter is the namespace's init, so signals it sends itself are
ignored and writing past the file-size limit fails with EFBIG instead of killing it.

Not a security boundary against a determined attacker: without namespaces or a privilege drop
(`isolation()` says which applied) the child can read and write what this process can.
Knows nothing about tasks or models.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import pwd
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import NamedTuple

_MAIN = "main.py"
# Runs in the child before the user's code: refuse sockets, write one byte on the start pipe (its
# fd is argv[1]) and close it, then execute main.py as __main__ in fresh globals so that the
# prelude's names are not visible to it.
_PRELUDE = f"""\
import _socket, os, socket, sys

_started = int(sys.argv[1])

class _NoSocket:
    def __new__(cls, *args, **kwargs):
        raise PermissionError("network access is disabled in the leantrain sandbox")

def _refuse(*args, **kwargs):
    raise PermissionError("network access is disabled in the leantrain sandbox")

for _module in (_socket, socket):
    _module.socket = _module.SocketType = _NoSocket
    _module.socketpair = _refuse
socket.fromfd = _refuse

sys.argv = [{_MAIN!r}]
os.write(_started, b"s")
os.close(_started)
with open({_MAIN!r}, encoding="utf-8") as _file:
    _code = compile(_file.read(), {_MAIN!r}, "exec")
exec(_code, {{"__name__": "__main__", "__builtins__": __builtins__}})
"""
_MAX_PROCESSES = 64  # threads count too; enough for a thread pool, far short of a fork bomb
_POLL_S = 0.05  # how often the reader checks whether the child is gone while its pipes are quiet


@dataclass(frozen=True)
class Isolation:
    """How children are started on this machine, beyond rlimits.

    Attributes:
        network: the child runs in its own network namespace (and PID namespace).
        uid: the unprivileged user id the child runs as, or None if it keeps ours.
        launcher: command put before the interpreter (an `unshare` invocation) or empty.
        popen_user: drop to `uid` through `subprocess.Popen(user=...)` (no launcher did it).
    """

    network: bool
    uid: int | None
    launcher: tuple[str, ...] = ()
    popen_user: bool = False


@dataclass(frozen=True)
class SandboxResult:
    """What the child did.

    Attributes:
        stdout: standard output, decoded as UTF-8 (bad bytes replaced), at most the limit.
        stderr: standard error, likewise.
        returncode: exit status; negative is the signal that killed it (-9 when we killed it;
            under `unshare`, a child the kernel killed, e.g. at the CPU limit, shows as 1).
        timed_out: the child was killed at a deadline: the timeout after its code began, or
            the start-up allowance before (then `start_s` is None).
        truncated: an output stream went past the limit and the child was killed.
        network_isolated: the child ran in its own network namespace.
        wall_s: seconds from start to the child's end, start-up included.
        start_s: seconds the child took to reach the user's code, or None if it never did.
    """

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    truncated: bool
    network_isolated: bool
    wall_s: float
    start_s: float | None

    @property
    def ok(self) -> bool:
        """The code ran to completion and exited 0."""
        return self.returncode == 0 and not self.timed_out and not self.truncated


def run_python(
    code: str,
    *,
    timeout_s: float = 2.0,
    start_timeout_s: float = 30.0,
    memory_mb: int = 256,
    max_output_bytes: int = 10_000,
    max_file_bytes: int = 1_000_000,
    python: str | None = None,
) -> SandboxResult:
    """Run `code` as a Python script in the sandbox and return what it printed.

    Args:
        code: the program text, run as `__main__`.
        timeout_s: wall-clock limit on the code, counted from when it begins (not from the
            interpreter's start); CPU time is capped a little above it as a backstop.
        start_timeout_s: wall-clock limit on the interpreter reaching the code.
        memory_mb: address-space limit of the child (allocation past it raises MemoryError).
        max_output_bytes: most bytes kept of each of stdout and stderr.
        max_file_bytes: largest file the child may write (past it the write fails, or outside a
            PID namespace the child is killed by SIGXFSZ).
        python: interpreter to run (default: this one); run with -I -S, so no site-packages.
    """
    python = python or sys.executable
    iso = isolation(python)
    workdir = tempfile.mkdtemp(prefix="leantrain-sandbox-")
    try:
        with open(os.path.join(workdir, _MAIN), "w", encoding="utf-8") as f:
            f.write(code)
        if iso.uid is not None:
            os.chown(workdir, iso.uid, iso.uid)
        limits = _limits(timeout_s, memory_mb, max_file_bytes, nproc=iso.uid is not None)
        # The child writes one byte here as its code begins (see _PRELUDE).
        started_read, started_write = os.pipe()
        try:
            start = time.monotonic()
            proc = _spawn(python, iso, workdir, limits, started_write)
            try:
                out = _read(
                    proc, started_read, start + start_timeout_s, timeout_s, max_output_bytes
                )
            finally:
                # Also reaps stragglers that outlived the main process; safe before wait(): the
                # unreaped leader keeps the group id from being reused.
                _kill_group(proc.pid)
                proc.wait()
        finally:
            os.close(started_read)
        wall_s = time.monotonic() - start
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return SandboxResult(
        stdout=out.stdout[:max_output_bytes].decode("utf-8", "replace"),
        stderr=out.stderr[:max_output_bytes].decode("utf-8", "replace"),
        returncode=proc.returncode,
        timed_out=out.timed_out,
        truncated=out.truncated,
        network_isolated=iso.network,
        wall_s=wall_s,
        start_s=None if out.started_at is None else out.started_at - start,
    )


@functools.cache
def isolation(python: str | None = None) -> Isolation:
    """The strongest way of starting `python` (default: this interpreter) that works here.

    Probed once per interpreter by starting it each way in turn: network namespace and `nobody`,
    network namespace alone, `nobody` alone (the interpreter may be unreadable by `nobody`, or
    namespaces refused, as in an unprivileged container), then plain.
    """
    python = python or sys.executable
    for candidate in _candidates():
        if _starts(candidate, python):
            return candidate
    return Isolation(network=False, uid=None)


def _candidates() -> list[Isolation]:
    """Ways of starting a child, strongest first."""
    unshare = shutil.which("unshare")
    namespaces = ("--net", "--pid", "--fork", "--kill-child")
    if os.geteuid() != 0:
        # An unprivileged user may still create namespaces inside a user namespace of its own.
        if unshare is None:
            return []
        userns = (unshare, "--user", "--map-root-user", *namespaces, "--")
        return [Isolation(network=True, uid=None, launcher=userns)]
    try:
        nobody = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        nobody = 65534
    # Used as the group id too: nobody's group (nogroup/nobody) has the same number on Linux.
    drop = ("--setgid", str(nobody), "--setuid", str(nobody))
    found = [Isolation(network=False, uid=nobody, popen_user=True)]
    if unshare is not None:
        found[:0] = [
            Isolation(network=True, uid=nobody, launcher=(unshare, *namespaces, *drop, "--")),
            Isolation(network=True, uid=None, launcher=(unshare, *namespaces, "--")),
        ]
    return found


def _starts(iso: Isolation, python: str) -> bool:
    """Whether `python` starts and exits cleanly when launched as `iso` says."""
    try:
        done = subprocess.run(
            [*iso.launcher, python, "-I", "-S", "-c", "pass"],
            cwd="/",
            env={},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
            **_user_kwargs(iso),
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _spawn(
    python: str, iso: Isolation, workdir: str, limits: list[tuple[int, int]], started: int
) -> subprocess.Popen[bytes]:
    """Start the prelude under `iso` in `workdir`, `started` (a pipe's write end, closed here
    once the child holds it) passed as its start signal."""
    try:
        return subprocess.Popen(
            [*iso.launcher, python, "-I", "-S", "-X", "utf8", "-c", _PRELUDE, str(started)],
            cwd=workdir,
            env={"HOME": workdir, "TMPDIR": workdir, "PATH": "/usr/bin:/bin"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, so one killpg takes every child
            preexec_fn=functools.partial(_apply_limits, limits),
            pass_fds=(started,),
            **_user_kwargs(iso),
        )
    finally:
        os.close(started)  # only the child's processes hold it now: their end reads as EOF


def _user_kwargs(iso: Isolation) -> dict[str, object]:
    """Popen arguments that drop to `iso.uid` when no launcher does it."""
    if not iso.popen_user:
        return {}
    return {"user": iso.uid, "group": iso.uid, "extra_groups": []}


def _limits(
    timeout_s: float, memory_mb: int, max_file_bytes: int, *, nproc: bool
) -> list[tuple[int, int]]:
    """(resource, limit) pairs for the child; soft and hard are equal so it cannot raise them."""
    cpu_s = math.ceil(timeout_s) + 1  # a backstop: the wall-clock deadline normally fires first
    limits = [
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_AS, memory_mb * 2**20),
        (resource.RLIMIT_FSIZE, max_file_bytes),
        (resource.RLIMIT_CORE, 0),
    ]
    if nproc:
        limits.append((resource.RLIMIT_NPROC, _MAX_PROCESSES))
    return limits


def _apply_limits(limits: list[tuple[int, int]]) -> None:
    """Runs in the forked child before exec: set the resource limits."""
    for which, value in limits:
        resource.setrlimit(which, (value, value))


class _Output(NamedTuple):
    """What `_read` collected: the two streams, when the code began (monotonic time, None if it
    never did), and why reading stopped early, if it did."""

    stdout: bytes
    stderr: bytes
    started_at: float | None
    timed_out: bool
    truncated: bool


def _read(
    proc: subprocess.Popen[bytes], started: int, start_deadline: float, timeout_s: float, limit: int
) -> _Output:
    """Collect stdout and stderr until both close, the child is gone, a deadline passes or an
    output passes `limit`. The deadline is `start_deadline` until the child's byte arrives on the
    `started` pipe, then `timeout_s` after it."""
    assert proc.stdout is not None and proc.stderr is not None
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    deadline, started_at = start_deadline, None
    timed_out = truncated = False
    with selectors.DefaultSelector() as selector:
        for fd in (*buffers, started):
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and not truncated:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            events = selector.select(min(remaining, _POLL_S))
            if not events and proc.poll() is not None:
                # The child is gone. What it wrote between the select and its exit is still in
                # the pipes: read that, but don't wait for a descendant holding them open.
                events = selector.select(0)
                if not events:
                    break
            for key, _ in events:
                chunk = os.read(key.fd, 65536)
                if key.fd == started:
                    # One byte as the code begins; EOF alone means it never did.
                    selector.unregister(started)
                    if chunk:
                        started_at = time.monotonic()
                        deadline = started_at + timeout_s
                elif not chunk:
                    selector.unregister(key.fd)
                else:
                    buffers[key.fd] += chunk
                    truncated = truncated or len(buffers[key.fd]) > limit
    out, err = buffers.values()
    return _Output(bytes(out), bytes(err), started_at, timed_out, truncated)


def _kill_group(pgid: int) -> None:
    """SIGKILL a whole process group; a group that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
