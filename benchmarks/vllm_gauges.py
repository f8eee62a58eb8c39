#!/usr/bin/env python3
"""vLLM's request gauges as each of its API-server processes last wrote them, not as ``/metrics`` sums them.

With several API servers vLLM keeps its Prometheus values in a ``PROMETHEUS_MULTIPROC_DIR`` of its own (one file per
process) and ``/metrics`` shows, for ``vllm:num_requests_running`` / ``_waiting`` (``multiprocess_mode``
``mostrecent``), the value written last by any process. The engine core sends its scheduler's counts to one API
server per step; a process that gets no more of them keeps its last value. This reads every process's file: the
value, when it was written (seconds ago) and whether that process still lives, so that a stale gauge (its writer
got nothing after the batch) can be told from requests vLLM really kept (the same count everywhere, fresh).

Finds the directory in the environment of the processes whose command line names vLLM (``--pid`` to name one).

    python benchmarks/vllm_gauges.py            # every vLLM on this machine
    python benchmarks/vllm_gauges.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import psutil
from prometheus_client.mmap_dict import MmapedDict

NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total")


def vllm_dirs(pid: int | None) -> dict[str, list[int]]:
    """``PROMETHEUS_MULTIPROC_DIR`` -> the pids (vLLM's processes) that have it in their environment."""
    found: dict[str, list[int]] = {}
    procs = [psutil.Process(pid)] if pid else psutil.process_iter(["cmdline"])
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
            if pid is None and "vllm" not in cmd.lower() and "VLLM::" not in cmd:
                continue
            d = p.environ().get("PROMETHEUS_MULTIPROC_DIR")
        except psutil.Error:
            continue
        if d:
            found.setdefault(d, []).append(p.pid)
    return found


def read(directory: str) -> list[dict]:
    """One row per (file, sample) of :data:`NAMES`: the file's pid, the labels, the value, its age and the pid's life."""
    rows = []
    now = time.time()
    for f in sorted(Path(directory).glob("*.db")):
        try:
            values = MmapedDict.read_all_values_from_file(str(f))
        except OSError:
            continue
        pid = f.stem.rsplit("_", 1)[-1]
        for key, value, stamp, _pos in values:
            metric, name, labels, _help = json.loads(key)
            if name not in NAMES:
                continue
            rows.append({"file": f.name, "pid": pid, "alive": pid.isdigit() and psutil.pid_exists(int(pid)),
                         "name": name, "labels": labels, "value": value,
                         "age_s": round(now - stamp, 1) if stamp else None})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pid", type=int, default=None, help="a vLLM process whose directory to read")
    p.add_argument("--json", default=None, help="write the rows there too")
    args = p.parse_args()
    out = {}
    for d, pids in vllm_dirs(args.pid).items():
        rows = read(d)
        out[d] = {"pids": pids, "rows": rows}
        print(f"{d} (processes {sorted(pids)}):")
        for r in rows:
            print(f"  {r['file']:<40} {r['name']:<32} {r['value']:>10g}  written {r['age_s']} s ago"
                  f"{'' if r['alive'] else ' (process gone)'}  {r['labels']}")
    if not out:
        print("no vLLM process with a PROMETHEUS_MULTIPROC_DIR (one API server: /metrics is that process's own)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
