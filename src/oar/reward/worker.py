"""What runs inside a reward worker process: it reads items from its end of a pipe, checks each
(:func:`oar.reward.verify.check_one`) and sends the verdict back; started as a plain ``python -c``
subprocess (:data:`SUBPROCESS_BOOT`) or by multiprocessing.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from multiprocessing.connection import Connection

from oar.reward.verify import Verdict, WorkFn

def worker_main(conn: Connection, work_fn: WorkFn) -> None:
    """Worker loop: receive a chunk ``(limit, [(key, response, gold), ...])``, answer ``(key, verdict)``
    per item, ``verdict`` being ``work_fn(response, gold, parsing_timeout=limit)``: True, False, or
    None when the check ran out of math-verify's limit (also when ``work_fn`` lets math-verify's
    ``TimeoutException`` through). Any other exception is a wrong answer (untrusted input).

    ``None`` (or a closed pipe) ends the loop. The first message is ``("ready", pid)`` after a
    warm-up item, so imports do not count against the first item's timeout.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it logs whole inputs on timeouts
    from math_verify.errors import TimeoutException

    try:
        work_fn("\\boxed{1}", "1", parsing_timeout=1)
    except (Exception, TimeoutException):  # noqa: BLE001 - a failing warm-up shows up on real items
        pass
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        limit, chunk = msg
        for key, response, gold in chunk:
            try:
                out = work_fn(response, gold, parsing_timeout=limit)
                ok: Verdict = None if out is None else bool(out)
            except TimeoutException:
                ok = None
            except Exception:  # noqa: BLE001 - untrusted input: any failure is "not correct"
                ok = False
            conn.send((key, ok))


#: What a "subprocess" worker runs: ``python -c SUBPROCESS_BOOT <fd>``.
SUBPROCESS_BOOT = "import sys; from oar.reward.worker import subprocess_main; subprocess_main(int(sys.argv[1]))"


def subprocess_main(fd: int) -> None:
    """Entry point of a ``"subprocess"`` worker: the first message on the socket is ``work_fn``."""
    conn = Connection(fd)
    try:
        work_fn = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    worker_main(conn, work_fn)
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (slow with sympy's caches); nothing to flush


class PopenProcess:
    """The part of the ``multiprocessing.Process`` interface the pool uses, for a ``Popen``."""

    sentinel = None  # the pool sees the death of a worker as EOF on its socket

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()
