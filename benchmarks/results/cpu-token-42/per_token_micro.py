# vllama's own Python per streamed token, in-process: PYTHONPATH=$PWD .venv/bin/python benchmarks/results/cpu-token-42/per_token_micro.py
import time, orjson, sys
from vllama_proxy.upstream import SSEDecoder
from vllama_proxy.api.translate.to_ollama import ChatTranslator, GenerateTranslator
from vllama_proxy.api.timestamps import Timings, CLOCK
ev = b'data: ' + orjson.dumps({"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":"chat.completion.chunk","created":1764000000,"model":"fake-model","choices":[{"index":0,"delta":{"content":"tok5 "},"logprobs":None,"finish_reason":None,"token_ids":None}]}) + b'\n\n'
N=200000
def run(label, f):
    t=time.perf_counter(); 
    for _ in range(N): f()
    print(f"{label}: {(time.perf_counter()-t)/N*1e6:.2f} us")
d=SSEDecoder(); run("decode", lambda: d.feed(ev))
tr=ChatTranslator("m", Timings(time.perf_counter_ns()), aggregate=False)
ch=d.feed(ev)[0]
run("feed", lambda: tr.feed(ch))
item=tr.feed(ch)[0]
run("dumps+nl", lambda: orjson.dumps(item)+b"\n")
run("dumps APPEND_NL", lambda: orjson.dumps(item, option=orjson.OPT_APPEND_NEWLINE))
run("clock", CLOCK.now)
dumps=orjson.dumps; feed=tr.feed; dec=d.feed
def whole():
    lines=[dumps(x) for c in dec(ev) for x in feed(c)]
    if lines: b = b"\n".join(lines)+b"\n" if len(lines)>1 else lines[0]+b"\n"
run("whole loop body", whole)
