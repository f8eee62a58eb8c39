"""cProfile a single vllama (--workers 1) under c lockstep streams of the stand-in: Python calls and profiled µs per token.

As token_cpu.py sets it up (FAKE_VLLM_LOCKSTEP, 5 ms a step, 128 tokens, vllama on the last CPU), vllama started with
c1_profile.py's cProfile launcher (SIGUSR1 on, SIGUSR2 dump), 4c requests of warm-up, then REQUESTS profiled:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/results/cpu-mwtoken14/token_calls.py CODE C ROUTE REQUESTS OUT.prof

CODE: the folder holding the vllama_proxy/ to run (this checkout, or /tmp/old). Calls per token are deterministic
where µs are not: the number this VM can compare builds by.
"""
import asyncio, os, signal, subprocess, sys, tempfile, time, pstats
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
import token_cpu as T, loadgen
from procs import Children, free_port, wait_http
import c1_profile

def main():
    code = Path(sys.argv[1]).resolve(); c = int(sys.argv[2]); route = sys.argv[3]; reqs = int(sys.argv[4]); out = sys.argv[5]
    proxy_cpus, other = T.pinning(True)
    os.sched_setaffinity(0, other)
    children = Children(); tmp = Path(tempfile.mkdtemp(prefix="mwt-cprof-"))
    env = {**os.environ, "FAKE_VLLM_TOKEN_DELAY": "0.005", "FAKE_VLLM_LOCKSTEP": "1", "FAKE_VLLM_LOG_MAX": "64"}
    fport = free_port()
    fake = children.start([sys.executable, str(ROOT / "tests" / "fake_vllm.py"), "serve", str(tmp / "fake-model"), "--host", "127.0.0.1",
                           "--port", str(fport), "--served-model-name", "fake-model", "--max-model-len", "100000"], env, tmp / "fake.log", other)
    wait_http(f"http://127.0.0.1:{fport}/health", fake)
    port = free_port()
    prof = tmp / "cprofile.out"
    launcher = c1_profile._CPROFILE.replace("OUT", str(prof))
    proc = subprocess.Popen([sys.executable, "-c", launcher, "serve", "--upstream", f"http://127.0.0.1:{fport}", "--port", str(port), "--workers", "1"],
                            env={**env, "PYTHONPATH": str(code)}, cwd=code, stdout=open(tmp / "v.log", "wb"), stderr=subprocess.STDOUT,
                            preexec_fn=lambda: os.sched_setaffinity(0, proxy_cpus), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/", proc, 60)
    async def go():
        wl = loadgen.Workload("fake-model", 128, 64, 0.0, True)
        prompts = loadgen.PromptFactory(64, 0)
        async with loadgen.make_session() as s:
            tgt = loadgen.Target("x", T.PROTOCOL[route], url)
            await loadgen.run_level(s, tgt, wl, prompts, c, 4 * c)
            proc.send_signal(signal.SIGUSR1); await asyncio.sleep(0.5)
            r = await loadgen.run_level(s, tgt, wl, prompts, c, reqs)
            await asyncio.sleep(0.3)
            proc.send_signal(signal.SIGUSR2)
            for _ in range(100):
                await asyncio.sleep(0.1)
                if prof.exists(): break
            await asyncio.sleep(0.5)
            return sum(x.output_tokens for x in r.results)
    try:
        toks = loadgen.run_loop(go(), True)
    finally:
        proc.terminate(); proc.wait(10); children.stop_all()
    st = pstats.Stats(str(prof))
    calls = sum(v[1] for v in st.stats.values()); tt = sum(v[2] for v in st.stats.values())
    print(f"{code} c={c} {route}: {reqs} requests, {toks} tokens: {calls / toks:.1f} calls/token, {tt / toks * 1e6:.1f} µs/token profiled")
    st.dump_stats(out)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][1])[:45]
    for (f, l, fn), v in rows:
        print(f"{v[1] / toks:7.3f} calls {v[2] / toks * 1e6:6.2f} µs own  {fn} ({f.split('site-packages/')[-1].split('vllama_proxy/')[-1]}:{l})")
main()
