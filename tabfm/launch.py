"""Running a `tabfm` job on several processes: the torchrun command the launcher starts.

`tabfm pretrain | predict | demo --nproc N` check everything they can in the one launching process (config, layout,
output paths), then start torchrun, which starts N ranks of the job's worker module:

    launcher   args = job parser's parse; checks; run_torchrun(MODULE, worker_argv(worker parser, args), N)
    torchrun   python -m torch.distributed.run --nproc-per-node N [--max-restarts R] -m MODULE WORKER_ARGV
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
from collections.abc import Iterable, Sequence

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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
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
    """Run torchrun in a process group of its own and return its exit status. SIGINT or SIGTERM to the launcher
    (Ctrl-C, `timeout`, a scheduler) goes to that whole group, torchrun and its ranks, as a terminal's Ctrl-C goes
    to every process of its group: the ranks stop as they do on Ctrl-C, and none is left training after the
    launcher has gone (it used to die alone on SIGTERM, and a SIGINT that reached one of its other threads waited
    for torchrun to end). It then waits GRACE_SECONDS for them before killing the group; Ctrl-C is raised again
    as KeyboardInterrupt, SIGTERM returns 128 + 15."""
    import threading
    import time

    proc = subprocess.Popen(list(cmd), env=env, start_new_session=True)
    received: list[int] = []

    def stop(signum: int, frame: object) -> None:
        if not received:  # once: a second signal during the grace period does not cut the ranks' cleanup short
            received.append(signum)
            _signal_group(proc, signum)

    handled = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    previous = {sig: signal.signal(sig, stop) for sig in handled}
    try:
        deadline = None
        while True:
            try:
                returncode = proc.wait(timeout=0.2)  # short waits: the handler runs between them
                break
            except subprocess.TimeoutExpired:
                if received and deadline is None:
                    deadline = time.monotonic() + GRACE_SECONDS
                if deadline is not None and time.monotonic() > deadline:
                    _signal_group(proc, signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received and received[0] == signal.SIGINT:
        raise KeyboardInterrupt
    return 128 + received[0] if received else exit_status(returncode)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    """Send `signum` to the process group torchrun leads (torchrun and its ranks); nothing if it has ended."""
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass


def run_torchrun(module: str, argv: Sequence[str], nproc: int, max_restarts: int = 0) -> int:
    """Start `nproc` ranks of `python -m module argv` under torchrun, wait for them, return the exit status."""
    return run_command(torchrun_command(module, argv, nproc, max_restarts), worker_env())
