import os
if os.environ.get("LEDGER_PROBE"):
    import asyncio, atexit, json, time
    from vllama_proxy.api import ledger as L, ledger_store as S
    writes, lags = [], []
    _w = S.Store.write
    def write(self, rows):
        t0 = time.perf_counter(); c0 = time.thread_time()
        try: return _w(self, rows)
        finally: writes.append((t0, time.perf_counter(), len(rows), time.thread_time() - c0))
    S.Store.write = write
    _start = L.Ledger.start
    async def monitor():
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append((t, time.perf_counter() - t - 0.001))
    async def start(self):
        await _start(self)
        self._probe = asyncio.create_task(monitor())
    L.Ledger.start = start
    def dump():
        with open(os.environ["LEDGER_PROBE"] + f".{os.getpid()}.json", "w") as f:
            json.dump({"writes": writes, "lags": lags}, f)
    atexit.register(dump)
