"""tabfm.launch (the torchrun command of `--nproc N`) and tabfm.parallel.process_group (how a rank joins): what the
ranks parse is what the launcher checked, exit codes come through, and a process group is joined and left once."""

from __future__ import annotations

import argparse
import signal
import socket
import sys

import pytest
import torch.distributed as dist

from tabfm import _cli_demo, _cli_predict, cli, launch
from tabfm.parallel.process_group import backend_for, init_process_group, process_group


def _parsed(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    return parser.parse_args(argv)


def test_predict_arguments_reach_the_ranks_unchanged():
    """Values that look like options (-o -, NA tokens starting with '-'), a layout, flags; --nproc stays behind."""
    argv = ["--train", "a.csv", "--target", "y", "--test=-b.csv", "-o", "-", "--na-values=-,?", "--proba",
            "--layout", "1x2", "--nproc", "2", "--n-estimators", "3", "--no-sequence-parallel"]
    args = _parsed(_cli_predict.worker_parser(), argv)
    tail = launch.worker_argv(_cli_predict.worker_parser(), args, skip=("nproc",))
    assert "--nproc" not in tail and "--output=-" in tail and "--test=-b.csv" in tail and "--na-values=-,?" in tail
    again = _parsed(_cli_predict.worker_parser(), tail)
    assert vars(again) == {**vars(args), "nproc": 1}
    assert again.layout == (1, 2) and str(again.layout) == "1x2"


def test_defaults_are_left_to_the_worker():
    args = _parsed(_cli_demo.worker_parser(), [])
    assert launch.worker_argv(_cli_demo.worker_parser(), args) == []


def test_a_value_that_would_reach_the_ranks_changed_is_a_bug_caught_before_torchrun():
    args = _parsed(_cli_demo.worker_parser(), ["--layout", "1x2"])
    args.layout = (1, 2)  # a plain tuple's str() is "(1, 2)", not its command-line form
    with pytest.raises(RuntimeError, match="layout"):
        launch.worker_argv(_cli_demo.worker_parser(), args)


def test_demo_launcher_starts_torchrun_with_what_it_was_given(monkeypatch):
    started = []
    monkeypatch.setattr(launch, "run_command", lambda cmd, env: started.append((cmd, env)) or 0)
    assert cli.main(["demo", "--layout", "1x2", "--steps", "3", "--sequence-parallel"]) == 0
    (cmd, env), = started
    assert cmd[:3] == [sys.executable, "-m", "tabfm._torchrun"] and "--max-restarts" not in cmd
    assert "--standalone" in cmd  # a free rendezvous port: two jobs on one machine (or two test workers) never meet
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and env["OMP_NUM_THREADS"]
    ranks = _cli_demo.worker_parser().parse_args(cmd[cmd.index("tabfm._cli_demo") + 1:])
    assert (ranks.layout, ranks.steps, ranks.sequence_parallel, ranks.heads) == ((1, 2), 3, True, 8)


def test_exit_status_of_torchrun_comes_through():
    assert launch.run_command([sys.executable, "-c", "raise SystemExit(3)"], {}) == 3
    kill = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    assert launch.run_command([sys.executable, "-c", kill], {}) == 128 + signal.SIGTERM
    with pytest.raises(ValueError, match="nproc must be at least 1"):
        launch.torchrun_command("tabfm.pretrain", [], 0)


def test_sigterm_to_the_launcher_stops_torchrun_and_its_ranks(tmp_path):
    """Found by an audit: SIGTERM (timeout, a scheduler) killed the launcher alone and its ranks trained on. A
    stand-in for torchrun starts a stand-in rank and, as torchrun does, stops it on SIGTERM; the SIGTERM to the
    launcher must reach it, and the launcher's own handler must be put back."""
    import os
    import threading
    import time

    pid_file = tmp_path / "rank.pid"
    rank = "import time; time.sleep(120)"
    torchrun = ("import os, signal, subprocess, sys\n"
                f"p = subprocess.Popen([sys.executable, '-c', {rank!r}])\n"
                "def stop(*_):\n    p.terminate(); os.waitpid(p.pid, 0); os._exit(143)\n"
                "signal.signal(signal.SIGTERM, stop)\n"
                f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
                "p.wait()\n")

    def signal_when_started():
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=signal_when_started, daemon=True).start()
    start = time.monotonic()
    assert launch.run_command([sys.executable, "-c", torchrun], dict(os.environ)) == 128 + signal.SIGTERM
    assert time.monotonic() - start < 20  # not the rank's 120 s, nor the grace period
    assert signal.getsignal(signal.SIGTERM) is before
    rank_pid = int(pid_file.read_text())
    for _ in range(100):
        try:
            os.kill(rank_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the rank outlived the launcher")


def test_run_command_off_the_main_thread_installs_no_handler():
    import threading

    before, codes = signal.getsignal(signal.SIGTERM), []
    worker = threading.Thread(target=lambda: codes.append(
        launch.run_command([sys.executable, "-c", "raise SystemExit(4)"], {})))
    worker.start()
    worker.join(30)
    assert codes == [4] and signal.getsignal(signal.SIGTERM) is before


def test_backend_follows_the_device():
    assert backend_for("cpu") == "gloo"
    assert backend_for("cuda") == ("nccl" if backend_for("auto") == "nccl" else "gloo")  # no GPU: gloo


def test_one_process_joins_no_group_and_a_callers_group_is_left_alone():
    with process_group("cpu") as started:  # WORLD_SIZE unset: one process
        assert not started and not dist.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert init_process_group("cpu", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}") == "gloo"
    try:
        with process_group("cpu", world_size=2) as started:  # already in a group: neither joined nor left
            assert not started
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def test_torchrun_stopped_by_a_signal_exits_with_the_shells_status_and_no_traceback(monkeypatch, capsys):
    """Found by an audit: on Ctrl-C torchrun stopped its ranks, then raised the signal as a traceback of its own
    beside the launcher's `interrupted` line (115-210 lines for 2 ranks with theirs)."""
    import signal

    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from tabfm import _torchrun

    def stopped(*args, **kwargs):
        raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(torch.distributed.run, "main", stopped)
    assert _torchrun.main() == 128 + signal.SIGTERM
    monkeypatch.setattr(torch.distributed.run, "main", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert _torchrun.main() == 130
    assert capsys.readouterr().err == ""
