"""``python -m specbatch.stack.child PARENT SIGNAL MODULE ARGS…``: ``python -m MODULE ARGS…`` that
is sent SIGNAL when its parent (pid PARENT) exits, however it exits, kill -9 included. This is how
``prefork.popen`` starts the services of ``specbatch up``, so that none outlives the launcher.
``die_with_parent`` is the one place that asks for it (the zygote's children use it too).

The kernel (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing happens) sends the signal when the
*thread* that forked the child ends, not the process: the parent must start it from a thread that
lives as long as the parent does (``popen`` asks for it only from the main thread).
"""

from __future__ import annotations

import ctypes
import os
import runpy
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, sig: int) -> None:
    """Have ``sig`` sent to this process when its parent exits; exit now if the parent, pid
    ``parent``, is gone already (it exited before the request took effect)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (AttributeError, OSError):  # not Linux
        return
    if os.getppid() != parent:
        os._exit(1)


if __name__ == "__main__":
    parent, sig, module, *args = sys.argv[1:]
    die_with_parent(int(parent), int(sig))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
