"""Running a `tabfm` job on several processes: the torchrun command the launcher starts.

`tabfm pretrain | predict | demo --nproc N` check everything they can in the one launching process (config, layout,
output paths), then start torchrun, which starts N ranks of the job's worker module:

    launcher   args = job parser's parse; checks; run_torchrun(MODULE, worker_argv(worker parser, args), N)
    torchrun   python -m tabfm._torchrun --nproc-per-node N [--max-restarts R] -m MODULE WORKER_ARGV
               (torch.distributed.run, quiet on Ctrl-C)
    each rank  MODULE parses WORKER_ARGV with the worker parser; `with process_group(device):` runs the job

The ranks get the launcher's parsed values back as a command line (`worker_argv`), checked to parse to the same
values, so what the ranks run is exactly what the launcher checked. How a rank joins the process group (backend from
the device, timeout, torchrun restarts) is `tabfm.parallel.process_group`, shared with the topology measurement.

Importing this module imports no torch: the `tabfm` command's parser imports it, and `tabfm --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence

GRACE_SECONDS = 30.0
"""How long the launcher waits, after Ctrl-C or SIGTERM, for torchrun and its ranks to stop before killing them."""

_COUNTED = ("+", "*")


def _flag(action: argparse.Action) -> str:
    """The option's long spelling (--output rather than -o)."""
    return max(action.option_strings, key=lambda s: (s.startswith("--"), len(s)))


def _tokens(action: argparse.Action, value) -> list[str]:
    """One option as command-line tokens. A value that starts with '-' is written --flag=VALUE so that it is not
    read as an option; a parsed value's str() must be its command-line form (see parse_layout's Layout)."""
    flag = _flag(action)
    if action.nargs == 0:  # store_true / store_false / store_const
        return [flag]
    if action.nargs in _COUNTED or isinstance(action.nargs, int):
        return [flag, *(str(v) for v in value)]
    text = str(value)
    return [f"{flag}={text}"] if text.startswith("-") else [flag, text]


def worker_argv(parser: argparse.ArgumentParser, args: argparse.Namespace, skip: Iterable[str] = ()) -> list[str]:
    """The options of `parser` whose value in `args` differs from the parser's default, as a command line that
    `parser` parses back to the same values (checked: a mismatch is a bug, RuntimeError). Options `args` lacks or
    named in `skip` (by dest; e.g. the launcher's own --nproc) are left out, so the worker takes its defaults."""
    skip = set(skip)
    argv: list[str] = []
    for action in parser._actions:  # argparse has no public list of a parser's options
        if not action.option_strings or action.dest in skip or not hasattr(args, action.dest):
            continue
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        value = getattr(args, action.dest)
        if value != action.default and value is not None:
            argv += _tokens(action, value)
    _check_round_trip(parser, args, argv, skip)
    return argv


def _check_round_trip(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str],
                      skip: set[str]) -> None:
    try:
        parsed = parser.parse_args(argv)
    except SystemExit:
        raise RuntimeError(f"the worker's parser {parser.prog!r} refuses the arguments {argv}") from None
    for dest, value in vars(parsed).items():
        if dest not in skip and hasattr(args, dest) and getattr(args, dest) != value:
            raise RuntimeError(f"{parser.prog}: {dest} would reach the ranks as {value!r}, not "
                               f"{getattr(args, dest)!r} (from {argv})")


def torchrun_command(module: str, argv: Sequence[str], nproc: int, max_restarts: int = 0) -> list[str]:
    """torchrun starting `nproc` ranks of `python -m module argv` on this machine. `--standalone`: the
    rendezvous takes a free port of its own, so two jobs on one machine never meet on torchrun's fixed default
    port (29500), where the second would fail to start or join the first."""
    if nproc < 1 or max_restarts < 0:
        raise ValueError(f"nproc must be at least 1 and max_restarts at least 0, got {nproc} and {max_restarts}")
    cmd = [sys.executable, "-m", "tabfm._torchrun", "--standalone", "--nproc-per-node", str(nproc)]
    if max_restarts:
        cmd += ["--max-restarts", str(max_restarts)]
    return [*cmd, "-m", module, *argv]


def worker_env() -> dict[str, str]:
    """This environment, with one compute thread per rank unless OMP_NUM_THREADS says otherwise (N ranks on N
    cores, not N x cores threads fighting for them)."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def exit_status(returncode: int) -> int:
    """torchrun's exit code as this command's: a death by signal N (negative returncode) is 128 + N, as a shell
    reports it."""
    return 128 - returncode if returncode < 0 else returncode


def run_command(cmd: Sequence[str], env: dict[str, str]) -> int:
    """Run torchrun and return its exit status. torchrun stays in the launcher's process group, so what a terminal
    sends the job (Ctrl-C, a hang-up) reaches torchrun and its ranks as before. A SIGTERM to the launcher alone
    (`timeout`, a scheduler) is passed on to torchrun once, which stops its ranks (the launcher used to die alone
    and leave them training); it then returns 128 + 15. On Ctrl-C torchrun (same group, same signal; passed on
    too, for a SIGINT sent to the launcher alone) stops its ranks; the launcher waits for that (GRACE_SECONDS)
    rather than killing torchrun and orphaning them. The wait
    is a loop of short waits, so a signal is handled at once even when it lands on another of the launcher's
    threads."""
    import threading

    proc = subprocess.Popen(list(cmd), env=env)
    terminated: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if not terminated:  # once: a second SIGTERM does not cut torchrun's shutdown of its ranks short
            terminated.append(signum)
            proc.send_signal(signum)

    main = threading.current_thread() is threading.main_thread()  # signal handlers belong to the main thread
    previous = signal.signal(signal.SIGTERM, forward) if main else None
    try:
        returncode = _wait_for(proc, lambda: bool(terminated))
    except KeyboardInterrupt:
        if proc.poll() is None:  # a SIGINT to the launcher alone too; from a terminal torchrun has it already, and
            proc.send_signal(signal.SIGINT)  # one still pending is not delivered twice
        try:
            proc.wait(timeout=GRACE_SECONDS)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        raise
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return 128 + signal.SIGTERM if terminated else exit_status(returncode)


def _wait_for(proc: subprocess.Popen, stopping: Callable[[], bool]) -> int:
    """proc's return code, waited for in short steps; once `stopping()` turns true, for GRACE_SECONDS at most,
    then proc is killed."""
    import time

    deadline = None
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            if stopping() and deadline is None:
                deadline = time.monotonic() + GRACE_SECONDS
            if deadline is not None and time.monotonic() > deadline:
                proc.send_signal(signal.SIGKILL)


def run_torchrun(module: str, argv: Sequence[str], nproc: int, max_restarts: int = 0) -> int:
    """Start `nproc` ranks of `python -m module argv` under torchrun, wait for them, return the exit status."""
    return run_command(torchrun_command(module, argv, nproc, max_restarts), worker_env())
