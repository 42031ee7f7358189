"""torchrun as the launcher starts it (tabfm.launch), quiet on Ctrl-C or a SIGTERM: torchrun stops its ranks and
then re-raises the signal as a traceback of its own, beside the launcher's one line `tabfm pretrain: interrupted`
(with each rank's, about 115-210 lines for a 2-rank run). Its exit status is then the shell's for that signal."""

from __future__ import annotations

import sys


def main() -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun()
    except SignalException as e:
        return 128 + int(e.sigval)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
