"""What running a coroutine in a task of its own adds per request on uvloop: ``await coro`` against
``await loop.create_task(coro)`` for a coroutine that suspends once (relay.in_own_task, issue 42)."""
import asyncio, time, uvloop
async def body(loop):
    f = loop.create_future(); loop.call_soon(f.set_result, None); await f
    return 1
async def main():
    loop = asyncio.get_running_loop(); N = 50_000
    for rep in range(3):
        t = time.thread_time()
        for _ in range(N): await body(loop)
        a = (time.thread_time() - t) / N * 1e6
        t = time.thread_time()
        for _ in range(N): await loop.create_task(body(loop))
        b = (time.thread_time() - t) / N * 1e6
        print(f"await coro {a:.2f} µs, await task(coro) {b:.2f} µs: +{b - a:.2f} µs per request")
uvloop.run(main())
