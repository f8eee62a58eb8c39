import gc, os, sys, time
_t = [0.0]
def _cb(phase, info):
    if info.get("generation") != 2:
        return
    if phase == "start":
        _t[0] = time.perf_counter()
    else:
        sys.stderr.write(f"GC2 pid={os.getpid()} ms={(time.perf_counter() - _t[0]) * 1000:.2f} collected={info.get('collected')} objs={len(gc.get_objects(2)) if False else -1} t={time.time():.3f}\n")
        sys.stderr.flush()
gc.callbacks.append(_cb)
