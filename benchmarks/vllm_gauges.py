#!/usr/bin/env python3
"""vLLM's request gauges as each of its API-server processes last wrote them, not as ``/metrics`` sums them.

With several API servers vLLM keeps its Prometheus values in a ``PROMETHEUS_MULTIPROC_DIR`` of its own (one file per
process) and ``/metrics`` shows, for ``vllm:num_requests_running`` / ``_waiting`` (``multiprocess_mode``
``mostrecent``), the value written last by any process. The engine core sends its scheduler's counts to one API
server per step; a process that gets no more of them keeps its last value. This reads every process's file: the
value, when it was written (seconds ago) and whether that process still lives, so that a stale gauge (its writer
got nothing after the batch) can be told from requests vLLM really kept (the same count everywhere, fresh).

Finds the directory from the processes themselves: each API server keeps its own files
(``counter_<pid>.db``, ``gauge_mostrecent_<pid>.db``, ... as prometheus-client names them) open, so the folder of those
open files is the directory; a process with none open yet is found by the variable in its ``/proc/PID/environ``, read
raw. vLLM names its processes with ``setproctitle`` (``VLLM::APIServer_0``), which overwrites the start of the memory
``/proc/PID/environ`` shows with NUL bytes to make room for the title: ``psutil.Process.environ()`` stops at the first
NUL and returns nothing, while the variables are still there further on. A directory with no ``vllm:`` sample is not
vLLM's (vllama's own workers keep one too) and is left out. ``--pid`` reads only that process's directory.

    python benchmarks/vllm_gauges.py            # every vLLM on this machine
    python benchmarks/vllm_gauges.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import psutil
from prometheus_client.mmap_dict import MmapedDict

NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total")


#: prometheus-client's multiprocess file names (``values.py``: ``{type}[_{mode}]_{pid}.db``)
DB_NAME = re.compile(r"^(counter|histogram|summary|gauge_[a-z]+)_(\d+)\.db$")


def environ_raw(pid: int) -> dict[str, str]:
    """The environment in ``/proc/PID/environ`` past any run of NUL bytes ``setproctitle`` left at its start
    (``psutil.Process.environ()`` stops at the first). Raises ``OSError`` (gone, not ours)."""
    data = Path(f"/proc/{pid}/environ").read_bytes()
    out: dict[str, str] = {}
    for item in data.split(b"\0"):
        name, eq, value = item.partition(b"=")
        if eq and name:
            out.setdefault(name.decode(errors="replace"), value.decode(errors="replace"))
    return out


def vllm_dirs(pid: int | None) -> dict[str, list[int]]:
    """Prometheus multiprocess directories -> the live pids that write in them (their files open) or have them as
    ``PROMETHEUS_MULTIPROC_DIR``; every process on the machine, or ``pid`` alone."""
    found: dict[str, set[int]] = {}
    for p in [psutil.Process(pid)] if pid else psutil.process_iter():
        try:
            dirs = {str(Path(f.path).parent) for f in p.open_files()
                    if (m := DB_NAME.match(Path(f.path).name)) and int(m.group(2)) == p.pid}
            if not dirs and (d := environ_raw(p.pid).get("PROMETHEUS_MULTIPROC_DIR")):
                dirs = {d}
        except (psutil.Error, OSError):
            continue
        for d in dirs:
            found.setdefault(d, set()).add(p.pid)
    return {d: sorted(pids) for d, pids in found.items() if Path(d).is_dir()}


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
        if not rows:  # not vLLM's (vllama's workers keep a directory of their own)
            continue
        out[d] = {"pids": pids, "rows": rows}
        print(f"{d} (processes {sorted(pids)}):")
        for r in rows:
            print(f"  {r['file']:<40} {r['name']:<32} {r['value']:>10g}  written {r['age_s']} s ago"
                  f"{'' if r['alive'] else ' (process gone)'}  {r['labels']}")
    if not out:
        print("no vLLM process writing vllm: gauges to a multiprocess directory (one API server: /metrics is that process's own)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
