"""perf (or a plain CPU count) of one vllama (--workers 1) under c lockstep streams, token_cpu.py's set-up: CODE C ROUTE REQUESTS perf|plain; OUTP=perf.data path."""
import asyncio, os, subprocess, sys, tempfile, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
import token_cpu as T, loadgen
from procs import Children, free_port, wait_http

def main():
    code = Path(sys.argv[1]); c = int(sys.argv[2]); route = sys.argv[3]; reqs = int(sys.argv[4]); mode = sys.argv[5]
    args = T.parse_args(["--levels", str(c)])
    proxy_cpus, other = T.pinning(True)
    os.sched_setaffinity(0, other)
    children = Children(); tmp = Path(tempfile.mkdtemp(prefix="mwt-perf-"))
    env = {**os.environ, "FAKE_VLLM_TOKEN_DELAY": "0.005", "FAKE_VLLM_LOCKSTEP": "1", "FAKE_VLLM_LOG_MAX": "64"}
    fport = free_port()
    fake = children.start([sys.executable, str(ROOT / "tests" / "fake_vllm.py"), "serve", str(tmp / "fake-model"), "--host", "127.0.0.1",
                           "--port", str(fport), "--served-model-name", "fake-model", "--max-model-len", "100000"], env, tmp / "fake.log", other)
    wait_http(f"http://127.0.0.1:{fport}/health", fake)
    url, proc = T.start_vllama(code.resolve(), f"http://127.0.0.1:{fport}", args, env, tmp / "v.log", proxy_cpus, 1)
    import psutil
    pids = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    print("pids", pids, file=sys.stderr)
    async def go():
        wl = loadgen.Workload("fake-model", 128, 64, 0.0, True)
        prompts = loadgen.PromptFactory(64, 0)
        async with loadgen.make_session() as s:
            tgt = loadgen.Target("x", T.PROTOCOL[route], url)
            await loadgen.run_level(s, tgt, wl, prompts, c, 2 * c)
            p = None
            if mode == "perf":
                p = subprocess.Popen(["perf", "record", "-F", "2000", "-g", "-o", str(Path(os.environ.get("OUTP", "/tmp/mwt/perf.data"))), "-p", ",".join(map(str, pids))],
                                     stderr=subprocess.DEVNULL)
                await asyncio.sleep(1)
            before = T.cpu_seconds(psutil.Process(proc.pid))
            r = await loadgen.run_level(s, tgt, wl, prompts, c, reqs)
            cpu = T.cpu_seconds(psutil.Process(proc.pid)) - before
            toks = sum(x.output_tokens for x in r.results)
            print(f"{cpu*1e6/toks:.1f} us/token, {toks} tokens, {toks/r.wall:.0f} tok/s", file=sys.stderr)
            if p: p.send_signal(2); p.wait()
    try:
        loadgen.run_loop(go(), True)
    finally:
        proc.terminate(); proc.wait(10); children.stop_all()
main()
