"""Cross-process primitives every other part stands on: the lock of the shared counters, the bells that wake another process's loop, the spawn context of shared arrays."""
