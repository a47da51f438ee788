"""What proves mm-parallel's features without an Ascend cluster; never imported by production code.

- ``equivalence``: the harness that runs one step under many layouts on one launch and compares
  each with the single-process run (loss, gathered gradients, parameters).
- ``ascend_kernels`` and ``hccl``: stand-ins of MindSpore's Ascend kernels and HCCL collectives
  that enforce each documented restriction; ``device_path.ascend_stand_ins()`` installs them;
  ``host_transfers`` counts the reads and uploads a step makes.

Starting processes (msrun, the worker pool, `run_distributed`) is `mm_parallel.launch`'s.
"""
