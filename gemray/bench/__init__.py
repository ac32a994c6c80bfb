"""Benchmarks and lab tooling, kept out of the kernel package (gemray.kernels holds kernels only).

- ``gemray.bench.kernels``: ``gemray bench kernels`` -- correctness and speed of the jagged attention kernels and
  their PyTorch baselines on one CUDA device, the per-regime tile / launch-mode sweep (it builds
  ``gemray.kernels.config.KernelConfig`` values), and ``--host-profile`` (CPU: launches and host time of one
  fwd+bwd with the launches stubbed).
- ``gemray.bench.norm_quant``: the fused norm + FP8 quantize kernel against unfused PyTorch.
- ``gemray.bench.train``: ``gemray bench train`` -- real training steps of a config in one process (the Trainer's
  phases, world size 1): step time, tokens/s, model TFLOP/s, local MFU, peak memory, data stall, compile stalls,
  and with ``--profile`` the step's device time by category.
- ``gemray.bench.sass_check``: compile-only sm_90 SASS checks of kernel variants (registers, spills, wgmma), no GPU.
"""
