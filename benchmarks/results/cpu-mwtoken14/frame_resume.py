"""What one more coroutine frame costs each time a suspended chain is resumed (issue 42, item 1; uvloop).

S streams (tasks), each a chain of `depth` coroutine frames over a future, as a handler awaits through
aiohttp's request task, its middlewares and the route; every "step" resolves one future per stream
(vLLM's engine step: every stream's token at once) and the loop resumes each chain. Thread CPU per
resume, the best of 3, for depth 0, 6 and 13; the difference over depth is one frame's cost.

    .venv/bin/python benchmarks/results/cpu-mwtoken14/frame_resume.py 16
"""
import asyncio
import sys
import time

import uvloop

STEPS = 3000


async def leaf(q):
    loop = asyncio.get_running_loop()
    while True:
        f = loop.create_future()
        q.append(f)
        if await f:
            return


async def wrap(depth, q):
    x = depth  # a few locals and a try/finally, as a middleware holds
    y = {"a": 1}
    try:
        if depth == 0:
            return await leaf(q)
        return await wrap(depth - 1, q)
    finally:
        y["a"] = x


async def main():
    s = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    loop = asyncio.get_running_loop()
    res = {}
    for _ in range(3):
        for d in (0, 6, 13):
            qs = [[] for _ in range(s)]
            tasks = [loop.create_task(wrap(d, q)) for q in qs]
            await asyncio.sleep(0)
            t = time.thread_time()
            for step in range(STEPS):
                last = step == STEPS - 1
                for q in qs:
                    q.pop().set_result(last)
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            el = time.thread_time() - t
            await asyncio.gather(*tasks)
            res.setdefault(d, []).append(el / (STEPS * s) * 1e6)
    base = min(res[0])
    for d, v in res.items():
        print(f"S={s} depth {d}: {min(v):.3f} µs/resume ({(min(v) - base) / max(d, 1) * 1000:.0f} ns/frame)", [round(x, 3) for x in v])


uvloop.run(main())
