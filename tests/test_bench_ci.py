"""``benchmarks/hop_report.py ci``: the throughput ratio over paired blocks with its 95 % interval (issue 42).

The printer must tell a target 3 % slower than its baseline from one that is not, from blocks
whose spread (drift shared by both targets of a block, plus noise) is like a GPU run's."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import hop_report  # noqa: E402


def _run(target: str, r: int, tok_s: float, ttft: float, itl: float) -> dict:
    return {"target": target, "round": r, "output_tok_s": tok_s, "ttft_ms": {"p50": ttft}, "itl_ms": {"p50": itl}}


def _file(tmp_path: Path, factor: float, blocks: int, noise: float = 0.01, seed: int = 1,
          ratios: list[float] | None = None) -> str:
    """A loadgen JSON of one level, c=16: ``blocks`` rounds of c (vLLM direct) and b (vllama at ``factor``
    of c's rate, or at each of ``ratios``); each block's rate drifts by up to ±20 % for both, each run
    adds ``noise``."""
    rng = random.Random(seed)
    runs = []
    for r in range(blocks):
        drift = 20000 * rng.uniform(0.8, 1.2)
        f = ratios[r] if ratios else factor * rng.gauss(1, noise)
        runs.append(_run("c", r, drift * (1 if ratios else rng.gauss(1, noise)), 20.0, 2.0))
        runs.append(_run("b", r, drift * f, 21.5 + rng.gauss(0, 0.2), 2.1))
    summary = {t: {"output_tok_s": 1.0} for t in ("b", "c")}
    data = {"baseline": "c", "levels": [{"concurrency": 16, "runs": runs, "summary": summary, "ratios": {}}]}
    path = tmp_path / f"sweep-{factor}-{blocks}.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_t_quantiles_match_the_tables():
    for df, table in ((1, 12.706), (2, 4.303), (5, 2.571), (10, 2.228), (29, 2.045), (120, 1.980)):
        assert hop_report.t_quantile(0.975, df) == pytest.approx(table, abs=0.002)


def test_three_percent_slower_is_told_from_parity(tmp_path):
    (slow,) = hop_report.ratio_ci(_file(tmp_path, 0.97, 40))
    assert slow["blocks"] == 40 and slow["target"] == "b"
    assert slow["hi"] < 1.0 and slow["boot_hi"] < 1.0  # both intervals exclude parity
    assert slow["lo"] < 0.97 < slow["hi"]
    assert slow["ratio"] == pytest.approx(0.97, abs=0.01)
    assert slow["ttft_p50_delta_ms"]["lo"] < 1.5 < slow["ttft_p50_delta_ms"]["hi"]
    assert slow["itl_p50_delta_ms"]["mean"] == pytest.approx(0.1)

    (even,) = hop_report.ratio_ci(_file(tmp_path, 1.0, 40))
    assert even["lo"] < 1.0 < even["hi"] and even["lo"] > 0.97
    assert even["verdict"].startswith(">= 0.97 (goal met)")


def test_three_rounds_do_not_resolve_it(tmp_path):
    """The old sweep's 3 rounds at c=16 on the H100 (issue 42: 0.70, 1.20, 0.87): the interval is wide
    and says so, with the blocks of that spread it would take."""
    (few,) = hop_report.ratio_ci(_file(tmp_path, 1.0, 3, ratios=[0.70, 1.20, 0.87]))
    assert few["lo"] < 0.97 and few["hi"] > 1.0
    assert few["verdict"] == "not resolved: the interval holds 0.97 and 1.0"
    assert few["blocks_for_resolve"] > 100


def test_the_command_prints_the_table_and_json_lines(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "hop_report.py"), "ci", _file(tmp_path, 0.97, 40), "--boot", "2000"],
                         capture_output=True, text=True, check=True).stdout
    assert "| 16 | b | 40 | 0.97" in out
    rows = [json.loads(line)["ci"] for line in out.splitlines() if line.startswith('{"ci"')]
    assert len(rows) == 1 and rows[0]["hi"] < 1.0


def test_the_rounds_table_reads_a_sweep_of_many_blocks(tmp_path, capsys):
    """A sweep's 30 blocks are shown as 6 merged ones: each keeps a tok/s (the H100 sweep of session 12
    failed here with a KeyError, a merged block having only its p50s)."""
    path = _file(tmp_path, 0.97, 30)
    for lv in (data := json.loads(Path(path).read_text()))["levels"]:
        lv["summary"] = {t: {"output_tok_s": 1.0, "ttft_ms": {"p50": 20.0}, "itl_ms": {"p50": 2.0}} for t in ("b", "c")}
        lv["ratios"] = {"b": {"tok_s_ratio": 0.97, "ttft_p50_delta_ms": 1.5, "itl_p50_delta_ms": 0.1}}
    Path(path).write_text(json.dumps(data))
    hop_report.rounds(path)
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 16 | ")]
    merged = [r for r in rows if r[1].isdigit()]
    assert len(merged) == 6
    assert all(0.9 < float(r[5]) < 1.05 for r in merged)  # each block's own tok/s ratio


def test_a_lease_chain_runs_its_commands_in_turn_and_each_wait_brings_back_what_they_wrote(tmp_path):
    """``benchmarks/chain.sh``: the commands run one after another in the background, each into its own
    ``$OUT``, with its exit status recorded; a wait that ends before the chain brings back what is written so far
    (exit 3), the last one everything (exit 0). Session 15 lost three GPU phases with a machine given back."""
    import shutil
    import tarfile
    import time
    import uuid

    name, out = f"t{uuid.uuid4().hex[:8]}", tmp_path / "out"
    gate = tmp_path / "gate"
    sh = str(BENCH / "chain.sh")
    started = subprocess.run([sh, "start", name, "echo one > $OUT/a", f"while [ ! -e {gate} ]; do sleep 0.05; done; false",
                              'X="two words" bash -c "echo \\$X > \\$OUT/x"'], capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    chain_txt = Path(f"/tmp/chain/{name}/chain.txt")
    deadline = time.monotonic() + 120
    while "1 exit" not in chain_txt.read_text() and time.monotonic() < deadline:  # the event: the first command ended
        time.sleep(0.05)
    early = subprocess.run([sh, "wait", name, "0"], capture_output=True, text=True, timeout=60, env={"OUT": str(out), "PATH": "/usr/bin:/bin"})
    assert early.returncode == 3  # the second command waits for the gate: the chain runs on
    with tarfile.open(out / f"{name}.tar.gz") as t:
        assert f"{name}/1/a" in t.getnames()
    gate.touch()
    done = subprocess.run([sh, "wait", name, "120"], capture_output=True, text=True, timeout=180, env={"OUT": str(out), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout
    assert "1 exit 0" in done.stdout and "2 exit 1" in done.stdout and "3 exit 0" in done.stdout, done.stdout
    with tarfile.open(out / f"{name}.tar.gz") as t:
        assert t.extractfile(f"{name}/3/x").read() == b"two words\n"
        assert t.extractfile(f"{name}/1/a").read() == b"one\n"
    shutil.rmtree(f"/tmp/chain/{name}")
