"""Which calls of the Triton ops may skip the dispatcher.

The kernels are ``torch.library`` custom ops (``gemray::gdpa_fwd`` / ``gdpa_bwd``, ``gemray::norm_quant_fwd`` /
``norm_quant_bwd``) with fake implementations and registered autograd formulas, which torch.compile, export and
FakeTensor / meta tracing need. Calling a Python custom op also costs the dispatcher's round trip through Python
(argument defaults filled from the schema, the autograd wrapper, the backend redispatch): 100-200 us more per
attention fwd+bwd than an ``autograd.Function`` over the same launches, measured on the 2-core CI machine, where a
short heavy-tailed batch's whole fwd+bwd takes ~150 us of host work (the kernel run reports (benchmarks/reports/kernels_h200_*.md) "Runs 39-41": that batch is
host-bound). So a plain eager call runs the ops' implementation behind an autograd.Function, and everything that
traces goes through the ops; both run the same implementation functions (tests compare them bitwise).

A Python ``TorchDispatchMode`` on the dispatch stack -- selective activation checkpointing's caching and cached
modes (``torch.utils.checkpoint.create_selective_checkpoint_contexts``), a ``FlopCounterMode``, an op census --
sees only what goes through the dispatcher: the autograd.Function's launches would be invisible to it (SAC could
neither save nor replay the attention's output), so such calls take the ops too -- except under a mode whose class
sets ``observes_eager_path = True``: one that only watches what the eager path runs (``gemray bench kernels
--host-profile``'s aten-op census, which measures that path's host cost).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain_eager(*tensors) -> bool:
    """True when a call may take the eager autograd.Function instead of the custom ops: not under torch.compile /
    export (dynamo), no FakeTensor / proxy (make_fx) / functionalization mode and no other Python dispatch mode
    active but those marked ``observes_eager_path`` (module docstring), and every given tensor (None entries skipped) a plain tensor or Parameter not on
    the meta device. Anything else -- FakeTensor, FunctionalTensor, DTensor or other subclasses, meta tensors,
    those modes -- takes the ops."""
    if torch.compiler.is_compiling():
        return False
    # the stack's length counts the infra modes (FakeTensor, proxy, functional) as well as the Python ones
    if torch._C._len_torch_dispatch_stack() and not all(
            getattr(m, "observes_eager_path", False) for m in _get_current_dispatch_mode_stack()):
        return False
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TYPES or t.is_meta):
            return False
    return True
