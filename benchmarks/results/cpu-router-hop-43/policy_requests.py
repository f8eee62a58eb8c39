# two recording workers behind vllm-router --policy P: which requests reach the workers for N chats (issue 43;
# run from a scratch folder: .venv/bin/python policy_requests.py cache_aware; it writes w.py and w*.log there)
import json, os, subprocess, sys, time, urllib.request, socket
from aiohttp import web
policy = sys.argv[1]
def free():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
W = """
import asyncio, json, sys
from aiohttp import web
async def any_(r):
    b = await r.read()
    print(r.method, r.path, flush=True)
    if r.path == "/health": return web.Response()
    if r.path == "/v1/models": return web.json_response({"object":"list","data":[{"id":"m","object":"model"}]})
    if r.path.endswith("/render"): return web.json_response({"request_id": "x", "token_ids": [1, 2, 3], "prompt": "hi"})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"}); await resp.prepare(r)
    await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\\n\\n'); await resp.write(b"data: [DONE]\\n\\n"); return resp
app = web.Application(); app.router.add_route("*", "/{tail:.*}", any_)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""
open("w.py", "w").write(W)
ports = [free(), free()]
ws = [subprocess.Popen([sys.executable, "w.py", str(p)], stdout=open(f"w{p}.log", "w")) for p in ports]
rp, pp = free(), free()
r = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "vllm-router"), "--host", "127.0.0.1", "--port", str(rp), "--prometheus-port", str(pp),
                      "--policy", policy, "--worker-urls", *[f"http://127.0.0.1:{p}" for p in ports]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(6)
before = {p: len(open(f"w{p}.log").readlines()) for p in ports}  # the start-up's requests not counted
N = 4
for i in range(N):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"hello {i}"}], "stream": True, "max_tokens": 4}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{rp}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})) as resp:
        resp.read()
time.sleep(0.5)
from collections import Counter
c = Counter()
for p in ports:
    c.update(l.strip() for l in open(f"w{p}.log").readlines()[before[p]:] if "/health" not in l)
print(policy, f"{N} chats ->", dict(c))
r.terminate(); [w.terminate() for w in ws]
