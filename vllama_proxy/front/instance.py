"""One ``vllama serve`` per state directory: an ``flock`` on ``<state dir>/serve.lock``, held while it runs.

The state directory holds what a server writes and later runs read: aliases (``/api/copy``), created
models (``/api/create``) and their uploads, the usage ledger, launch records (``supervisor/lifeline.py``).
Two servers of one user shared ``~/.local/state/vllama`` by default, and a second server's ``usage``,
``cp`` and ``create`` landed in the first's files, where the first served them too. As two ``ollama
serve`` on one port cannot both start, the second one here exits with one line naming the first (its
pid, address and start) and the flag giving it a directory of its own (``--state-dir``).
The kernel releases the lock when the process ends, however it ends: no stale lock to clean up.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import IO

_held: list[IO[str]] = []  # the open lock file: the lock lasts as long as it stays open


class StateDirInUse(Exception):
    """Another running ``vllama serve`` holds the state directory; the message is the line to print."""


def claim(state_dir: Path, host: str, port: int) -> None:
    """Take ``state_dir``'s lock for this process (kept until it exits) and write who holds it.

    Raises:
        StateDirInUse: another process holds it (its line names that process and ``--state-dir``).
        OSError: the directory cannot be made or the lock file opened.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "serve.lock"
    f = open(path, "a+")  # noqa: SIM115 - held open for the process's life
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        try:
            other = json.loads(f.read() or "{}")
        except ValueError:
            other = {}
        f.close()
        who = (f"pid {other.get('pid', '?')}, listening on {other.get('host', '?')}:{other.get('port', '?')}, "
               f"since {other.get('started', '?')}") if other else "its holder"
        raise StateDirInUse(f"vllama serve: the state directory {state_dir} is used by another vllama serve ({who}); "
                            f"give this one its own with --state-dir DIR (or VLLAMA_STATE_DIR), or stop that one") from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": host, "port": port,
                        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    f.flush()
    _held.append(f)
