"""Start several commands at once on this machine and wait for all of them, within a time
bound: the "nodes" and processes of the multi-machine chapter.

Framework-free: the commands are ``torchrun …`` or ``python -m dpbook.jax.multiprocess …``
lines. Whatever happens — success, a failure, the time bound — every process the commands
started, children included, is gone when :func:`run_local` returns or raises.
"""
from __future__ import annotations

import dataclasses
import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import time
from typing import Mapping, Sequence

import psutil

__all__ = ["Result", "LaunchError", "free_port", "run_local", "log_message"]


@dataclasses.dataclass
class Result:
    """One finished command: its arguments, process id (also its session id), exit code,
    output (stdout and stderr merged) and the seconds it took."""

    args: list[str]
    pid: int
    returncode: int
    output: str
    seconds: float


class LaunchError(RuntimeError):
    """A command failed or the time bound passed; ``results`` has what each one printed."""

    def __init__(self, message: str, results: list[Result]):
        super().__init__(message)
        self.results = results


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now, for a rendezvous that
    another program binds later (torchrun's, JAX's coordinator).

    Taken at random below the system's ephemeral range (Linux: ``ip_local_port_range``),
    where the outgoing connections of other programs never land: a port from inside
    that range can be taken by one of them before the rendezvous binds it.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    pool = range(max(1024, low - 10_000), low)
    tries = random.SystemRandom().sample(pool, min(len(pool), 64))  # not the seeded RNG
    for port in [*tries, 0]:                     # 0: any port the system picks
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free TCP port on 127.0.0.1")


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill ``proc``, its process group and every process below it; reap ``proc``."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)    # the command's session (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
    for p in family:                           # children that made sessions of their own
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)
    proc.wait()


def run_local(commands: Sequence[Sequence[str]], timeout: float = 120,
              env: Mapping[str, str | None] | None = None, check: bool = True,
              cwd: str | None = None) -> list[Result]:
    """Run ``commands`` concurrently; return one :class:`Result` per command, in order.

    ``env`` is added to this process's environment for every command (a ``None`` value
    removes the variable). Each command runs
    in its own session, so a command and all the processes it starts can be killed
    together. Raises :class:`LaunchError` after ``timeout`` seconds (having killed all of
    them), and — when ``check`` — if any command exits with a non-zero code (the others
    are then killed too: their peers are gone, they would only wait for them).
    """
    if not commands:
        raise ValueError("no commands to run")
    full_env = {**os.environ, **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    logs = [tempfile.TemporaryFile(mode="w+", encoding="utf8", errors="replace")
            for _ in commands]
    start = time.monotonic()
    procs = [subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=full_env,
                              cwd=cwd, start_new_session=True)
             for cmd, log in zip(commands, logs)]
    ends: list[float | None] = [None] * len(procs)
    failed: int | None = None               # the first command that failed by itself
    timed_out = False
    try:
        while any(e is None for e in ends):
            for i, p in enumerate(procs):
                if ends[i] is None and p.poll() is not None:
                    ends[i] = time.monotonic()
                    if check and p.returncode != 0 and failed is None:
                        failed = i
            if failed is not None:
                break
            if time.monotonic() - start > timeout:
                timed_out = True
                break
            time.sleep(0.1)
    finally:
        for i, p in enumerate(procs):   # also the children of finished commands
            _kill_tree(p)
            if ends[i] is None:
                ends[i] = time.monotonic()
    results = []
    for cmd, p, log, end in zip(commands, procs, logs, ends):
        log.seek(0)
        results.append(Result(list(cmd), p.pid, p.returncode, log.read(), end - start))
        log.close()
    if timed_out:
        raise LaunchError(f"{len(commands)} command(s) still running after {timeout} s; "
                          "all killed", results)
    if failed is not None:
        codes = [r.returncode for r in results]
        tail = "\n".join(results[failed].output.splitlines()[-20:])
        raise LaunchError(f"a command failed (exit codes {codes}); the others were killed. "
                          f"The last lines of command {failed}:\n{tail}", results)
    return results


#: the prefix of a line logged by torch's C++ side or by torchrun's Python loggers:
#: severity and date, time, thread id (Python), source file and line, as in
#: ``E1126 06:03:25.336000 31393 torch/distributed/elastic/.../api.py:1002] `` and
#: ``[rank0]:[I1126 08:50:03.131296400 reducer.cpp:1228] ``
_LOG_PREFIX = re.compile(r"^(\[rank\d+\]:)?\[?[IWEF]\d{4} [\d:.]+ +(\d+ +)?[^\]\s]*\] ")


def log_message(line: str) -> str:
    """What a log line of torch's C++ side or of torchrun says, without its prefix
    (severity, date, time, thread id, source file); other lines come back as they are.

    >>> log_message("E1126 06:03:25.336000 31393 torch/x/api.py:1002] failed (exitcode: -9)")
    'failed (exitcode: -9)'
    >>> log_message("[I1126 08:49:59.758826055 socket.cpp:955] [c10d] connected")
    '[c10d] connected'
    >>> log_message("[rank0]:[I1126 08:50:03.131296400 reducer.cpp:1228] Reducer: ...")
    'Reducer: ...'
    >>> log_message("[rank 0/2] epoch 1")
    '[rank 0/2] epoch 1'
    """
    return _LOG_PREFIX.sub("", line.strip())
