import json, glob, bisect, statistics
for name in ("old", "new"):
    d = json.load(open(glob.glob(f"pr/state-{name}.*.json")[0]))
    W, L = d["writes"], d["lags"]
    rows = sum(w[2] for w in W)
    walls = sorted(1000 * (w[1] - w[0]) for w in W)
    starts = [w[0] for w in W]
    inside = [lag for t, lag in L if (i := bisect.bisect_right(starts, t) - 1) >= 0 and t <= W[i][1] + 0.005]
    lags = sorted(x for _, x in L)
    print(f"{name}: {len(W)} writes, {rows} rows ({rows/len(W):.0f} a write), write wall median {statistics.median(walls):.2f} ms max {walls[-1]:.2f} ms, "
          f"writer CPU {1e6*sum(w[3] for w in W)/rows:.1f} us a row; loop lag samples (1 ms sleeps) {len(L)}: median {1000*statistics.median(lags):.2f} ms, "
          f"p99 {1000*lags[int(.99*len(lags))]:.1f} ms; samples within a write (+5 ms) {len(inside)}, their max {1000*max(inside or [0]):.2f} ms")
