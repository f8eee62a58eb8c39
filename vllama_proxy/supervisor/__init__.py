"""Supervision of the ``vllm serve`` child: states, process tree, probes, GPU, the owner loop; the status
board and lock every process shares; how the host's CPUs are split (``sizing``, ``placement``)."""
