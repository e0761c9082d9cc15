"""``%probe`` / ``superkernel probe``: what the hardware offers between ranks, measured.

* :mod:`~superkernel.probe.hardware`: hosts, NUMA nodes, GPUs and peer links, RDMA and CXL devices (no torch).
* :mod:`~superkernel.probe.measure`: OSU-style latency/bandwidth per provider, one-sided put/get, allreduce.
* :mod:`~superkernel.probe.run`: ``run_probe(group)`` (collective) -> :class:`ProbeReport` on rank 0.
* :mod:`~superkernel.probe.verdict` (tables), :mod:`~superkernel.probe.plot` (PNG),
  :mod:`~superkernel.probe.command` (the CLI), :mod:`~superkernel.probe.job` (which launcher we run under).

Importing this package does not import torch.
"""
