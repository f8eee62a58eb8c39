#!/usr/bin/env bash
# Early diagnostic for issue 38: where does a light request's 0.85 s go under a 1,000-stream flood?
# usage: ASC=1|4 diag38.sh vllm | probe | stopvllm
set -u
export PATH=/tmp/site/bin:$PATH PYTHONPATH=$PWD:/tmp/vsite:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 VLLAMA_STATE_DIR=/tmp/gpu-logs/state
D=/tmp/diag; mkdir -p $D; PV=8100; ASC=${ASC:-1}
ulimit -n "$(ulimit -Hn)"
for phase in "$@"; do case $phase in
vllm)
  setsid vllm serve /tmp/model --served-model-name qwen-random --port $PV --max-model-len 4096 --gpu-memory-utilization 0.85 \
    --max-num-seqs 256 --scheduling-policy priority --api-server-count $ASC > $D/vllm-asc$ASC.log 2>&1 < /dev/null &
  echo $! > $D/vllm.pid
  for _ in $(seq 600); do curl -sf http://127.0.0.1:$PV/health >/dev/null && break; sleep 0.5; done
  echo "vLLM asc=$ASC ready at $(date -u +%T)"; curl -sf http://127.0.0.1:$PV/health >/dev/null || tail -20 $D/vllm-asc$ASC.log ;;
stopvllm)
  kill -TERM -- -$(cat $D/vllm.pid) 2>/dev/null; for _ in $(seq 60); do pgrep -f '^VLLM::|bin/vllm serve' >/dev/null || break; sleep 1; done
  pkill -9 -f '^VLLM::' ; sleep 2; nvidia-smi --query-gpu=memory.used --format=csv,noheader ;;
probe)
  python3 - <<'PY' > $D/probe-asc$ASC.txt 2>&1 &
import asyncio, time, json, os, statistics, psutil, aiohttp
ASC=os.environ.get("ASC","1")
async def light(s, pri):
    body={"model":"qwen-random","prompt":"hello there "+str(time.time()),"max_tokens":8,"stream":True,"priority":pri,"ignore_eos":True}
    t0=time.perf_counter()
    async with s.post("http://127.0.0.1:8100/v1/completions",json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {"): return time.perf_counter()-t0
async def cpu_sampler(stop, out):
    procs={}
    while not stop.is_set():
        for p in psutil.process_iter(["pid","cmdline","name"]):
            c=" ".join(p.info["cmdline"] or [])
            if "VLLM" in c or "vllm serve" in c or "vllama_proxy" in c or "fairness.py" in c:
                procs.setdefault(p.pid,(p,c[:60]))
        await asyncio.sleep(1)
        for pid,(p,c) in list(procs.items()):
            try: out.setdefault(c+f" [{pid}]",[]).append(p.cpu_percent())
            except Exception: pass
async def metrics(s):
    async with s.get("http://127.0.0.1:8100/metrics") as r: t=await r.text()
    keep={}
    for l in t.splitlines():
        if l.startswith(("vllm:num_requests_running","vllm:num_requests_waiting","vllm:time_to_first_token_seconds_sum","vllm:time_to_first_token_seconds_count","vllm:request_queue_time_seconds_sum","vllm:request_queue_time_seconds_count")):
            n,v=l.rsplit(" ",1); keep[n.split("{")[0]]=keep.get(n.split("{")[0],0)+float(v)
    return keep
async def main():
    await asyncio.sleep(15)  # flood warm-up
    stop=asyncio.Event(); cpu={}
    async with aiohttp.ClientSession() as s:
        m0=await metrics(s); samp=asyncio.create_task(cpu_sampler(stop,cpu))
        res={}
        for pri in (-1000000000,0):
            ts=[]
            for _ in range(10): ts.append(await light(s,pri))
            res[pri]=ts
        m1=await metrics(s); stop.set(); await samp
    print(json.dumps({"asc":ASC,"direct_light_ttft_s":{str(k):[round(x,3) for x in v] for k,v in res.items()},
        "p50":{str(k):statistics.median(v) for k,v in res.items()},
        "metrics_before":m0,"metrics_after":m1,
        "ttft_mean_during":(m1.get("vllm:time_to_first_token_seconds_sum",0)-m0.get("vllm:time_to_first_token_seconds_sum",0))/max(1,m1.get("vllm:time_to_first_token_seconds_count",0)-m0.get("vllm:time_to_first_token_seconds_count",0)),
        "queue_mean_during":(m1.get("vllm:request_queue_time_seconds_sum",0)-m0.get("vllm:request_queue_time_seconds_sum",0))/max(1,m1.get("vllm:request_queue_time_seconds_count",0)-m0.get("vllm:request_queue_time_seconds_count",0)),
        "cpu_pct_median":{k:statistics.median(v) for k,v in cpu.items() if v}},indent=1))
asyncio.run(main())
PY
  probe=$!
  OUT=$D/fair-asc$ASC ROUND=$ASC LOGS=/tmp/gpu-logs HEAVY=1000 DURATION=40 WARMUP=10 bash benchmarks/fairness.sh on flood
  wait $probe; cat $D/probe-asc$ASC.txt ;;
esac; done
