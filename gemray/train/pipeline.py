"""``parallel.train_pipeline = "sparse_dist"``: batch i+1's copy and sparse input distribution under batch i's
compute.

Why not TorchRec's ``TrainPipelineSparseDist`` (torchrec.distributed.train_pipeline): it finds the input of
each sharded module by symbolically tracing the model's forward with torch.fx (``_rewrite_model``) and can
pipeline a module only when that input is reached from the batch by attribute / item access (or, with
``pipeline_postproc``, through nn.Module calls on such attributes). GEM's forward cannot be traced: it
branches on the batch (``batch.batch_size > 0``: fx raises "symbolically traced variables cannot be used as
inputs to control flow", measured on torchrec 1.8), and its KeyedJaggedTensor is not a batch attribute but
built per step by plain functions (``sparse_features`` / ``extra_sparse_features``) from the batch and the
negatives sampled with a host generator (``GEM.sparse_inputs``). Making the batch carry a ready KJT would
move negative sampling into the data pipeline; instead this module does the same schedule by hand:

    step i:   [side stream] batch i+1: host -> device copy, negatives + KJT (``GEM.sparse_inputs``, seeded
              for step i+1 as the step itself would be), ``input_dist`` issued on the sharded
              EmbeddingCollection (the lengths / splits all-to-all)
              forward i (its EmbeddingCollection call served from the input distributed one step earlier:
              ``compute_and_output_dist`` only)
              [side stream] batch i+1: the second stage of ``input_dist`` (the values all-to-all) issued
              backward i, optimizer step i
    step i+1: the default stream waits for the side stream; forward i+1 ...

So the all-to-alls of the input distribution of batch i+1 run on the side stream while the default stream
computes batch i (TorchRec's sparse-dist pipeline's schedule: ``start_sparse_data_dist`` before the
forward, ``wait_sparse_data_dist`` before the backward). On CPU there is no side stream: the same order of
operations, no overlap (what the gloo test checks: the same losses as without the pipeline). The draws do
not move: negatives come from a generator seeded for the step they belong to, dropout from the global RNG
the trainer seeds at each step.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

log = logging.getLogger(__name__)


@dataclass
class _Prefetched:
    source: Any                # the host batch it was made from (identity: the step must train this one)
    batch: Any                 # on the device
    sparse: Any                # GEM.SparseInputs
    ctx: Any                   # the sharded module's context
    dist: Any                  # the input_dist awaitable (stage 1), then its result's awaitable (stage 2)
    stage: int


def _record(obj: Any, stream) -> None:
    """``record_stream`` on a KJT / KJTList / tensor / batch, or on each element of a list of them."""
    if stream is None or obj is None:
        return
    if isinstance(obj, (list, tuple)):
        for o in obj:
            _record(o, stream)
        return
    fn = getattr(obj, "record_stream", None)
    if callable(fn):
        fn(stream)
        return
    inner = getattr(obj, "features", None)  # KJTList
    if isinstance(inner, (list, tuple)):
        _record(inner, stream)


class SparseDistPipeline:
    """The schedule of the module docstring for one ``DistributedModelParallel`` of a GEM.

    dmp: from ``gemray.parallel.parallelize`` (its module's ``embeddings`` a TorchRec sharded
    EmbeddingCollection). device: the rank's device (a CUDA device gets a side stream).
    Raises ValueError if the model has no sharded ``embeddings`` or no ``sparse_inputs``.
    """

    def __init__(self, dmp: nn.Module, device: torch.device):
        from torchrec.distributed.types import ShardedModule

        self.dmp, self.device = dmp, torch.device(device)
        self.model = dmp.module
        self.ec = getattr(self.model, "embeddings", None)
        if not isinstance(self.ec, ShardedModule) or not callable(getattr(self.model, "sparse_inputs", None)):
            raise ValueError(f"parallel.train_pipeline='sparse_dist': needs a model with sharded TorchRec "
                             f"`embeddings` and `sparse_inputs` (GEM), got {type(self.model).__name__}")
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._ahead: _Prefetched | None = None
        self.served_ahead = 0  # steps whose batch had been prefetched by the step before (the overlapped ones)

    def _on_side(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def prefetch(self, batch: Any, sampling_seed: int) -> None:
        """Batch i+1 (a host batch): copy to the device, negatives from a generator seeded ``sampling_seed``,
        its KJT, and the first stage of the sharded collection's ``input_dist``, on the side stream.
        Collective (the input distribution): every rank prefetches at the same step."""
        self.reset()
        with self._on_side():
            b = batch.to(self.device, non_blocking=True)
            g = torch.Generator(device="cpu").manual_seed(int(sampling_seed))
            sparse = self.model.sparse_inputs(b, g)
            ctx = self.ec.create_context()
            dist = self.ec.input_dist(ctx, sparse.kjt)
        self._ahead = _Prefetched(batch, b, sparse, ctx, dist, 1)

    def advance(self) -> None:
        """Issue the second stage of the prefetched batch's input distribution (call after the current
        forward, before its backward); no-op when nothing is prefetched or it is already issued."""
        p = self._ahead
        if p is not None and p.stage == 1:
            with self._on_side():
                p.dist, p.stage = p.dist.wait(), 2

    def take(self, batch: Any, sampling_seed: int) -> tuple[Any, Any, contextlib.AbstractContextManager]:
        """(device batch, its SparseInputs, a context manager serving the collection's next call from the
        distributed input) for host ``batch``: the prefetched one, or prefetched now when it is not (the first
        step). The default stream waits for the side stream here."""
        if self._ahead is None or self._ahead.source is not batch:
            self.prefetch(batch, sampling_seed)
        else:
            self.served_ahead += 1
        self.advance()
        p, self._ahead = self._ahead, None
        with self._on_side():
            data = p.dist.wait()
        if self.stream is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self.stream)
            # everything made on the side stream and used on this one (the context holds input_dist tensors)
            _record([p.batch, p.sparse.kjt, p.sparse.neg_ids, p.sparse.neg_rows, data, p.ctx], cur)
        return p.batch, p.sparse, self._serve(p.ctx, data, p.sparse.kjt)

    @contextlib.contextmanager
    def _serve(self, ctx, data, kjt) -> Iterator[None]:
        """Replace the sharded collection's forward, for one call with ``kjt``, by ``compute_and_output_dist``
        on the input distributed ahead (TorchRec's pipelined forward does the same)."""
        ec = self.ec

        def forward(features, *args, **kwargs):
            if features is not kjt:
                raise RuntimeError("SparseDistPipeline: the embedding collection was called with another KJT than "
                                   "the one distributed ahead (a forward that rebuilt its sparse input)")
            del ec.forward  # one call only
            return ec.compute_and_output_dist(ctx, data)

        ec.forward = forward
        try:
            yield
        finally:
            ec.__dict__.pop("forward", None)

    def reset(self) -> None:
        """Finish and drop a prefetched batch that will not be trained (end of an epoch, a stop): its
        collectives completed on every rank, so the next ones stay in step."""
        p, self._ahead = self._ahead, None
        if p is not None:
            with self._on_side():
                if p.stage == 1:
                    p.dist = p.dist.wait()
                p.dist.wait()
