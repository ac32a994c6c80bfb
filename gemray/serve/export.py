"""``gemray export``: a serving artifact that loads with plain PyTorch (no gemray, TorchRec, FBGEMM or Ray).

Written to ``DIR``:

    user_tower.pt2         ``torch.export`` program of :class:`UserTower`: jagged histories in, user embeddings out
    item_embeddings.npy    [N+1, D] float32, unit-norm item embeddings (row 0 = padding id, never recommend it)
    item_ids.npy           [N+1] raw item id of each row (row 0: -1 or ""), when the data maps its ids
    serving.json           shapes, dims, feature switches, the checkpoint and data it came from, the snippet

Program inputs (B users, T = their history tokens, dynamic): ``item_ids [T] int64`` (dense ids 1..N, each
user's most recent ``max_seq_len`` items, oldest first), ``offsets [B+1] int64`` (B >= 1; user b's tokens are
``offsets[b]:offsets[b+1]``, each 1..max_seq_len long: a longer one is refused with a RuntimeError naming
max_seq_len), ``timestamps [T] int64`` (unix seconds), ``ratings [T] int64`` (half stars 0..10; zeros when the
model ignores ratings), ``query_time [B] int64`` (the request time: the time bias of the last position;
``gemray recommend`` uses the last interaction's).
Output: ``[B, D] float32`` unit-norm user embeddings; scores = ``user_emb @ item_embeddings.T``.

:class:`UserTower` is the trained encoder (``gemray.model.hstu``) computed on sequences padded to
``max_seq_len`` with a causal mask (the reference attention path, HSTU's pointwise silu / N or softmax):
padding after a sequence never reaches its positions, so it gives the jagged model's user embeddings up to
float rounding (tests/test_serve.py checks it in a process where gemray, torchrec and ray cannot be imported).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gemray.config import JobConfig
from gemray.kernels.reference import position_bucket_ref
from gemray.serve.model import TrainedModel

log = logging.getLogger(__name__)

PROGRAM_FILE = "user_tower.pt2"
ITEMS_FILE = "item_embeddings.npy"
ITEM_IDS_FILE = "item_ids.npy"
SPEC_FILE = "serving.json"
LN_EPS = 1e-6
_TIME_LOG_DIVISOR = 0.301  # kernels.reference.time_bucket_ref's

LOADING_SNIPPET = """\
import json, numpy as np, torch
prog = torch.export.load("DIR/user_tower.pt2").module()
items = torch.from_numpy(np.load("DIR/item_embeddings.npy"))      # [N+1, D], unit norm
users = prog(item_ids, offsets, timestamps, ratings, query_time)   # [B, D]
scores = users @ items.T; scores[:, 0] = -inf                       # mask padding (and the user's history)
top = scores.topk(10, dim=1).indices                                # dense item ids; raw: np.load("DIR/item_ids.npy")
"""


def _time_bucket(seconds: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``kernels.reference.time_bucket_ref`` (log buckets of |seconds|), in ops torch.export keeps."""
    s = seconds.abs().to(torch.float64).clamp(min=1.0)
    return torch.clamp(torch.floor(torch.log(s) / _TIME_LOG_DIVISOR).to(torch.int64), 0, num_buckets - 1)


class UserTower(nn.Module):
    """The trained encoder as a self-contained module over padded dense tensors (see the module docstring).

    Built from a loaded GEM (:meth:`from_model`): item / rating / time-gap tables [rows, D], positional table
    [max_seq_len, D], per block uvqk [D, 2HV+2HA] + bias, output [D, HV] + bias, relative-bias weights; the
    position buckets [N, N] are precomputed. ``forward`` inputs and output: see the module docstring.
    """

    def __init__(self, *, item_table: torch.Tensor, rating_table: torch.Tensor | None,
                 time_table: torch.Tensor | None, pos_emb: torch.Tensor, blocks: list[dict[str, torch.Tensor]],
                 num_heads: int, attention_dim: int, linear_dim: int, activation: str, num_time_buckets: int,
                 num_position_buckets: int, time_bias_query: str):
        super().__init__()
        self.item_table = nn.Parameter(item_table, requires_grad=False)
        self.use_rating = rating_table is not None
        self.use_time = time_table is not None
        self.rating_table = nn.Parameter(rating_table if self.use_rating else torch.zeros(1, item_table.shape[1]),
                                         requires_grad=False)
        self.time_table = nn.Parameter(time_table if self.use_time else torch.zeros(1, item_table.shape[1]),
                                       requires_grad=False)
        self.pos_emb = nn.Parameter(pos_emb, requires_grad=False)
        self.n, self.d = pos_emb.shape
        self.h, self.a, self.v = num_heads, attention_dim, linear_dim
        self.activation, self.num_time_buckets = activation, num_time_buckets
        self.query_next = time_bias_query == "next"
        self.alpha = 1.0 / math.sqrt(attention_dim) if activation == "softmax" else 1.0
        ids = torch.arange(self.n)
        self.register_buffer("pos_buckets", position_bucket_ref(ids.view(-1, 1) - ids.view(1, -1),
                                                                num_position_buckets, self.n))
        self.blocks = nn.ParameterList()
        self.num_blocks = len(blocks)
        for b in blocks:
            for name in ("uvqk_weight", "uvqk_bias", "o_weight", "o_bias", "pos_w", "ts_w"):
                self.blocks.append(nn.Parameter(b[name], requires_grad=False))

    @classmethod
    @torch.no_grad()
    def from_model(cls, trained: TrainedModel) -> "UserTower":
        """Copy the weights out of a loaded model (its one-rank sharded tables read back whole, on CPU)."""
        model, cfg = trained.model, trained.cfg.model
        dev = trained.device
        ec = model.embeddings

        def table(feature: str, rows: int) -> torch.Tensor:
            from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

            from gemray.model.features import feature_names

            names = feature_names(cfg)
            lengths = torch.zeros(len(names), dtype=torch.int64, device=dev)
            lengths[names.index(feature)] = rows
            kjt = KeyedJaggedTensor(keys=names, values=torch.arange(rows, device=dev), lengths=lengths, stride=1)
            return ec(kjt)[feature].values().float().cpu().clone()

        from gemray.jagged import ITEM_FEATURE, RATING_FEATURE, TIME_FEATURE
        from gemray.model.features import NUM_RATINGS

        enc = model.encoder
        blocks = [{"uvqk_weight": b.uvqk_weight, "uvqk_bias": b.uvqk_bias, "o_weight": b.o_weight,
                   "o_bias": b.o_bias, "pos_w": b.rel_bias.pos_w, "ts_w": b.rel_bias.ts_w} for b in enc.blocks]
        blocks = [{k: v.detach().float().cpu().clone() for k, v in b.items()} for b in blocks]
        return cls(item_table=table(ITEM_FEATURE, trained.num_items + 1),
                   rating_table=table(RATING_FEATURE, NUM_RATINGS) if cfg.use_rating_feature else None,
                   time_table=table(TIME_FEATURE, cfg.num_time_buckets) if cfg.use_time_feature else None,
                   pos_emb=enc.pos_emb.detach().float().cpu().clone(), blocks=blocks, num_heads=cfg.num_heads,
                   attention_dim=cfg.attention_dim, linear_dim=cfg.linear_dim, activation=cfg.attn_activation,
                   num_time_buckets=cfg.num_time_buckets, num_position_buckets=cfg.num_position_buckets,
                   time_bias_query=cfg.time_bias_query)

    def forward(self, item_ids: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor,
                ratings: torch.Tensor, query_time: torch.Tensor) -> torch.Tensor:
        """item_ids / timestamps / ratings [T] int64, offsets [B+1] int64, query_time [B] int64 -> [B, D]."""
        N, D = self.n, self.d
        T = item_ids.shape[0]
        B = offsets.shape[0] - 1
        lengths = offsets[1:] - offsets[:-1]
        # kept in the program (a bare "index N is out of bounds" of the positional table otherwise)
        torch._assert_async((lengths <= N).all(), f"user_tower: a user's history is longer than max_seq_len = {N} "
                            f"tokens (offsets); pass each user's most recent {N} interactions at most")
        t = torch.arange(T, device=item_ids.device)
        seg = torch.searchsorted(offsets[1:].contiguous(), t, right=True).clamp(max=B - 1)  # [T]
        pos = t - offsets[seg]
        last = pos == lengths[seg] - 1
        tok = F.embedding(item_ids, self.item_table)
        if self.use_rating:
            tok = tok + F.embedding(ratings, self.rating_table)
        if self.use_time:  # gemray.model.features.time_gap_buckets
            prev = timestamps[(t - 1).clamp(min=0)]
            gap = 1 + _time_bucket(timestamps - prev, max(self.num_time_buckets - 1, 1))
            gap = torch.where(pos == 0, torch.zeros_like(gap), gap).clamp(max=self.num_time_buckets - 1)
            tok = tok + F.embedding(gap, self.time_table)
        if self.query_next:  # gemray.jagged.query_timestamps
            tq = torch.where(last, query_time[seg], timestamps[(t + 1).clamp(max=T - 1)])
        else:
            tq = timestamps
        x = tok * math.sqrt(D) + self.pos_emb[pos]
        X = x.new_zeros((B, N, D)).index_put((seg, pos), x)
        ts = torch.zeros((B, N), dtype=torch.float64, device=x.device).index_put((seg, pos), timestamps.double())
        qs = torch.zeros((B, N), dtype=torch.float64, device=x.device).index_put((seg, pos), tq.double())
        tb = _time_bucket(qs.unsqueeze(2) - ts.unsqueeze(1), self.num_time_buckets)  # [B, N, N]
        i = torch.arange(N, device=x.device)
        valid = (i.view(1, 1, N) <= i.view(1, N, 1)) & (i.view(1, N, 1) < lengths.view(B, 1, 1))  # [B, N, N]
        H, A, V = self.h, self.a, self.v
        for k in range(self.num_blocks):
            w, b, ow, ob, pw, tw = (self.blocks[6 * k + j] for j in range(6))
            bias = pw[self.pos_buckets].unsqueeze(0) + tw[tb]  # [B, N, N]
            xn = F.layer_norm(X, (D,), eps=LN_EPS)
            uvqk = F.silu(torch.matmul(xn, w) + b)
            u, v, q, kk = torch.split(uvqk, [H * V, H * V, H * A, H * A], dim=-1)
            q = q.reshape(B, N, H, A).transpose(1, 2)
            kk = kk.reshape(B, N, H, A).transpose(1, 2)
            v = v.reshape(B, N, H, V).transpose(1, 2)
            logits = torch.matmul(q, kk.transpose(-1, -2)) * self.alpha + bias.unsqueeze(1)
            if self.activation == "softmax":
                m = valid.unsqueeze(1) | (i.view(1, 1, N, 1) == i.view(1, 1, 1, N))
                attn = torch.softmax(logits.masked_fill(~m, float("-inf")), dim=-1) * valid.unsqueeze(1)
            else:
                act = {"silu": F.silu, "gelu": F.gelu}.get(self.activation)
                attn = (act(logits) if act is not None else logits) * (valid.unsqueeze(1).to(logits.dtype) / N)
            y = torch.matmul(attn, v).transpose(1, 2).reshape(B, N, H * V)
            y = F.layer_norm(y, (H * V,), eps=LN_EPS) * u
            X = X + F.linear(y, ow, ob)
        X = F.normalize(X, dim=-1, eps=1e-6)
        out = X[torch.arange(B, device=x.device), (lengths - 1).clamp(min=0)]
        return out * (lengths > 0).unsqueeze(1).to(out.dtype)


def example_inputs(num_items: int, max_seq_len: int) -> tuple[torch.Tensor, ...]:
    """A small batch of valid program inputs (2 users, 3 and 2 tokens) for tracing."""
    n = min(3, max_seq_len)
    lens = [n, max(1, n - 1)]
    T = sum(lens)
    g = torch.Generator().manual_seed(0)
    return (torch.randint(1, num_items + 1, (T,), generator=g), torch.tensor([0, lens[0], T]),
            torch.arange(T, dtype=torch.int64) * 1000 + 10**9, torch.randint(0, 11, (T,), generator=g),
            torch.tensor([10**9 + 5000, 10**9 + 6000]))


def check_exportable(cfg: JobConfig) -> None:
    """Refuse, from the run's config alone (``gemray export`` checks it before loading the checkpoint), a model
    :func:`export` cannot write: one with per-token side features (``model.token_features``) or ranking tasks
    (``model.tasks`` with "ctr" / "cvr"), which the program does not cover. Raises ValueError naming the field
    and its value."""
    m = cfg.model
    what = ([f"model.token_features = {list(m.token_features)}"] if m.token_features else []) + \
           ([f"ranking tasks (model.tasks = {list(m.tasks)})"] if m.ranking_tasks else [])
    if what:
        raise ValueError(f"export: the program covers the retrieval model over item / rating / time histories; "
                         f"this model has {' and '.join(what)}, which is not exported yet")


def check_out_dir(out_dir: str | Path) -> Path:
    """The export's folder, resolved: it must be new or an empty folder (``gemray export`` asks before the checkpoint
    is read). Raises FileExistsError naming --out and what is there."""
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out}: " + ("is a file; give a new or empty folder" if not out.is_dir() else
                                                  "is a folder that is not empty; give a new or empty folder"))
    return out


def export(trained: TrainedModel, out_dir: str | Path) -> Path:
    """Write the serving artifact of ``trained`` into ``out_dir`` (see the module docstring); returns the folder.

    Raises FileExistsError when ``out_dir`` exists and is not empty, ValueError for a model with token side
    features (their lookups are not part of the program yet) or ranking tasks.
    """
    from gemray.serve.recommend import IdMaps

    cfg = trained.cfg
    check_exportable(cfg)
    out = check_out_dir(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tower = UserTower.from_model(trained).eval()
    B, T = torch.export.Dim("B", min=1), torch.export.Dim("T", min=1)
    dims = ({0: T}, {0: B + 1}, {0: T}, {0: T}, {0: B})
    args = example_inputs(trained.num_items, cfg.data.max_seq_len)
    # size-oblivious tracing: traced on 2 users, a backed B would be assumed != 1 (0/1 specialisation: a guard
    # B >= 2 in the program, which then refused a batch of one user, the common online request)
    from torch.fx.experimental import _config as fx_config

    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        prog = torch.export.export(tower, args, dynamic_shapes=dims)
    torch.export.save(prog, str(out / PROGRAM_FILE))
    with torch.no_grad():
        items = trained.model.item_embeddings(torch.arange(0, trained.num_items + 1, device=trained.device))
    np.save(out / ITEMS_FILE, items.float().cpu().numpy())
    spec: dict[str, Any] = {
        "format": "gemray-serving-1", "program": PROGRAM_FILE, "item_embeddings": ITEMS_FILE,
        "num_items": trained.num_items, "embedding_dim": int(items.shape[1]), "max_seq_len": cfg.data.max_seq_len,
        "inputs": {"item_ids": "[T] int64 dense ids 1..N, oldest first per user",
                   "offsets": "[B+1] int64 (B >= 1), lengths 1..max_seq_len",
                   "timestamps": "[T] int64 unix seconds", "ratings": "[T] int64 half stars 0..10",
                   "query_time": "[B] int64 unix seconds (the request time)"},
        "output": "[B, D] float32 unit-norm user embeddings; score = user @ item_embeddings.T (row 0 = padding)",
        "uses_ratings": cfg.model.use_rating_feature, "uses_time_gaps": cfg.model.use_time_feature,
        "checkpoint": str(trained.checkpoint), "epoch": trained.state.get("epoch"),
        "global_step": trained.state.get("global_step"), "trained_on": trained.data,
        "torch_version": torch.__version__, "loading": LOADING_SNIPPET.replace("DIR", str(out)),
    }
    try:
        from gemray.pipelines.movielens import load_manifest

        maps = IdMaps(load_manifest(cfg.data.prepared_dir))
    except (FileNotFoundError, ValueError) as e:
        log.warning("export: no id maps (%s): item_ids.npy not written", e)
        maps = None
    if maps is not None and maps.items is not None:
        raw = maps.raw_items(np.arange(1, trained.num_items + 1))
        numeric = all(isinstance(r, (int, np.integer)) for r in raw)
        ids = np.array(([-1] if numeric else [""]) + list(raw), dtype=np.int64 if numeric else str)
        np.save(out / ITEM_IDS_FILE, ids)
        spec["item_ids"] = ITEM_IDS_FILE
    (out / SPEC_FILE).write_text(json.dumps(spec, indent=1, sort_keys=True, default=str) + "\n")
    log.info("exported %s: %s, %s [%d, %d]", out, PROGRAM_FILE, ITEMS_FILE, *items.shape)
    return out
