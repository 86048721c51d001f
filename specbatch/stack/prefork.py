"""Service processes forked from a process that has already imported them (a zygote).

Starting ``python -m target_service`` spends seconds importing torch, transformers and the engine
before it loads a model; three services starting together on a small host contend for its cores
while they do, and the test suite starts dozens of them. A ``Zygote`` imports those modules once and
then forks one child per service, which runs the module as ``python -m`` would (``runpy``, its own
``sys.argv`` and environment) without importing anything again.

``Zygote.start(module, args, env)`` has the signature of ``popen`` (a plain ``subprocess.Popen`` of
``python -m module``) and returns a ``Child`` with the part of ``Popen``'s interface the launcher
and the tests use: ``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``,
``returncode``. Children are the zygote's, not the caller's: the zygote reports each one's exit
status, kills them all when the caller closes it (or dies), and each child dies with the zygote.

Forking is safe here because the zygote only imports: it starts no thread, no CUDA context and no
gRPC channel before it forks. Intra-op threads: OpenMP reads ``OMP_NUM_THREADS`` once, at
import; a child whose environment sets it gets it through ``torch.set_num_threads``.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import runpy
import select
import signal
import subprocess
import sys
import threading
import traceback

from specbatch.stack.child import die_with_parent

# What the services and the coordinator import before they do anything (python -m of each).
PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "specbatch.service.main",
           "target_service.servicer", "draft_service.servicer", "coordinator.app")
POLL_SECONDS = 0.05  # how often the zygote looks for exited children between commands


# The signal a child of ``popen`` gets when its launcher dies (kill -9 included). A model service
# gets SIGTERM: it stops within its grace period and removes its local socket (and the stack's
# socket folder with the last one). The coordinator gets SIGKILL: a drain needs the services, which
# are going too, so it would only wait out --drain-seconds; it holds no file to remove.
DEATH_SIGNALS = {"coordinator": signal.SIGKILL}


def popen(module: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m module args``: a fresh interpreter (what ``Zygote.start`` stands in for), which
    dies with this process (``specbatch.stack.child``), in a process group of its own: a Ctrl-C at
    the terminal reaches only this process, which stops its children in order."""
    command = [sys.executable, "-m", module, *args]
    # The kernel signals a child when the thread that forked it ends: only the main thread lives
    # as long as the process (``specbatch up`` starts its services from it).
    if threading.current_thread() is threading.main_thread():
        sig = DEATH_SIGNALS.get(module, signal.SIGTERM)
        command = [sys.executable, "-m", "specbatch.stack.child", str(os.getpid()), str(int(sig)), module, *args]
    return subprocess.Popen(command, env=env, process_group=0)


class Zygote:
    """A process that has imported ``preload``, forking children on request. Not started until
    ``start`` is first called; ``close`` kills every child still running."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD, env: dict[str, str] | None = None):
        self.preload, self.env = preload, env
        self.process: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one command at a time: a "started" reply answers the last one
        # The replies that answer calls, in order: "ready" once, "started" per command, "gone" at EOF.
        self._answers: queue.Queue = queue.Queue()
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._gone = False  # the zygote exited: no more replies

    def _launch(self) -> None:
        read_fd, write_fd = os.pipe()
        self.process = subprocess.Popen([sys.executable, "-m", "specbatch.stack.prefork", str(write_fd), *self.preload],
                                        stdin=subprocess.PIPE, pass_fds=(write_fd,), env=self.env)
        os.close(write_fd)
        threading.Thread(target=self._read, args=(os.fdopen(read_fd, "r"),), name="zygote-replies",
                         daemon=True).start()

    def _read(self, replies) -> None:
        for line in replies:
            reply = json.loads(line)
            if "exited" in reply:
                with self._changed:
                    self._exits[reply["exited"]] = reply["returncode"]
                    self._changed.notify_all()
            else:
                self._answers.put(reply)
        with self._changed:
            self._gone = True
            self._changed.notify_all()
        self._answers.put({"gone": True})

    def start(self, module: str, args: list[str], env: dict[str, str] | None = None) -> "Child":
        """Fork a child running ``python -m module args`` with ``env`` (default: this process's)."""
        with self._lock:
            if self.process is None:
                self._launch()
                self._reply("ready", timeout=300)  # the imports take seconds
            request = {"module": module, "args": list(args), "env": dict(os.environ if env is None else env)}
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            return Child(self, self._reply("started", timeout=60), [module, *args])

    def _reply(self, key: str, timeout: float):
        try:
            reply = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"the zygote did not answer within {timeout:.0f} s") from None
        if key not in reply:
            raise RuntimeError(f"the zygote exited (code {self.process.wait()}) instead of answering")
        return reply[key]

    def returncode(self, pid: int) -> int | None:
        with self._changed:
            if pid not in self._exits and self._gone:
                self._exits[pid] = -signal.SIGKILL  # its children die with it (PDEATHSIG)
            return self._exits.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._gone, timeout)
        return self.returncode(pid)

    def close(self) -> None:
        """End the zygote: it kills its children still running and exits."""
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Child:
    """A zygote's child, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.wait(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid that may have been reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# ---- the zygote's side ---------------------------------------------------------------------------


def _run_child(request: dict, reply_fd: int, zygote: int) -> None:
    """In the forked child: become ``python -m module`` and never return."""
    code = 1
    try:
        die_with_parent(zygote, signal.SIGKILL)  # no child outlives the zygote
        os.close(reply_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the zygote's commands are not the child's input
        os.close(devnull)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))  # OpenMP read the zygote's at import
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - whatever it was, the child reports it and exits 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def serve(reply_fd: int, preload: list[str]) -> None:
    """The zygote: import ``preload``, then fork a child per command line on stdin until it closes."""
    for module in preload:
        importlib.import_module(module)
    zygote = os.getpid()

    def reply(message: dict) -> None:
        os.write(reply_fd, json.dumps(message).encode() + b"\n")

    reply({"ready": True})
    children: set[int] = set()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], POLL_SECONDS)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                break  # closed: the caller is done (or gone)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    _run_child(json.loads(line), reply_fd, zygote)
                children.add(pid)
                reply({"started": pid})
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            reply({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
    for pid in children:
        os.kill(pid, signal.SIGKILL)  # not yet reaped, so still ours: the pid cannot have been reused
    for pid in children:
        _, status = os.waitpid(pid, 0)  # reaped here: a container's init may never reap zombies
        reply({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the caller, which closes the zygote
    serve(int(sys.argv[1]), sys.argv[2:])
