#!/usr/bin/env python3
"""The most file descriptors each matching process (and its children) held while a run went on, beside its limit.

Samples ``/proc/PID/fd`` every ``--every`` seconds until ``--seconds`` pass or SIGTERM/SIGINT arrives, then prints one
line per process: pid, peak open descriptors, the soft and hard ``RLIMIT_NOFILE`` (``/proc/PID/limits``), its command.
Processes are those whose command line matches ``--match`` (a regex; repeatable) and their descendants, found again
at every sample (a load generator's client processes start after it).

    python3 benchmarks/fd_peak.py --match 'loadgen\\.py' --match 'vllama_proxy serve' --seconds 120 > fds.txt &
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import time

import psutil


def limits(pid: int) -> str:
    """``soft/hard`` of ``Max open files`` in ``/proc/PID/limits``, or ``?``."""
    try:
        for line in open(f"/proc/{pid}/limits"):
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return f"{soft}/{hard}"
    except OSError:
        pass
    return "?"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--match", action="append", required=True)
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--every", type=float, default=0.5)
    a = p.parse_args()
    pats = [re.compile(m) for m in a.match]
    stop = False

    def end(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGINT, end)
    peak: dict[int, tuple[int, str, str]] = {}
    until = time.monotonic() + a.seconds
    while not stop and time.monotonic() < until:
        procs: set[psutil.Process] = set()
        for proc in psutil.process_iter():
            try:
                cmd = " ".join(proc.cmdline())
                if proc.pid != os.getpid() and any(x.search(cmd) for x in pats):
                    procs.add(proc)
                    procs.update(proc.children(recursive=True))
            except psutil.Error:
                continue
        for proc in procs:
            try:
                n = len(os.listdir(f"/proc/{proc.pid}/fd"))
                if n > peak.get(proc.pid, (-1,))[0]:
                    peak[proc.pid] = (n, limits(proc.pid), " ".join(proc.cmdline())[:90])
            except (OSError, psutil.Error):
                continue
        time.sleep(a.every)
    print(f"{'pid':>7} {'peak fds':>9} {'limit soft/hard':>16}  command")
    for pid, (n, lim, cmd) in sorted(peak.items(), key=lambda kv: -kv[1][0]):
        print(f"{pid:>7} {n:>9} {lim:>16}  {cmd}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
