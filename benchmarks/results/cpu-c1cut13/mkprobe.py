"""Copy a vllama_proxy tree into DEST with wall-clock marks on a lone request's path (never committed)."""
import re, shutil, sys
from pathlib import Path
src, dest = Path(sys.argv[1]), Path(sys.argv[2])
if dest.exists(): shutil.rmtree(dest)
shutil.copytree(src / "vllama_proxy", dest / "vllama_proxy")
P = dest / "vllama_proxy"
(P / "_probe.py").write_text('''
import os, time, atexit
M = {}
_f = open(os.environ.get("PROBE_OUT", "/tmp/probe.txt"), "a")
def mark(name):
    M[name] = time.perf_counter_ns()
def flush():
    if M:
        _f.write(" ".join(f"{k}={v}" for k, v in M.items()) + "\\n")
        M.clear()
atexit.register(_f.flush)
import aiohttp.web_protocol as _wp
_orig = _wp.RequestHandler.data_received
def _dr(self, data):
    M.clear(); mark("in")
    return _orig(self, data)
_wp.RequestHandler.data_received = _dr
''')
def edit(rel, pairs):
    f = P / rel; s = f.read_text()
    for old, new in pairs:
        assert old in s, (rel, old)
        s = s.replace(old, new, 1)
    f.write_text(s)
edit("api/app.py", [("    request[ACCEPTED] = time.perf_counter_ns()", "    from vllama_proxy import _probe; _probe.mark('accepted')\n    request[ACCEPTED] = time.perf_counter_ns()"),
                    ("        if request.app[SETTINGS].access_log:", "        _probe.mark('end_before_log')\n        if request.app[SETTINGS].access_log:")])
edit("api/app.py", [("                     key=api_keys.key_of(request).name, client=request.remote, **extra)\n", "                     key=api_keys.key_of(request).name, client=request.remote, **extra)\n        _probe.mark('logged'); _probe.flush()\n")])
s = (P / "api/admission.py").read_text()
s = s.replace("            return await handler(request)", "            from vllama_proxy import _probe; _probe.mark('admitted')\n            return await handler(request)")
(P / "api/admission.py").write_text(s)
gen = "api/routes/generate.py" 
edit(gen, [("    req = await read_request(request, GenerateRequest)", "    from vllama_proxy import _probe; _probe.mark('handler')\n    req = await read_request(request, GenerateRequest)\n    _probe.mark('parsed')"),
           ("    name, model, backend = await resolve_model(request, req.model)", "    name, model, backend = await resolve_model(request, req.model)\n    _probe.mark('resolved')"),
           ("    key = session.generate_key(served, req.system)", "    key = session.generate_key(served, req.system)\n    _probe.mark('translated')")])
edit("api/routes/chat.py", [])
edit("api/routes/answer.py", [("        async with model_in_use(request, backend, keep_alive):", "        from vllama_proxy import _probe; _probe.mark('placed')\n        async with model_in_use(request, backend, keep_alive):\n            _probe.mark('held')"),
                              ("            try:\n                return await relay(", "            _probe.mark('capped')\n            try:\n                return await relay(")])
edit("upstream.py", [("            return await session.request(method, url, **kwargs)", "            from vllama_proxy import _probe; _probe.mark('aiohttp_req')\n            return await session.request(method, url, **kwargs)"),
                     ("            resp = await self._send(", "            from vllama_proxy import _probe; _probe.mark('up_request')\n            resp = await self._send(")])
edit("api/relay.py", [("        t.headers = time.perf_counter_ns()", "        t.headers = time.perf_counter_ns()\n        from vllama_proxy import _probe; _probe.mark('headers')"),
                      ("                if not first_write and not t.first_read:\n                    t.first_read = time.perf_counter_ns()", "                if not first_write and not t.first_read:\n                    t.first_read = time.perf_counter_ns(); _probe.mark('first_read')"),
                      ("                    if out is None:\n                        out = await begin(request)", "                    if out is None:\n                        _probe.mark('translated1')\n                        out = await begin(request)\n                        _probe.mark('begun')"),
                      ("                        first_write = time.perf_counter_ns()\n", "                        first_write = time.perf_counter_ns(); _probe.mark('written1')\n"),
                      ("        await out.write_eof(last)", "        _probe.mark('last_ready')\n        await out.write_eof(last)\n        _probe.mark('eof')")])
# the socket write to vLLM: aiohttp client's transport write
import textwrap
(P / "_probe.py").write_text((P / "_probe.py").read_text() + textwrap.dedent('''
import aiohttp.http_writer as _hw
_ow = _hw.StreamWriter._writelines
def _wl(self, chunks):
    r = _ow(self, chunks)
    if "aiohttp_req" in M and "up_written" not in M:
        mark("up_written")
    return r
_hw.StreamWriter._writelines = _wl
_ow2 = _hw.StreamWriter._write
def _w2(self, chunk):
    r = _ow2(self, chunk)
    if "aiohttp_req" in M and "up_written" not in M:
        mark("up_written")
    return r
_hw.StreamWriter._write = _w2
'''))
print("ok")
