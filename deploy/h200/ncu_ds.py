"""Workload for Nsight Compute on the DS_STORE backward: ``python3 ncu_ds.py KIND B N`` runs 3 causal softmax fwd+bwd
steps of a bench batch (bf16, H=4, D=128) with the default tiles and modes; profile it with e.g.
``ncu --clock-control none -k regex:_gdpa_dq_ds --launch-skip 2 --launch-count 1 --section SpeedOfLight ...``.
Layout as deploy/h200/kernels_bench.sh builds it (``gemray`` importable)."""

from __future__ import annotations

import sys

import torch

from gemray.kernels import bench
from gemray.kernels import jagged_attention as ja

kind, b, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
lengths, off, q, k, v = bench.batch_inputs(kind, b, n)
do = torch.randn_like(q)
for _ in range(3):
    ja.jagged_attention_triton(q, k, v, off, n, activation="softmax").backward(do)
torch.cuda.synchronize()
print("regime", ja.regime(q.shape[0], b), "DS_STORE", ja.DS_STORE, "tokens", q.shape[0])
