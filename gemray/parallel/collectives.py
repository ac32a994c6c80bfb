"""``parallel.collectives``: how the FSDP all-gather / reduce-scatter use the GPU.

What the stack offers (torch 2.11+ with NCCL >= 2.28, read from their documentation and source):

- "nccl" (default): NCCL's collective kernels, which occupy SMs (CTAs) while they run, beside compute.
- "symmetric_memory": FSDP2 allocates its all-gather staging buffers in NCCL symmetric memory
  (``FSDPModule.set_symm_mem_for_comm("NCCL")``: buffers from ``torch.distributed._symmetric_memory``'s NCCL
  backend, registered as symmetric NCCL windows, ``NCCL_WIN_COLL_SYMMETRIC``), so NCCL can run its
  symmetric-memory all-gather kernels (fewer CTAs and no staging copies). NVLink multicast (NVLS) stays
  off: ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` are set when not already set
  (never turned on here).
- "copy_engine": the same buffers, and every NCCL communicator created with the zero-CTA policy
  (``NCCL_CTA_POLICY=2``, ``NCCL_CTA_POLICY_ZERO`` of NCCL 2.28's ``ncclConfig_t.CTAPolicy``: "use zero CTA
  whenever it can, even when that may sacrifice some performance"): on one node NCCL then runs the
  all-gather on the GPU's copy engines (DMA), no SM at all (PyTorch's "Copy Engine Collectives",
  docs.pytorch.org/docs/2.11/symmetric_memory.html). A reduce-scatter has to add, which copy engines
  cannot: it keeps SM kernels (with the fewest CTAs NCCL can use). The policy applies to every
  communicator of the job (TorchRec's all-to-alls and the experts' too), since it is read from the
  environment when each communicator is created.

Effect on exposed communication: measured by ``gemray bench train`` (``exposed_communication``) in the
scaling runs, not asserted here. Everything but "nccl" needs CUDA and NCCL; on gloo / CPU it is refused
(``gemray.config`` refuses it before Ray starts; :func:`check_collectives` here names the backend).
The environment must be in place before the first NCCL communicator exists: the controller passes
:func:`collectives_env` to the Ray job's workers (``runtime_env``), and :func:`apply_collectives_env`
sets what is missing in a worker that starts without it (e.g. ``gemray bench train``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

from torch import nn

log = logging.getLogger(__name__)

COLLECTIVES = ("nccl", "copy_engine", "symmetric_memory")
# NVLink multicast off (the shared H200 hosts: device/KINDS.md); kept whenever symmetric memory is in use
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def check_collectives(choice: str, backend: str) -> None:
    """Raise ValueError for an unknown choice, or one other than "nccl" on a backend other than NCCL."""
    if choice not in COLLECTIVES:
        raise ValueError(f"parallel.collectives: expected one of {COLLECTIVES}, got {choice!r}")
    if choice != "nccl" and backend != "nccl":
        raise ValueError(f"parallel.collectives={choice!r} needs NCCL on CUDA GPUs (copy-engine / symmetric-memory "
                         f"collectives are NCCL features); this job's process group is {backend!r}: use "
                         f"parallel.collectives='nccl'")


def collectives_env(choice: str) -> dict[str, str]:
    """Pure: the environment the choice needs in every worker before NCCL starts (module docstring)."""
    if choice == "copy_engine":
        return {"NCCL_CTA_POLICY": "2", **NO_MULTICAST}
    if choice == "symmetric_memory":
        return dict(NO_MULTICAST)
    return {}


def apply_collectives_env(choice: str, environ: "os._Environ | dict[str, str] | None" = None) -> dict[str, str]:
    """Set the variables of :func:`collectives_env` that ``environ`` (default ``os.environ``) lacks; an
    explicit setting wins (a conflicting one is logged as a WARNING). Returns what was set."""
    environ = os.environ if environ is None else environ
    done = {}
    for k, v in collectives_env(choice).items():
        if k not in environ:
            environ[k] = v
            done[k] = v
        elif environ[k] != v:
            log.warning("parallel.collectives=%r wants %s=%s but the environment has %s=%s (kept)", choice, k, v,
                        k, environ[k])
    return done


def configure_fsdp_units(units: Iterable[nn.Module], choice: str) -> int:
    """FSDP2 units (``FSDPModule``s): with "symmetric_memory" / "copy_engine", all-gather buffers in NCCL
    symmetric memory (``set_symm_mem_for_comm("NCCL")``). Returns the units configured. Raises ValueError
    when this torch's FSDP2 has no ``set_symm_mem_for_comm`` (older than the feature)."""
    if choice == "nccl":
        return 0
    n = 0
    for u in units:
        fn = getattr(u, "set_symm_mem_for_comm", None)
        if not callable(fn):
            import torch

            raise ValueError(f"parallel.collectives={choice!r}: torch {torch.__version__}'s FSDP2 has no "
                             f"set_symm_mem_for_comm (symmetric-memory staging buffers); use 'nccl'")
        fn("NCCL")
        n += 1
    return n


def describe(choice: str, environ: Mapping[str, str] | None = None) -> str:
    """One log line: the choice and the NCCL variables in effect."""
    environ = os.environ if environ is None else environ
    keys = ("NCCL_CTA_POLICY", *NO_MULTICAST)
    return f"collectives {choice} (" + ", ".join(f"{k}={environ.get(k, '<unset>')}" for k in keys) + ")"
