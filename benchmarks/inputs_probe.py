"""What one embeddings request of many inputs does to another key's one-input request (``--max-inputs``).

Against a vLLM (or vllama) serving an embedding model at ``--url``: a lone one-input ``/v1/embeddings``
request's latency (median of ``--lone`` runs); then one request of ``--inputs`` inputs of ``--words``
words each (``--concurrent`` of them at once), and, ``--delay`` seconds after they were sent, a one-input
request: its latency beside the big ones, and the last big one's. Prints one JSON line per size.

    python benchmarks/inputs_probe.py --url http://127.0.0.1:8000 --model emb --inputs 2048 8192

Through vllama, give ``--key`` (a user key's, so that ``--max-inputs`` applies) and ``--other-key``
(another key's, for the one-input request).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import statistics
import time

import httpx


def _embed(url: str, model: str, inputs: list[str], key: str | None) -> tuple[float, int]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/embeddings", json={"model": model, "input": inputs}, headers=headers, timeout=3600)
    return time.perf_counter() - t0, r.status_code


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--inputs", type=int, nargs="+", default=[2048])
    ap.add_argument("--words", type=int, default=32)
    ap.add_argument("--lone", type=int, default=5)
    ap.add_argument("--delay", type=float, default=0.2)
    ap.add_argument("--concurrent", type=int, default=1)
    ap.add_argument("--key")
    ap.add_argument("--other-key")
    a = ap.parse_args()
    text = " ".join(f"w{i}" for i in range(a.words))
    _embed(a.url, a.model, [text], a.other_key)  # warm
    lone = statistics.median(_embed(a.url, a.model, [text], a.other_key)[0] for _ in range(a.lone))
    for n in a.inputs:
        with cf.ThreadPoolExecutor(a.concurrent + 1) as ex:
            bigs = [ex.submit(_embed, a.url, a.model, [f"{j} {i} {text}" for i in range(n)], a.key) for j in range(a.concurrent)]
            time.sleep(a.delay)
            small = ex.submit(_embed, a.url, a.model, [text], a.other_key)
            done = [b.result() for b in bigs]
            small_s, small_status = small.result()
        print(json.dumps({"inputs": n, "concurrent": a.concurrent, "words": a.words, "lone_s": round(lone, 4),
                          "beside_big_s": round(small_s, 4), "beside_big_x": round(small_s / lone, 1),
                          "big_s": round(max(s for s, _ in done), 3),
                          "status": [*sorted({st for _, st in done}), small_status]}), flush=True)


if __name__ == "__main__":
    main()
