"""Python calls (and cProfile's µs) per token by package, from token_calls.py's dumps: PROF TOKENS [PROF TOKENS ...]."""
import pstats, sys, collections
for path, toks in zip(sys.argv[1::2], sys.argv[2::2]):
    toks = int(toks)
    st = pstats.Stats(path)
    g = collections.Counter(); gt = collections.Counter()
    for (f, l, fn), v in st.stats.items():
        if "vllama_proxy" in f: k = "vllama"
        elif "aiohttp" in f: k = "aiohttp"
        elif "asyncio" in f: k = "asyncio"
        elif f == "~": k = "builtins/C"
        else: k = "other"
        g[k] += v[1]; gt[k] += v[2]
    tot = sum(g.values())
    print(path, f"{tot/toks:.1f} calls/token:", {k: round(n / toks, 1) for k, n in g.most_common()}, "| profiled µs/token:", {k: round(n / toks * 1e6, 1) for k, n in gt.most_common()})
