"""Supervision of the ``vllm serve`` child: states, process tree, probes, GPU, the owner loop."""
