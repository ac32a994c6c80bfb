"""torch.compile of the dense per-token modules: each HSTU block, the encoder's input scaling and output norm
(``HSTUEncoder.input_scale`` / ``output_norm``), the retrieval head (``GEM.head``, with the states' projection
``retrieval_proj`` traced into it) and the candidate tower, one by one.

Why per module (torchtitan's per-block compile, ``torchtitan/models/llama3/infra/parallelize.py``): the modules
between them (TorchRec's sharded embeddings, the KJT plumbing, the loss heads) are host-heavy and full of
data-dependent shapes; a block is pure dense math around one attention custom op (``gemray::gdpa_fwd`` /
``gdpa_bwd``, with fake implementations: no graph break), so its casts, LayerNorms, SiLUs, splits and the
residual fuse into a few Triton kernels and the launches per block drop. The retrieval head
(``gemray.model.heads.RetrievalHead``, no parameters) is float32 [T, E] / [B*R, E] normalisations, gathers and a dot
product around one custom op (``gemray::sampled_softmax_lse``; FBGEMM's jagged ops on the reference path): eager, it
and its backward were ~1-1.5 ms of small kernels per GEM-scale H200 step. It takes the host ints ``max_len`` /
``num_next``, which change every batch like T: automatic dynamic shapes make them symbolic on the second call too.

Shapes: the token count T (and B, C) changes every step. By default (``train.compile_dynamic = "auto"``) the
modules compile with dynamo's automatic dynamic shapes (``dynamic=None``): the first call specialises, the
second marks the sizes that changed (T, B, C) symbolic -- one more compile per module kind, then one graph per
kind instead of one per batch -- and everything else stays static. "all" (``dynamic=True``) makes every size
symbolic from the first call; under FSDP2 that includes the blocks' integer attributes (dynamo does not guard
FSDP modules), so inductor's kernels lose the widths they are specialised for. Parameters keep static shapes.

DDP (``parallel.dense = "ddp"``): the blocks compile inside DDP's forward, where dynamo's DDPOptimizer would cut
each graph at DDP's bucket boundaries (``train.compile_optimize_ddp``, default off: one graph per block).

Order: after ``gemray.parallel.parallelize`` (DDP / FSDP2 units are made per ``HSTUBlock`` first), in place:
``nn.Module.compile()`` compiles the module's ``_call_impl``, so state-dict keys do not change (a
``torch.compile(module)`` wrapper would add ``_orig_mod.`` and break resuming) and FSDP2's hooks stay on the
module (dynamo runs them eagerly). Activation checkpointing mode "torch" compiles the blocks through the same
function (:func:`compile_dense_modules`); calling it again is a no-op per module.
"""

from __future__ import annotations

import logging
from typing import Callable

from torch import nn

log = logging.getLogger(__name__)

#: the backends ``train.compile_backend`` accepts (torch._dynamo's registered names)
BACKENDS = ("inductor", "aot_eager", "eager")
#: ``train.compile_mode`` values (torch.compile's ``mode``; no CUDA graphs: the token count changes every step)
MODES = ("default", "max-autotune-no-cudagraphs")
#: ``train.compile_dynamic`` -> ``torch.compile``'s ``dynamic`` argument
DYNAMIC = {"auto": None, "all": True}
#: dynamo's per-code-object graph limit while modules are compiled here: every ``Module.compile()``d module runs
#: the one ``nn.Module._call_impl`` code object, so blocks, tower, their no-grad (evaluation) variants and the
#: sizes dynamo specialises (0 / 1) all count against one limit (default 8; past it dynamo silently runs eager)
RECOMPILE_LIMIT = 64


def _raise_recompile_limit() -> None:
    import torch._dynamo.config as dconfig

    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(dconfig, name) and getattr(dconfig, name) < RECOMPILE_LIMIT:
            setattr(dconfig, name, RECOMPILE_LIMIT)
            return


def compile_targets(model: nn.Module, *, tower: bool = True, head: bool = True) -> dict[str, nn.Module]:
    """{qualified name: module} of the modules :func:`compile_dense_modules` compiles: every ``HSTUBlock``, the
    encoder's ``InputScale`` / ``L2Norm`` (parameterless: [T, D] elementwise passes whose eager forward and backward
    were separate float32 kernels), with ``head`` every ``RetrievalHead`` (parameterless too; ``GEM`` passes it
    ``retrieval_proj``, so the states' projection and normalisation compile inside it: the head's eager float32
    [T, E] kernels were ~1-1.5 ms of the GEM-scale step) and, with ``tower``, every ``CandidateTower`` (FSDP2's
    class-swapped units included: they subclass them)."""
    from gemray.model.heads import RetrievalHead
    from gemray.model.hstu import HSTUBlock, InputScale, L2Norm
    from gemray.model.ranking import CandidateTower

    kinds = ((HSTUBlock, InputScale, L2Norm) + ((RetrievalHead,) if head else ())
             + ((CandidateTower,) if tower else ()))
    return {n: m for n, m in model.named_modules() if isinstance(m, kinds)}


def compile_dense_modules(model: nn.Module, *, backend: str | Callable = "inductor", tower: bool = True,
                          head: bool = True, dynamic: str = "auto", optimize_ddp: bool | None = None,
                          mode: str = "default", options: dict | None = None, reason: str = "train.compile"
                          ) -> list[str]:
    """``module.compile(backend=backend, dynamic=DYNAMIC[dynamic], mode=mode)`` on every :func:`compile_targets` module not
    compiled yet; returns the names compiled now (already-compiled ones are skipped, so the activation-checkpointing
    "torch" mode and ``train.compile`` share one compile). Logs the choice once per call that compiles anything.
    tower / head: as :func:`compile_targets` (mode "torch" compiles the encoder's modules only).
    dynamic: ``train.compile_dynamic``, "auto" (``dynamic=None``: dynamo's automatic dynamic shapes) or "all"
    (``dynamic=True``: every input size symbolic from the first call). optimize_ddp: sets
    ``torch._dynamo.config.optimize_ddp`` (process-wide: ``train.compile_optimize_ddp``); None leaves it as it is.
    mode: ``train.compile_mode`` (``MODES``; inductor only: other backends take no mode). options: inductor config
    options (``gemray.config.compile_options`` of ``train.compile_options``), passed as torch.compile's ``options``
    merged over ``mode``'s (torch.compile takes a mode or options, not both); inductor only.

    backend: a torch._dynamo backend name (``BACKENDS``) or a backend callable (tests: a counting wrapper).
    Raises dynamo's recompile limit to at least ``RECOMPILE_LIMIT``. Raises ValueError for an unknown backend
    name or ``dynamic`` choice."""
    if isinstance(backend, str) and backend not in BACKENDS:
        raise ValueError(f"train.compile_backend: expected one of {BACKENDS}, got {backend!r}")
    if dynamic not in DYNAMIC:
        raise ValueError(f"train.compile_dynamic: expected one of {tuple(DYNAMIC)}, got {dynamic!r}")
    if mode not in MODES:
        raise ValueError(f"train.compile_mode: expected one of {MODES}, got {mode!r}")
    _raise_recompile_limit()
    if optimize_ddp is not None:
        import torch._dynamo.config as dconfig

        dconfig.optimize_ddp = bool(optimize_ddp)
    extra: dict = {}
    if backend == "inductor" and options:
        import torch._inductor

        extra = {"options": {**(torch._inductor.list_mode_options(mode) if mode != "default" else {}), **options}}
    elif backend == "inductor" and mode != "default":
        extra = {"mode": mode}
    done = []
    for name, m in compile_targets(model, tower=tower, head=head).items():
        if getattr(m, "_gemray_compiled", False):
            continue
        m.compile(backend=backend, dynamic=DYNAMIC[dynamic], **extra)
        m._gemray_compiled = True
        done.append(name)
    if done:
        kinds = sorted({type(m).__name__.replace("FSDP", "") for n, m in model.named_modules() if n in set(done)})
        log.info("torch.compile (%s): %d module(s) [%s], backend %s, dynamic=%s, mode %s%s; the first steps compile "
                 "them", reason, len(done), ", ".join(kinds), backend if isinstance(backend, str) else
                 getattr(backend, "__name__", type(backend).__name__), dynamic, mode,
                 f", options {options}" if extra.get("options") else "")
    return done


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_dense_modules` compiled ``module``."""
    return bool(getattr(module, "_gemray_compiled", False))


__all__ = ["BACKENDS", "DYNAMIC", "compile_dense_modules", "compile_targets", "is_compiled"]
