"""aiohttp 3.14: what protocol.resume_reading() costs on a client connection whose reading was never paused
(StreamReader._read_nowait_chunk calls it on every read; issue 42). Hot loop, uvloop, thread CPU per call."""
import asyncio, time, uvloop, aiohttp
from aiohttp import web
async def main():
    async def h(req):
        r = web.StreamResponse(); await r.prepare(req)
        await r.write(b"data: x\n\n"); await asyncio.sleep(2); await r.write_eof(); return r
    app = web.Application(); app.router.add_get("/", h)
    runner = web.AppRunner(app); await runner.setup(); site = web.TCPSite(runner, "127.0.0.1", 18765); await site.start()
    async with aiohttp.ClientSession() as s:
        async with s.get("http://127.0.0.1:18765/") as resp:
            await resp.content.readany()
            p = resp.content._protocol
            N = 200_000
            t = time.thread_time()
            for _ in range(N):
                p.resume_reading()
            print(f"protocol.resume_reading() not paused: {(time.thread_time() - t) / N * 1e9:.0f} ns")
    await runner.cleanup()
uvloop.run(main())
