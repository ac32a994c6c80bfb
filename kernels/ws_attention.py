"""Warp-specialized jagged flash attention for Hopper (sm_90), written in Gluon.

Triton 3.6 cannot split its attention loops into producer / consumer warps on Hopper (its automatic warp
specialization fails or is ignored on them: the kernel run reports (benchmarks/reports/kernels_h200_*.md) "Runs 7-10", "Run 11"). Gluon
(``triton.experimental.gluon``, shipped with Triton) exposes the pieces directly: TMA copies, mbarriers,
asynchronous warpgroup MMAs and ``gl.warp_specialize``. This module builds the softmax forward the
FlashAttention-3 way (Shah et al., 2024, "FlashAttention-3: Fast and Accurate Attention with Asynchrony and
Low-precision", sections 3.1-3.2):

- a loader warp streams the query tile once and the key / value tiles through a ring of STAGES shared-memory
  slots (TMA copies, ready / empty mbarriers per slot);
- one or two consumer warpgroups each own 64 query rows of the CTA's query tile; in each key step a consumer
  issues the next tile's ``S = Q K^T`` before this tile's ``O += P V``, so the softmax of one tile runs while
  the tensor cores work on the other (intra-warpgroup overlap), and the two consumers drift apart so one's
  softmax hides behind the other's products (inter-warpgroup overlap);
- each program runs the work items i = pid, pid + grid, ... of a head-major, by-sequence table (one item per
  program by default; a persistent grid of one program per SM is an option), counting slots and mbarrier
  phases across its items.

The silu forward (``forward_silu``, the regime's ``ws_fwd_silu``; head dims 128 and 256) is the same pipeline without
the running max: two consumer warpgroups of 64 query rows and the same loader warp, P = silu(alpha S) rounded to
the inputs' dtype as jagged_attention._gdpa_fwd rounds it, O / N written at the end; at D = 256 the [64, 256] fp32
accumulator takes 128 of a consumer's 232 registers, so key tiles are 64 rows ([64, 64] scores) and the query tile
plus two key / value slots fill 192 KiB of shared memory. On a gem-h200 layer (H100, 2026-12-07) 1.204 -> 0.864 ms
against _gdpa_fwd (423 -> 590 TFLOP/s over the valid pairs), the output bit-identical.

The silu backward's dV + dS^T launch (``backward_dv_ds``, the regime's ``ws_bwd``; with ``dk_from_ds`` the
Triton launches _gdpa_dq_ds / _gdpa_dk_ds then take dQ and dK from the stored dS^T) is built the same way: a
program owns 128 keys, two consumer warpgroups of 64 key rows each keep their K and V tiles in shared memory and
their [64, D] dV accumulator in registers, and a loader warp streams the query and dO tiles (BLOCK_M rows) through
STAGES slots shared by both; per step a consumer computes S^T = K Q^T and dP^T = V dO^T, silu and silu' of S^T,
dV += P^T dO with P^T from registers, and stores the dS^T tile by TMA from shared memory. The Triton launch it
replaces holds one warpgroup at 255 registers and its products wait on its own pointwise work and stores; here
the two warpgroups' products fill each other's gaps (2.54 -> 1.60 ms on a gem-h200 layer, H100, 2026-12-07).
With the regime's ``ws_dkdq``, dQ = dS K and dK = dS^T Q from that stored dS^T are Gluon launches too
(``ds_gemm``): jagged, causally blocked GEMMs, 128 output rows a program in two consumer warpgroups, a loader
warp streaming 64-row steps of dS^T boxes (through a per-sequence descriptor made on the device, so rows and
columns past the sequence read as zeros) and of the query / key rows.

Same contract as ``jagged_attention._gdpa_fwd`` for the cases it takes (``eligible``): softmax (head dim 64 or
128) or silu (128 or 256), full rows (causal or not), no targets / bias / contextual prefix / block / window, not
PMA, 16-bit inputs, one head dim for queries, keys and values, rows 16-byte aligned and heads contiguous (one 2-D
view [T, H * D] per tensor). The softmax forward writes o [Tq, H, D] and the base-2 log-sum-exp ``lse[h, t] = m +
log2(l)`` (inf for a row with no valid key) that the Triton backward reads; the silu forward o only. Key / value
tiles are read through a descriptor of the whole tensor: the rows of a tile past a sequence's end belong to the
next sequence (or are TMA's zero fill) and get probability (silu: P) 0, so a non-finite value in one sequence's
values can reach a neighbour's output as 0 * inf; the Triton path has no such coupling. There is no CPU (interpreter) path: Gluon kernels run on the GPU only,
and the GPU-marked tests compare them with the reference.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Where this forward runs and with which tiles is part of gemray.kernels.config.KernelConfig (per regime: ws_fwd,
# ws_tiles = (consumer warpgroups, BLOCK_N, STAGES, ping-pong between the two consumers, persistent grid)). Runs
# 28-30 (H200, the kernel run reports (benchmarks/reports/kernels_h200_*.md) "Runs 28-38"): with two consumer warpgroups, 128-key tiles and
# two stages the forward takes 0.423-0.427 vs 0.522 ms (Triton) on uniform B=128 N=1024 (long), 2.34-2.52 vs
# 2.66-2.69 ms (graph replays) on uniform B=64 N=4096 (xlong), 0.331-0.332 vs 0.379-0.381 ms on heavy B=256 N=4096
# (medium); on the short heavy B=128 N=1024 batch it loses (0.052 vs 0.045 ms device time), so off there. One
# consumer warpgroup (255 registers, one CTA per SM) lost everywhere; 64-key tiles and the ping-pong schedule did
# not win consistently (run 30), nor a persistent grid (one program per SM looping over the items; run 37: 0.351 vs
# 0.330 ms on heavy B=256 N=4096), so all three are off by default.
_ROWS = 64  # query rows per consumer warpgroup (a wgmma's M)


@gluon.jit
def _item(WORK, Q_OFF, KV_OFF, i, n_items, n_tiles_q, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr):
    """Work item i of the launch (head-major: head i // n_items, table entry i % n_items): (valid, head
    int64, first query row m0 of the tile, q_start, lq, kv_start, lk, key tiles to visit >= 1)."""
    w = gl.load(WORK + i % n_items)
    h = (i // n_items).to(gl.int64)
    wv = gl.maximum(w, 0)
    b = wv // n_tiles_q
    m0 = (wv % n_tiles_q) * BLOCK_M
    q_start = gl.load(Q_OFF + b)
    lq = (gl.load(Q_OFF + b + 1) - q_start).to(gl.int32)
    kv_start = gl.load(KV_OFF + b)
    lk = (gl.load(KV_OFF + b + 1) - kv_start).to(gl.int32)
    hi = lk
    if CAUSAL:
        hi = gl.minimum(hi, m0 + BLOCK_M)
    n_tiles = gl.maximum(gl.cdiv(hi, BLOCK_N), 1)  # >= 1: a query row with no key still gets o = 0
    return w >= 0, h, m0, q_start, lq, kv_start, lk, n_tiles


@gluon.jit
def _ring_copy(desc, row, col, ready, empty, smem, slot, phase):
    """The producer's half of a ring slot: wait until the slot's consumers released it (its empty barrier at
    ``phase``; a fresh barrier passes parity 1 at once), then one TMA copy of desc's box at [row, col] into it,
    arriving on its ready barrier with the box's bytes."""
    mbarrier.wait(empty.index(slot), phase)
    mbarrier.expect(ready.index(slot), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], ready.index(slot), smem.index(slot))


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready,
                    v_empty, WORK, Q_OFF, KV_OFF, n_items, n_tiles_q, total, CAUSAL: gl.constexpr,
                    NUM_WG: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    """Loader warp, for each work item of this program: the query tile (NUM_WG boxes of 64 rows) once the
    consumers released the previous item's, then key tile j and value tile j into slot c % STAGES (c counts
    the program's tiles across items) once the consumers released the slot's previous tile. Empty barriers
    start 'released': waiting for parity 1 on a fresh barrier returns at once."""
    c = 0
    it = 0
    for i in range(gl.program_id(0), total, gl.num_programs(0)):
        valid, h, m0, q_start, lq, kv_start, lk, n_tiles = _item(WORK, Q_OFF, KV_OFF, i, n_items, n_tiles_q,
                                                                 CAUSAL, 64 * NUM_WG, BLOCK_N)
        if valid:
            col = (h * HEAD_D).to(gl.int32)
            q_row = (q_start + m0).to(gl.int32)
            kv_row = kv_start.to(gl.int32)
            mbarrier.wait(q_empty, (it & 1) ^ 1)
            mbarrier.expect(q_bar, NUM_WG * q_desc.block_type.nbytes)
            for w in gl.static_range(NUM_WG):
                tma.async_copy_global_to_shared(q_desc, [q_row + w * 64, col], q_bar, q_smem.index(w))
            for j in range(n_tiles):
                slot = (c + j) % STAGES
                phase = (((c + j) // STAGES) & 1) ^ 1
                _ring_copy(k_desc, kv_row + j * BLOCK_N, col, k_ready, k_empty, k_smem, slot, phase)
                _ring_copy(v_desc, kv_row + j * BLOCK_N, col, v_ready, v_empty, v_smem, slot, phase)
            c += n_tiles
            it += 1


@gluon.jit
def _softmax_step(s, m_i, l_i, rows, n0, lk, qk_scale, masked, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
                  COL_L: gl.constexpr, P_L: gl.constexpr, dtype: gl.constexpr):
    """Online softmax of one score tile s [64, BLOCK_N] fp32 (raw q.k): returns (p = 2^(s * qk_scale - m) in
    ``dtype`` and the wgmma A-operand layout P_L (16-bit at once: half the registers of fp32 while the next
    products run), the rescale factor of the previous rows' sums and output, new running max m, new running
    sum l). ``masked``: the tile holds pairs past the key length or (CAUSAL) after the query position."""
    if masked:
        cols = n0 + gl.arange(0, BLOCK_N, layout=COL_L)
        ok = cols[None, :] < lk
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None])
        s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    corr = gl.exp2(m_i - m_safe)
    p = gl.exp2(s * qk_scale - m_safe[:, None])
    l_i = l_i * corr + gl.sum(p, 1)
    return gl.convert_layout(p.to(dtype), P_L), corr, m_new, l_i


@gluon.jit
def _consumer_partition(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, turn, O, LSE,
                        WORK, Q_OFF, KV_OFF, n_items, n_tiles_q, total, stride_ot, stride_oh, stride_lh,
                        qk_scale, WG: gl.constexpr, NUM_WG: gl.constexpr, CAUSAL: gl.constexpr,
                        BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                        PINGPONG: gl.constexpr):
    """Consumer warpgroup WG, for each work item of this program: rows [m0 + 64 WG, m0 + 64 WG + 64) of its
    query tile. Per key step j (FlashAttention-3's intra-warpgroup overlap, in its code's order): issue
    S_{j+1} = Q K_{j+1}^T, rescale O, issue O += P_j V_j, wait for S_{j+1} only, softmax of S_{j+1} while
    P_j V_j runs, wait for it; nothing is left in flight across the loop's back edge (ptxas serializes every
    wgmma of the kernel when a non-wgmma instruction may touch an in-flight accumulator). PINGPONG (two
    consumers): the warpgroups take turns issuing their step's products (an mbarrier per warpgroup, ``turn``;
    FA3's ping-pong schedule). Then O / l and lse to global memory (rows past the sequence's end are not
    written). Slots and phases count the program's key tiles across items (c), its items (it) and steps (t)."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HEAD_D, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_L: gl.constexpr = gl.SliceLayout(1, S_L)
    COL_L: gl.constexpr = gl.SliceLayout(0, S_L)
    OROW_L: gl.constexpr = gl.SliceLayout(1, O_L)
    ST_L: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[4, 1],
                                          order=[1, 0])
    dtype: gl.constexpr = q_smem.dtype
    q = q_smem.index(WG)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, S_L)
    c = 0
    it = 0
    t = 0
    for i in range(gl.program_id(0), total, gl.num_programs(0)):
        valid, h, m0, q_start, lq, kv_start, lk, n_tiles = _item(WORK, Q_OFF, KV_OFF, i, n_items, n_tiles_q,
                                                                 CAUSAL, 64 * NUM_WG, BLOCK_N)
        if valid:
            row0 = m0 + WG * 64
            rows = row0 + gl.arange(0, 64, layout=ROW_L)
            # key tiles [0, n_full) hold only valid pairs for all 64 rows; later ones are masked
            if CAUSAL:
                n_full = gl.minimum(row0 + 1, lk) // BLOCK_N
            else:
                n_full = lk // BLOCK_N
            m_i = gl.full([64], float("-inf"), gl.float32, ROW_L)
            l_i = gl.zeros([64], gl.float32, ROW_L)
            acc = gl.zeros([64, HEAD_D], gl.float32, O_L)

            mbarrier.wait(q_bar, it & 1)
            mbarrier.wait(k_ready.index(c % STAGES), (c // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(c % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s, ))
            mbarrier.arrive(k_empty.index(c % STAGES), count=1)
            p, corr, m_i, l_i = _softmax_step(s, m_i, l_i, rows, 0, lk, qk_scale, 0 >= n_full, CAUSAL, BLOCK_N,
                                              COL_L, P_L, dtype)
            for j in range(n_tiles - 1):
                cj = c + j
                cn = cj + 1
                acc = acc * gl.convert_layout(corr, OROW_L)[:, None]
                p_op = p
                mbarrier.wait(k_ready.index(cn % STAGES), (cn // STAGES) & 1)
                mbarrier.wait(v_ready.index(cj % STAGES), (cj // STAGES) & 1)
                if PINGPONG:  # warpgroup 0 goes first: a fresh barrier passes a wait for parity 1 at once
                    mbarrier.wait(turn.index(WG), ((t + j) & 1) ^ (1 - WG))
                s_next = warpgroup_mma(q, k_smem.index(cn % STAGES).permute((1, 0)), s_zero, use_acc=False,
                                       is_async=True)
                acc = warpgroup_mma(p_op, v_smem.index(cj % STAGES), acc, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn.index(1 - WG), count=1)
                s = warpgroup_mma_wait(1, deps=(s_next, ))  # S_{j+1} done; O += P_j V_j runs during its softmax
                mbarrier.arrive(k_empty.index(cn % STAGES), count=1)
                p, corr, m_i, l_i = _softmax_step(s, m_i, l_i, rows, (j + 1) * BLOCK_N, lk, qk_scale,
                                                  j + 1 >= n_full, CAUSAL, BLOCK_N, COL_L, P_L, dtype)
                acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
                mbarrier.arrive(v_empty.index(cj % STAGES), count=1)
            mbarrier.arrive(q_empty, count=1)  # every S of the item is done: the loader may bring the next Q
            cl = c + n_tiles - 1
            acc = acc * gl.convert_layout(corr, OROW_L)[:, None]
            mbarrier.wait(v_ready.index(cl % STAGES), (cl // STAGES) & 1)
            acc = warpgroup_mma(p, v_smem.index(cl % STAGES), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(v_empty.index(cl % STAGES), count=1)

            l_o = gl.convert_layout(l_i, OROW_L)
            out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
            lse = gl.where(l_i == 0.0, float("inf"), m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i)))
            gl.store(LSE + h * stride_lh + q_start + rows, lse, mask=rows < lq)
            out = gl.convert_layout(out.to(dtype), ST_L)
            r = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, ST_L))
            d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ST_L))
            gl.store(O + (q_start + r[:, None]) * stride_ot + h * stride_oh + d[None, :], out, mask=r[:, None] < lq)
            c += n_tiles
            it += 1
            t += n_tiles - 1


@gluon.jit
def _ws_fwd(q_desc, k_desc, v_desc, O, LSE, Q_OFF, KV_OFF, WORK, stride_ot, stride_oh, stride_lh, qk_scale,
            n_tiles_q, n_items, total, CAUSAL: gl.constexpr, NUM_WG: gl.constexpr, BLOCK_N: gl.constexpr,
            HEAD_D: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """Work items i = head * n_items + table entry (head-major, as the Triton forward's (items, H) grid), i in
    [0, total = n_items * H); program p runs items p, p + grid, ... (one each for a grid of ``total``, several
    for a persistent grid of one program per SM). WORK is jagged_attention._work_table's table (``b *
    n_tiles_q + tile``, -1 = no item). Shared memory: the query tile, STAGES key / value slots, mbarriers."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NUM_WG, 64, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=NUM_WG)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_WG)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=NUM_WG)

    if NUM_WG == 2:
        gl.warp_specialize([
            (_consumer_partition, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
                                   O, LSE, WORK, Q_OFF, KV_OFF, n_items, n_tiles_q, total, stride_ot, stride_oh,
                                   stride_lh, qk_scale, 0, NUM_WG, CAUSAL, BLOCK_N, HEAD_D, STAGES, PINGPONG)),
            (_consumer_partition, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
                                   O, LSE, WORK, Q_OFF, KV_OFF, n_items, n_tiles_q, total, stride_ot, stride_oh,
                                   stride_lh, qk_scale, 1, NUM_WG, CAUSAL, BLOCK_N, HEAD_D, STAGES, PINGPONG)),
            (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty,
                               v_ready, v_empty, WORK, Q_OFF, KV_OFF, n_items, n_tiles_q, total, CAUSAL, NUM_WG,
                               BLOCK_N, HEAD_D, STAGES))], [4, 1], [232, 40])
    else:
        gl.warp_specialize([
            (_consumer_partition, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
                                   O, LSE, WORK, Q_OFF, KV_OFF, n_items, n_tiles_q, total, stride_ot, stride_oh,
                                   stride_lh, qk_scale, 0, NUM_WG, CAUSAL, BLOCK_N, HEAD_D, STAGES, False)),
            (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty,
                               v_ready, v_empty, WORK, Q_OFF, KV_OFF, n_items, n_tiles_q, total, CAUSAL, NUM_WG,
                               BLOCK_N, HEAD_D, STAGES))], [1], [40])



@gluon.jit
def _silu(s, alpha, FAST: gl.constexpr):
    """silu(alpha s) of raw fp32 scores s, without the 1/N factor, in jagged_attention._fwd_inner's arithmetic (the
    same roundings): FAST (16-bit inputs) h = s (alpha / 2), silu = h tanh.approx(h) + h (one MUFU op a score); else
    x = alpha s, x / (1 + 2^(-x log2 e)) with the fast division."""
    if FAST:
        h = s * (0.5 * alpha)
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [h], dtype=gl.float32, is_pure=True,
                                      pack=1)
        p = h * t + h
    else:
        x = s * alpha
        p = gl.fdiv(x, 1.0 + gl.exp2(-1.4426950408889634 * x), ieee_rounding=False)
    return p


@gluon.jit
def _silu_step(s, rows, n0, lk, alpha, masked, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, COL_L: gl.constexpr,
               P_L: gl.constexpr, dtype: gl.constexpr, FAST: gl.constexpr):
    """P = silu(alpha S) of one score tile s [64, BLOCK_N] fp32 (raw q.k), 0 where ``masked`` says the tile holds
    pairs past the key length or (CAUSAL) after the query position, rounded to ``dtype`` (as the Triton forward
    rounds P before its P V product) in the wgmma A-operand layout P_L."""
    p = _silu(s, alpha, FAST)
    if masked:
        cols = n0 + gl.arange(0, BLOCK_N, layout=COL_L)
        ok = cols[None, :] < lk
        if CAUSAL:
            ok = ok & (cols[None, :] <= rows[:, None])
        p = gl.where(ok, p, 0.0)
    return gl.convert_layout(p.to(dtype), P_L)


@gluon.jit
def _silu_consumer_partition(q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty, o_desc,
                             O, WORK, Q_OFF, KV_OFF, n_items, n_tiles_q, total, stride_ot, stride_oh, alpha, inv_n,
                             WG: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                             STAGES: gl.constexpr, FAST: gl.constexpr):
    """Consumer warpgroup WG of the silu forward: rows [m0 + 64 WG, m0 + 64 WG + 64) of each item's 128-row query
    tile, O [64, HEAD_D] fp32 in registers. Per key step j, as _consumer_partition (FlashAttention-3's
    intra-warpgroup overlap) without a running max or rescale: issue S_{j+1} = Q K_{j+1}^T, issue O += P_j V_j, wait
    for S_{j+1} only, P_{j+1} = silu(alpha S_{j+1}) (bf16) while P_j V_j runs, wait for it; nothing stays in flight
    across the loop's back edge. The warpgroup computes only the key tiles [0, n_mine) that hold a valid pair for
    one of its rows that exists (causal: keys <= its last row; a warpgroup whose rows all lie past the sequence's
    end computes tile 0 only, its store masked off) and only waits for / releases the item's later tiles, which the
    other warpgroup reads. Then O / N in the inputs' dtype to global memory (rows past the sequence's end are not
    written; a row with no valid key gets 0): 64 rows inside the sequence through the warpgroup's query buffer and a
    TMA store, a sequence's last rows by masked stores from registers; the query buffer is released to the loader
    after that. Slots and phases count the program's key tiles across items (c) and its items (it)."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HEAD_D, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_L: gl.constexpr = gl.SliceLayout(1, S_L)
    COL_L: gl.constexpr = gl.SliceLayout(0, S_L)
    dtype: gl.constexpr = q_smem.dtype
    q = q_smem.index(WG)
    s_zero = gl.zeros([64, BLOCK_N], gl.float32, S_L)
    c = 0
    it = 0
    for i in range(gl.program_id(0), total, gl.num_programs(0)):
        valid, h, m0, q_start, lq, kv_start, lk, n_tiles = _item(WORK, Q_OFF, KV_OFF, i, n_items, n_tiles_q,
                                                                 CAUSAL, 128, BLOCK_N)
        if valid:
            row0 = m0 + WG * 64
            rows = row0 + gl.arange(0, 64, layout=ROW_L)
            # key tiles [0, n_full) hold only valid pairs for all 64 rows; later ones are masked
            if CAUSAL:
                n_full = gl.minimum(row0 + 1, lk) // BLOCK_N
                n_mine = gl.cdiv(gl.minimum(row0 + 64, lk), BLOCK_N)
            else:
                n_full = lk // BLOCK_N
                n_mine = n_tiles
            n_mine = gl.where(row0 < lq, gl.minimum(gl.maximum(n_mine, 1), n_tiles), 1)
            acc = gl.zeros([64, HEAD_D], gl.float32, O_L)

            mbarrier.wait(q_bar, it & 1)
            mbarrier.wait(k_ready.index(c % STAGES), (c // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(c % STAGES).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s, ))
            mbarrier.arrive(k_empty.index(c % STAGES), count=1)
            p = _silu_step(s, rows, 0, lk, alpha, 0 >= n_full, CAUSAL, BLOCK_N, COL_L, P_L, dtype, FAST)
            for j in range(n_mine - 1):
                cj = c + j
                cn = cj + 1
                p_op = p
                mbarrier.wait(k_ready.index(cn % STAGES), (cn // STAGES) & 1)
                mbarrier.wait(v_ready.index(cj % STAGES), (cj // STAGES) & 1)
                s_next = warpgroup_mma(q, k_smem.index(cn % STAGES).permute((1, 0)), s_zero, use_acc=False,
                                       is_async=True)
                acc = warpgroup_mma(p_op, v_smem.index(cj % STAGES), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=(s_next, ))  # S_{j+1} done; O += P_j V_j runs during its silu
                mbarrier.arrive(k_empty.index(cn % STAGES), count=1)
                p = _silu_step(s, rows, (j + 1) * BLOCK_N, lk, alpha, j + 1 >= n_full, CAUSAL, BLOCK_N, COL_L,
                               P_L, dtype, FAST)
                acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
                mbarrier.arrive(v_empty.index(cj % STAGES), count=1)
            cl = c + n_mine - 1
            mbarrier.wait(v_ready.index(cl % STAGES), (cl // STAGES) & 1)
            acc = warpgroup_mma(p, v_smem.index(cl % STAGES), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(v_empty.index(cl % STAGES), count=1)
            for j in range(n_mine, n_tiles):  # the other warpgroup's tiles: wait for each, release it
                cj = c + j
                mbarrier.wait(k_ready.index(cj % STAGES), (cj // STAGES) & 1)
                mbarrier.arrive(k_empty.index(cj % STAGES), count=1)
                mbarrier.wait(v_ready.index(cj % STAGES), (cj // STAGES) & 1)
                mbarrier.arrive(v_empty.index(cj % STAGES), count=1)

            out = (acc * inv_n).to(dtype)
            if row0 + 64 <= lq:
                # all 64 rows inside the sequence: through the warpgroup's query buffer (every S of the item is
                # done: no product reads it) and one asynchronous TMA store, as FA3's epilogue (the scratch of a
                # layout change would need 32 KiB per warpgroup beyond the 192 KiB of D = 256)
                q.store(out)
                fence_async_shared()
                gl.thread_barrier()  # the warpgroup's named barrier: every thread's part is in the buffer
                tma.async_copy_shared_to_global(o_desc, [(q_start + row0).to(gl.int32), (h * HEAD_D).to(gl.int32)],
                                                q)
                tma.store_wait(0)  # the buffer has been read: the loader may bring the next item's Q into it
            else:  # the sequence's last rows: masked 4-byte stores from the accumulator's layout
                d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, O_L))
                r = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, O_L))
                gl.store(O + (q_start + r[:, None].to(gl.int64)) * stride_ot + h * stride_oh + d[None, :], out,
                         mask=r[:, None] < lq)
            mbarrier.arrive(q_empty, count=1)
            c += n_tiles
            it += 1


# the launch's sizes are not specialized on (a new divisibility class of a batch's item count would compile again)
@gluon.jit(do_not_specialize=["n_tiles_q", "n_items", "total"])
def _ws_fwd_silu(q_desc, k_desc, v_desc, o_desc, O, Q_OFF, KV_OFF, WORK, stride_ot, stride_oh, alpha, inv_n,
                 n_tiles_q, n_items, total, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
                 STAGES: gl.constexpr, FAST: gl.constexpr):
    """The silu attention forward, warp-specialized: o = silu(alpha Q K^T) V / N over valid pairs. Work items i =
    head * n_items + table entry (jagged_attention._q_table's 128-row query tiles, -1 = no item), program p runs
    items p, p + grid, ...; two consumer warpgroups of 64 query rows (_silu_consumer_partition) and the softmax
    forward's TMA loader warp (_load_partition: the query tile once per item, key / value tiles of BLOCK_N rows
    through STAGES slots). Writes O [Tq, H, HEAD_D] (o_desc: its [Tq, H * HEAD_D] view in [64, HEAD_D] boxes, the
    query boxes' layout). Shared memory: Q [2, 64, HEAD_D] (also the output's staging buffers), K and V [STAGES,
    BLOCK_N, HEAD_D] (16-bit), mbarriers: 192 KiB at HEAD_D 256, BLOCK_N 64, STAGES 2."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, 64, HEAD_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(q_empty, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=2)
    gl.warp_specialize([
        (_silu_consumer_partition, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                                    o_desc, O, WORK, Q_OFF, KV_OFF, n_items, n_tiles_q, total, stride_ot, stride_oh,
                                    alpha, inv_n, 0, CAUSAL, BLOCK_N, HEAD_D, STAGES, FAST)),
        (_silu_consumer_partition, (q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty, v_ready, v_empty,
                                    o_desc, O, WORK, Q_OFF, KV_OFF, n_items, n_tiles_q, total, stride_ot, stride_oh,
                                    alpha, inv_n, 1, CAUSAL, BLOCK_N, HEAD_D, STAGES, FAST)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, k_empty,
                           v_ready, v_empty, WORK, Q_OFF, KV_OFF, n_items, n_tiles_q, total, CAUSAL, 2, BLOCK_N,
                           HEAD_D, STAGES))], [4, 1], [232, 40])


_KROWS = gl.constexpr(64)  # key rows per consumer warpgroup of the backward (a wgmma's M)


@gluon.jit
def _act_and_grad(s, FAST: gl.constexpr):
    """(silu(s), silu'(s)) of fp32 scores, as jagged_attention._act_and_grad's ACT 1: FAST (16-bit inputs) one
    tanh.approx.f32 per score (sigmoid = (1 + tanh(s / 2)) / 2), else the fast-division sigmoid."""
    h = 0.5 * s
    if FAST:
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [h], dtype=gl.float32, is_pure=True,
                                      pack=1)
        out = h * t + h
        grad = (0.5 + 0.5 * t) * (1.0 + h - h * t)
    else:
        sig = gl.fdiv(s * 0.0 + 1.0, 1.0 + gl.exp2(-1.4426950408889634 * s), ieee_rounding=False)
        out = s * sig
        grad = sig * (1.0 + s * (1.0 - sig))
    return out, grad


@gluon.jit
def _seq_tile(WORK, Q_OFF, KV_OFF, i, n_items, n_tiles):
    """Work item i of a backward launch over 128-row tiles (head-major: head i // n_items, table entry i %
    n_items = sequence * n_tiles + tile): (valid, head int64, first row r0 of the tile, q_start, lq, kv_start,
    lk)."""
    w = gl.load(WORK + i % n_items)
    h = (i // n_items).to(gl.int64)
    wv = gl.maximum(w, 0)
    b = wv // n_tiles
    r0 = (wv % n_tiles) * (2 * _KROWS)
    q_start = gl.load(Q_OFF + b)
    lq = (gl.load(Q_OFF + b + 1) - q_start).to(gl.int32)
    kv_start = gl.load(KV_OFF + b)
    lk = (gl.load(KV_OFF + b + 1) - kv_start).to(gl.int32)
    return w >= 0, h, r0, q_start, lq, kv_start, lk


@gluon.jit
def _key_item(WORK, Q_OFF, KV_OFF, i, n_items, n_tiles_k, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """Work item i of a key-tile launch (``_seq_tile``, 128 keys per tile): (valid, head int64, first key row n0,
    q_start, lq, kv_start, lk, first query row lo, number of query tiles of BLOCK_M rows to visit)."""
    valid, h, n0, q_start, lq, kv_start, lk = _seq_tile(WORK, Q_OFF, KV_OFF, i, n_items, n_tiles_k)
    lo = n0 * 0
    if CAUSAL:
        lo = (n0 // BLOCK_M) * BLOCK_M
    n_steps = gl.maximum(gl.cdiv(lq - lo, BLOCK_M), 0)
    return valid, h, n0, q_start, lq, kv_start, lk, lo, n_steps


@gluon.jit
def _bwd_load_partition(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, kv_empty,
                        q_ready, q_empty, do_ready, do_empty, WORK, Q_OFF, KV_OFF, n_items, n_tiles_k, total,
                        CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    """Loader warp of the backward: per work item the two consumers' key and value boxes (64 rows each) once the
    previous item's are released, then query tile j and dO tile j into slot c % STAGES (c counts the program's
    query steps across items) once both consumers released the slot's previous tiles."""
    c = 0
    it = 0
    for i in range(gl.program_id(0), total, gl.num_programs(0)):
        valid, h, n0, q_start, lq, kv_start, lk, lo, n_steps = _key_item(WORK, Q_OFF, KV_OFF, i, n_items,
                                                                          n_tiles_k, CAUSAL, BLOCK_M)
        if valid:
            col = (h * HEAD_D).to(gl.int32)
            kv_row = (kv_start + n0).to(gl.int32)
            q_row = (q_start + lo).to(gl.int32)
            mbarrier.wait(kv_empty, (it & 1) ^ 1)
            mbarrier.expect(kv_bar, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
            for w in gl.static_range(2):
                tma.async_copy_global_to_shared(k_desc, [kv_row + w * _KROWS, col], kv_bar, k_smem.index(w))
                tma.async_copy_global_to_shared(v_desc, [kv_row + w * _KROWS, col], kv_bar, v_smem.index(w))
            for j in range(n_steps):
                slot = (c + j) % STAGES
                phase = (((c + j) // STAGES) & 1) ^ 1
                _ring_copy(q_desc, q_row + j * BLOCK_M, col, q_ready, q_empty, q_smem, slot, phase)
                _ring_copy(do_desc, q_row + j * BLOCK_M, col, do_ready, do_empty, do_smem, slot, phase)
            c += n_steps
            it += 1


@gluon.jit
def _ds_tile_store(dst, ds_buf, ds_desc, DS_ROW_PTRS, key_ok, cols, lq, desc_row, m0, full_rows, dtype: gl.constexpr):
    """Write one dS^T tile [64, BLOCK_M] (fp32 registers, 0 where masked): with all 64 key rows inside the
    sequence, through the warpgroup's shared-memory buffer and an asynchronous TMA store into the [H * Tk, W] view
    (columns past lq receive the tile's zeros: they lie inside the row's W, which no reader takes unmasked);
    otherwise masked stores from registers (rows past lk belong to the next sequence: never written). The TMA
    store took the launch from 2.96 to 1.60 ms on a gem-h200 layer (H100, 2026-12-07): the registers' 4-byte
    stores of the accumulator layout were a third of its time."""
    if full_rows:
        tma.store_wait(0)  # the buffer's previous tile has left
        ds_buf.store(dst.to(dtype))
        fence_async_shared()
        gl.thread_barrier()  # the warpgroup's named barrier: every thread's part is in the buffer
        tma.async_copy_shared_to_global(ds_desc, [desc_row, m0], ds_buf)
    else:
        gl.store(DS_ROW_PTRS[:, None] + cols[None, :], dst.to(dtype), mask=key_ok[:, None] & (cols[None, :] < lq))


@gluon.jit
def _bwd_consumer_partition(q_smem, do_smem, k_smem, v_smem, ds_smem, kv_bar, kv_empty, q_ready, q_empty, do_ready,
                            do_empty, ds_desc, DS, DV, WORK, Q_OFF, KV_OFF, n_items, n_tiles_k, total, stride_dvt,
                            stride_dvh, stride_dsh, stride_dst, t_k, alpha, inv_n, WG: gl.constexpr,
                            CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr,
                            STAGES: gl.constexpr, FAST: gl.constexpr):
    """Consumer warpgroup WG: key rows [n0 + 64 WG, n0 + 64 WG + 64) of each work item. Steps whose pairs are
    all masked for this warpgroup (keys past the sequence's end; causal: every query before its first key) come
    first and only release their slots. Per live query step: S^T = K Q^T and dP^T = V dO^T (asynchronous), silu /
    silu' of S^T while dP^T runs, dS^T = dP^T silu'(S^T), dV += silu(S^T) dO (P^T from registers) and the dS^T
    tile's store beside the dV product; every product is waited for before the loop's back edge. The other
    warpgroup's products fill this one's pointwise gaps. Then dV / N to global memory (rows past the sequence's
    end are not written). Measured and lost (H100, 2026-12-07, one gem-h200 layer): issuing the next step's S^T /
    dP^T before this step's store (1.60 -> 2.13 ms) and 16-row steps in 4 slots that way (2.51 ms)."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    DV_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, HEAD_D, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=DV_L, k_width=2)
    ROW_L: gl.constexpr = gl.SliceLayout(1, S_L)
    COL_L: gl.constexpr = gl.SliceLayout(0, S_L)
    dtype: gl.constexpr = q_smem.dtype
    k = k_smem.index(WG)
    v = v_smem.index(WG)
    ds_buf = ds_smem.index(WG)
    s_zero = gl.zeros([_KROWS, BLOCK_M], gl.float32, S_L)
    c = 0
    it = 0
    for i in range(gl.program_id(0), total, gl.num_programs(0)):
        valid, h, n0, q_start, lq, kv_start, lk, lo, n_steps = _key_item(WORK, Q_OFF, KV_OFF, i, n_items,
                                                                          n_tiles_k, CAUSAL, BLOCK_M)
        if valid:
            nw = n0 + WG * _KROWS
            keys = nw + gl.arange(0, _KROWS, layout=ROW_L)
            key_ok = keys < lk
            full_rows = nw + _KROWS <= lk
            desc_row = (h * t_k + kv_start + nw).to(gl.int32)
            ds_rows = DS + h * stride_dsh + (kv_start + keys.to(gl.int64)) * stride_dst
            # leading steps with no valid pair for this warpgroup
            j0 = n_steps * 0
            if CAUSAL:
                j0 = gl.cdiv(gl.maximum(nw - lo - BLOCK_M + 1, 0), BLOCK_M)
            j0 = gl.where(nw < lk, gl.minimum(j0, n_steps), n_steps)
            dv = gl.zeros([_KROWS, HEAD_D], gl.float32, DV_L)
            mbarrier.wait(kv_bar, it & 1)
            for j in range(j0):
                cj = c + j
                mbarrier.wait(q_ready.index(cj % STAGES), (cj // STAGES) & 1)
                mbarrier.wait(do_ready.index(cj % STAGES), (cj // STAGES) & 1)
                mbarrier.arrive(q_empty.index(cj % STAGES), count=1)
                mbarrier.arrive(do_empty.index(cj % STAGES), count=1)
            for j in range(j0, n_steps):
                cj = c + j
                slot = cj % STAGES
                m0 = lo + j * BLOCK_M
                mbarrier.wait(q_ready.index(slot), (cj // STAGES) & 1)
                mbarrier.wait(do_ready.index(slot), (cj // STAGES) & 1)
                do = do_smem.index(slot)
                st = warpgroup_mma(k, q_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dpt = warpgroup_mma(v, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                st = warpgroup_mma_wait(1, deps=(st, ))
                mbarrier.arrive(q_empty.index(slot), count=1)
                pt, gt = _act_and_grad(st * alpha, FAST)
                cols = m0 + gl.arange(0, BLOCK_M, layout=COL_L)
                ok = key_ok[:, None] & (cols[None, :] < lq)
                if CAUSAL:
                    ok = ok & (keys[:, None] <= cols[None, :])
                dpt = warpgroup_mma_wait(0, deps=(dpt, ))
                dst = gl.where(ok, dpt * gt, 0.0)
                p_op = gl.convert_layout(gl.where(ok, pt, 0.0).to(dtype), P_L)
                dv = warpgroup_mma(p_op, do, dv, is_async=True)
                _ds_tile_store(dst, ds_buf, ds_desc, ds_rows, key_ok, cols, lq, desc_row, m0, full_rows, dtype)
                dv, p_op = warpgroup_mma_wait(0, deps=(dv, p_op))
                mbarrier.arrive(do_empty.index(slot), count=1)
            mbarrier.arrive(kv_empty, count=1)  # this item's K / V no longer read: the loader may bring the next
            tma.store_wait(0)
            dv = dv * inv_n
            d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, DV_L))
            r = nw + gl.arange(0, _KROWS, layout=gl.SliceLayout(1, DV_L))
            gl.store(DV + (kv_start + r[:, None].to(gl.int64)) * stride_dvt + h * stride_dvh + d[None, :],
                     dv.to(dtype), mask=r[:, None] < lk)
            c += n_steps
            it += 1


# the launch's sizes are not specialized on (each new divisibility class of a batch's T / item count would compile
# the kernel again in the middle of training: a 1.2 s step in the first gem-h200 run, 2026-12-07)
@gluon.jit(do_not_specialize=["t_k", "n_tiles_k", "n_items", "total"])
def _ws_dv_ds(q_desc, do_desc, k_desc, v_desc, ds_desc, DS, DV, Q_OFF, KV_OFF, WORK, stride_dvt, stride_dvh,
              stride_dsh, stride_dst, t_k, alpha, inv_n, n_tiles_k, n_items, total, CAUSAL: gl.constexpr,
              BLOCK_M: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, FAST: gl.constexpr):
    """The silu attention backward's dV + dS^T launch, warp-specialized (the regime's dk_from_ds path: dQ and dK
    come from the stored dS^T in jagged_attention._gdpa_dq_ds / _gdpa_dk_ds). Work item i = head * n_items +
    key-tile table entry (128 keys: two consumer warpgroups of 64 key rows and a TMA loader warp streaming
    query / dO tiles of BLOCK_M rows through STAGES slots). Writes dS^T (unscaled, 0 where masked) of every
    pair the item visits into DS [H, Tk, W] (rows past lk not written; ds_desc: its [H * Tk, W] view in [64,
    BLOCK_M] boxes) and dV / N into DV."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_M, HEAD_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BLOCK_M, HEAD_D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, _KROWS, HEAD_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, _KROWS, HEAD_D], v_desc.layout)
    ds_smem = gl.allocate_shared_memory(ds_desc.dtype, [2, _KROWS, BLOCK_M], ds_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_empty, count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
        mbarrier.init(do_ready.index(i), count=1)
        mbarrier.init(do_empty.index(i), count=2)
    gl.warp_specialize([
        (_bwd_consumer_partition, (q_smem, do_smem, k_smem, v_smem, ds_smem, kv_bar, kv_empty, q_ready, q_empty,
                                   do_ready, do_empty, ds_desc, DS, DV, WORK, Q_OFF, KV_OFF, n_items, n_tiles_k,
                                   total, stride_dvt, stride_dvh, stride_dsh, stride_dst, t_k, alpha, inv_n, 0,
                                   CAUSAL, BLOCK_M, HEAD_D, STAGES, FAST)),
        (_bwd_consumer_partition, (q_smem, do_smem, k_smem, v_smem, ds_smem, kv_bar, kv_empty, q_ready, q_empty,
                                   do_ready, do_empty, ds_desc, DS, DV, WORK, Q_OFF, KV_OFF, n_items, n_tiles_k,
                                   total, stride_dvt, stride_dvh, stride_dsh, stride_dst, t_k, alpha, inv_n, 1,
                                   CAUSAL, BLOCK_M, HEAD_D, STAGES, FAST)),
        (_bwd_load_partition, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, kv_empty,
                               q_ready, q_empty, do_ready, do_empty, WORK, Q_OFF, KV_OFF, n_items, n_tiles_k, total,
                               CAUSAL, BLOCK_M, HEAD_D, STAGES))], [4, 1], [232, 40])


@gluon.jit
def _gemm_item(WORK, Q_OFF, KV_OFF, i, n_items, n_tiles, DQ: gl.constexpr, CAUSAL: gl.constexpr):
    """Work item i of a dS^T product launch: (valid, head int64, first output row r0 of its 128 rows (keys for dK,
    queries for dQ), q_start, lq, kv_start, lk, steps of 64 reduction rows, first step row lo). dK: the key
    tile's query steps from lo = r0 (causal) to lq; dQ: the query tile's key steps from 0 to min(lk, r0 + 128)
    (causal)."""
    valid, h, r0, q_start, lq, kv_start, lk = _seq_tile(WORK, Q_OFF, KV_OFF, i, n_items, n_tiles)
    lo = r0 * 0
    if DQ:
        hi = lk
        if CAUSAL:
            hi = gl.minimum(hi, r0 + 2 * _KROWS)
    else:
        hi = lq
        if CAUSAL:
            lo = r0
    n_steps = gl.maximum(gl.cdiv(hi - lo, _KROWS), 0)
    return valid, h, r0, q_start, lq, kv_start, lk, n_steps, lo


@gluon.jit
def _gemm_load_partition(b_desc, b_smem, a_smem, ready, empty, DS, WORK, Q_OFF, KV_OFF, stride_dsh, stride_dst,
                         n_items, n_tiles, total, DQ: gl.constexpr, CAUSAL: gl.constexpr, HEAD_D: gl.constexpr,
                         STAGES: gl.constexpr, A_LAYOUT: gl.constexpr):
    """Loader warp of the dS^T products: per item a tensor descriptor of the (head, sequence)'s dS^T block [lk,
    lq] made on the device (TMA reads rows past lk and columns past lq as zeros: no mask in the consumers), then
    per step the two consumers' dS^T boxes [64, 64] and the step's 64 rows of B (queries for dK, keys for dQ,
    through the host descriptor of the whole tensor) into slot c % STAGES once both consumers released it."""
    c = 0
    for i in range(gl.program_id(0), total, gl.num_programs(0)):
        valid, h, r0, q_start, lq, kv_start, lk, n_steps, lo = _gemm_item(WORK, Q_OFF, KV_OFF, i, n_items,
                                                                          n_tiles, DQ, CAUSAL)
        if valid:
            ds_desc = tma.make_tensor_descriptor(DS + h * stride_dsh + kv_start * stride_dst,
                                                 [gl.maximum(lk, 1), gl.maximum(lq, 1)], [stride_dst, 1],
                                                 [_KROWS, _KROWS], A_LAYOUT)
            col = (h * HEAD_D).to(gl.int32)
            if DQ:
                b_row = kv_start.to(gl.int32)
            else:
                b_row = (q_start + lo).to(gl.int32)
            for j in range(n_steps):
                slot = (c + j) % STAGES
                mbarrier.wait(empty.index(slot), (((c + j) // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(slot), b_desc.block_type.nbytes + 2 * ds_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(b_desc, [b_row + j * _KROWS, col], ready.index(slot),
                                                b_smem.index(slot))
                for w in gl.static_range(2):
                    if DQ:  # keys of step j, the warpgroup's 64 queries
                        coord = [j * _KROWS, r0 + w * _KROWS]
                    else:  # the warpgroup's 64 keys, queries of step j
                        coord = [r0 + w * _KROWS, lo + j * _KROWS]
                    tma.async_copy_global_to_shared(ds_desc, coord, ready.index(slot), a_smem.index(2 * slot + w))
            c += n_steps


@gluon.jit
def _gemm_consumer_partition(b_smem, a_smem, ready, empty, OUT, WORK, Q_OFF, KV_OFF, n_items, n_tiles, total,
                             stride_ot, stride_oh, scale, WG: gl.constexpr, DQ: gl.constexpr, CAUSAL: gl.constexpr,
                             HEAD_D: gl.constexpr, STAGES: gl.constexpr):
    """Consumer warpgroup WG: output rows [r0 + 64 WG, r0 + 64 WG + 64) of each item, acc [64, D] fp32 in
    registers. dK: acc += dS^T box [64 keys, 64 queries] @ Q [64, D]; dQ: acc += (dS^T box [64 keys, 64
    queries])^T @ K [64, D] (the box's transpose read by the wgmma from shared memory). One product in flight
    across steps: a slot is released once the product after it is issued and its own has completed. Steps with
    no valid pair for this warpgroup (causal: dK's query steps before its first key, dQ's key steps after its
    last query) only release their slots; every box a live step reads was written by backward_dv_ds (its
    warpgroups write dS^T of each 64-key row block from the block's first key on) or is TMA's zero fill."""
    ACC_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, HEAD_D, 16])
    dtype: gl.constexpr = b_smem.dtype
    c = 0
    for i in range(gl.program_id(0), total, gl.num_programs(0)):
        valid, h, r0, q_start, lq, kv_start, lk, n_steps, lo = _gemm_item(WORK, Q_OFF, KV_OFF, i, n_items,
                                                                          n_tiles, DQ, CAUSAL)
        if valid:
            rw = r0 + WG * _KROWS
            j0 = n_steps * 0
            j1 = n_steps
            if DQ:
                live = rw < lq
                if CAUSAL:
                    j1 = gl.minimum(j1, rw // _KROWS + 1)
            else:
                live = rw < lk
                if CAUSAL:  # (a query tile shorter than the key tile: none of its steps may be live)
                    j0 = gl.minimum((rw - lo) // _KROWS, n_steps)
            j1 = gl.where(live, j1, j0)
            acc = gl.zeros([_KROWS, HEAD_D], gl.float32, ACC_L)
            for j in range(j0):  # before the live steps
                cj = c + j
                mbarrier.wait(ready.index(cj % STAGES), (cj // STAGES) & 1)
                mbarrier.arrive(empty.index(cj % STAGES), count=1)
            for j in range(j0, j1):
                cj = c + j
                slot = cj % STAGES
                mbarrier.wait(ready.index(slot), (cj // STAGES) & 1)
                a = a_smem.index(2 * slot + WG)
                if DQ:
                    a = a.permute((1, 0))
                acc = warpgroup_mma(a, b_smem.index(slot), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc, ))
                if j > j0:
                    mbarrier.arrive(empty.index((cj - 1) % STAGES), count=1)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            if j1 > j0:
                mbarrier.arrive(empty.index((c + j1 - 1) % STAGES), count=1)
            for j in range(j1, n_steps):  # after them
                cj = c + j
                mbarrier.wait(ready.index(cj % STAGES), (cj // STAGES) & 1)
                mbarrier.arrive(empty.index(cj % STAGES), count=1)
            if DQ:
                row_start = q_start
                n_rows = lq
            else:
                row_start = kv_start
                n_rows = lk
            d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, ACC_L))
            r = rw + gl.arange(0, _KROWS, layout=gl.SliceLayout(1, ACC_L))
            gl.store(OUT + (row_start + r[:, None].to(gl.int64)) * stride_ot + h * stride_oh + d[None, :],
                     (acc * scale).to(dtype), mask=r[:, None] < n_rows)
            c += n_steps


@gluon.jit(do_not_specialize=["stride_dsh", "n_tiles", "n_items", "total"])
def _ws_ds_gemm(b_desc, DS, OUT, WORK, Q_OFF, KV_OFF, stride_dsh, stride_dst, stride_ot, stride_oh, scale,
                n_tiles, n_items, total, DQ: gl.constexpr, CAUSAL: gl.constexpr, HEAD_D: gl.constexpr,
                STAGES: gl.constexpr, A_LAYOUT: gl.constexpr):
    """dK = scale * dS^T Q (DQ false) or dQ = scale * dS K (DQ true) from the dS^T [H, Tk, W] that _ws_dv_ds
    stored: one jagged, causally blocked GEMM per (head, sequence), 128 output rows a work item (two consumer
    warpgroups of 64) and a TMA loader warp streaming 64-row steps of dS^T boxes and B rows through STAGES slots.
    Replaces jagged_attention._gdpa_dk_ds / _gdpa_dq_ds (one warpgroup, no producer) on the ws_bwd path."""
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, _KROWS, HEAD_D], b_desc.layout)
    a_smem = gl.allocate_shared_memory(b_desc.dtype, [2 * STAGES, _KROWS, _KROWS], A_LAYOUT)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize([
        (_gemm_consumer_partition, (b_smem, a_smem, ready, empty, OUT, WORK, Q_OFF, KV_OFF, n_items, n_tiles,
                                    total, stride_ot, stride_oh, scale, 0, DQ, CAUSAL, HEAD_D, STAGES)),
        (_gemm_consumer_partition, (b_smem, a_smem, ready, empty, OUT, WORK, Q_OFF, KV_OFF, n_items, n_tiles,
                                    total, stride_ot, stride_oh, scale, 1, DQ, CAUSAL, HEAD_D, STAGES)),
        (_gemm_load_partition, (b_desc, b_smem, a_smem, ready, empty, DS, WORK, Q_OFF, KV_OFF, stride_dsh,
                                stride_dst, n_items, n_tiles, total, DQ, CAUSAL, HEAD_D, STAGES, A_LAYOUT))],
        [4, 1], [232, 40])


def supports(device_type: str, capability: tuple[int, int], act: int, plain: bool, dtype: torch.dtype,
             dims: tuple[int, int, int], strides: tuple[tuple[int, int, int], ...], aligned: bool) -> bool:
    """The rule behind ``eligible`` (pure, testable without a GPU): a CUDA device of compute capability 9.0
    (wgmma and TMA as compiled here), softmax (act 0, ``forward``: head dims 64 / 128) or silu (act 1,
    ``forward_silu``: head dims 128 / 256) over ``plain`` rows (the caller's check: full rows without targets,
    bias, prefix, block, window or PMA), bf16 / fp16, the head dims of q, k and v equal, each tensor's strides
    (token, head, dim) with unit dim stride, contiguous heads (head stride = D) and 16-byte aligned rows, and
    ``aligned`` 16-byte base addresses (TMA's rules)."""
    d = dims[0]
    if device_type != "cuda" or tuple(capability) != (9, 0) or act not in _FWD_DIMS or not plain:
        return False
    if dtype not in (torch.bfloat16, torch.float16) or d not in _FWD_DIMS[act] or any(x != d for x in dims):
        return False
    return aligned and all(st[2] == 1 and st[1] == d and (st[0] * 2) % 16 == 0 for st in strides)


_FWD_DIMS = {0: (64, 128), 1: (128, 256)}  # the forwards' head dims by activation (softmax, silu)


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, act: int, plain: bool) -> bool:
    """Whether a forward of this module can run the call (``supports`` on the tensors' device, dtype, shapes,
    strides and addresses): ``forward`` for softmax (act 0), ``forward_silu`` for silu (act 1); q: [Tq, H, D], k /
    v: [Tk, H, D]."""
    if q.device.type != "cuda" or k.shape[0] == 0:  # a TMA descriptor needs >= 1 row
        return False
    if act == 1 and q.shape[0] == 0:  # (the silu forward reads queries through a descriptor too)
        return False
    return supports(q.device.type, _capability(q.device), act, plain, q.dtype,
                    (q.shape[2], k.shape[2], v.shape[2]), (q.stride(), k.stride(), v.stride()),
                    all(x.data_ptr() % 16 == 0 for x in (q, k, v)) and q.dtype == k.dtype == v.dtype)


def silu_tiles_fit(d: int, tiles: tuple[int, int]) -> bool:
    """Whether ``forward_silu`` compiles tiles = (BLOCK_N, STAGES) at head dim ``d`` within sm_90's limits: BLOCK_N
    64 or 128 with the score tile [64, BLOCK_N] and the accumulator [64, d] (fp32, 128 threads) within 128 * 128
    values a thread's worth (at d = 256 only BLOCK_N = 64: with 128 the consumer's 232 registers would spill), and
    the shared memory of the query tile [128, d] and STAGES key + value slots [BLOCK_N, d] (16-bit) plus 1 KiB of
    barriers under the 232,448-byte limit (d = 256: BLOCK_N 64 with 2 stages = 192 KiB). sm_90 compiles (triton
    3.6, ``python -m gemray.bench.sass_check --ws``): no spills with BLOCK_N 64; BLOCK_N 128 at d = 128 keeps 12
    bytes in local memory across the partitions (stored at entry, reloaded after the key loop, none in it)."""
    block_n, stages = tiles
    if block_n not in (64, 128) or stages < 1 or block_n * d > 128 * 128:
        return False
    return 2 * (128 * d + 2 * stages * block_n * d) + 1024 <= 232448


@functools.lru_cache(maxsize=16)
def _capability(device: torch.device) -> tuple[int, int]:
    """The device's compute capability, once per device (asked on every forward)."""
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=16)
def _smem_layout(rows: int, d: int, bf16: bool):
    """The shared-memory layout of a [rows, d] 16-bit box (the widest swizzle its rows allow: 128 bytes for d >=
    64), built once per shape."""
    return gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16 if bf16 else gl.float16)


def _desc(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """Descriptor of x [T, H, D] as the 2-D [T, H * D] view, [rows, D] boxes, 128-byte swizzle."""
    t, h, d = x.shape
    layout = _smem_layout(rows, d, x.dtype == torch.bfloat16)
    return TensorDescriptor(x, [t, h * d], [x.stride(0), 1], [rows, d], layout)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
            q_off: torch.Tensor, kv_off: torch.Tensor, table: torch.Tensor, n_tiles_q: int, causal: bool,
            alpha: float, tiles: tuple[int, int, int, bool, bool]) -> None:
    """Launch the forward on one work table.

    q: [Tq, H, D], k / v: [Tk, H, D] (bf16 or fp16, ``eligible``); o: [Tq, H, D] output (written where
    rows exist); lse: [H, Tq] fp32 (base 2, row stride Tq); q_off / kv_off: [B+1] int64; table:
    [items] int32 from ``jagged_attention._q_table`` with BLOCK_M = 64 * tiles[0]; n_tiles_q: its tiles
    per sequence; alpha: score scale (> 0); tiles: (consumer warpgroups 1 | 2, BLOCK_N, STAGES, ping-pong,
    persistent: one program per SM looping over the items instead of one program per item).
    """
    num_wg, block_n, stages, pingpong, persistent = tiles
    h, d = q.shape[1], q.shape[2]
    total = table.numel() * h
    grid = min(total, _num_sms(q.device)) if persistent else total
    _ws_fwd[(grid,)](
        _desc(q, _ROWS), _desc(k, block_n), _desc(v, block_n), o, lse, q_off, kv_off, table,
        o.stride(0), o.stride(1), lse.stride(0), alpha * 1.4426950408889634, n_tiles_q, table.numel(), total,
        CAUSAL=causal, NUM_WG=num_wg, BLOCK_N=block_n, HEAD_D=d, STAGES=stages, PINGPONG=bool(pingpong),
        num_warps=4)


def forward_silu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, q_off: torch.Tensor,
                 kv_off: torch.Tensor, table: torch.Tensor, n_tiles_q: int, causal: bool, alpha: float,
                 inv_n: float, tiles: tuple[int, int], fast: bool = True) -> None:
    """Launch the warp-specialized silu forward on one work table: o[i] = sum over valid keys j of silu(alpha q_i .
    k_j) / N v_j (valid: j < lk and, causal, j <= i), P rounded to the inputs' dtype before its product with V, as
    jagged_attention._gdpa_fwd with ACT 1; no lse.

    q: [Tq, H, D], k / v: [Tk, H, D] (bf16 or fp16, D 128 or 256, ``eligible`` with act 1); o: [Tq, H, D] output
    (each sequence's rows written, a row with no valid key gets 0; unit dim stride); q_off / kv_off: [B+1] int64;
    table: [items] int32 from ``jagged_attention._q_table`` with BLOCK_M = 128 (``SILU_ROWS``), n_tiles_q its tiles
    per sequence; alpha: score scale; inv_n: the 1/N factor; tiles: (BLOCK_N, STAGES) (``silu_tiles_fit``); fast:
    tanh.approx silu (16-bit inputs, as the Triton forward's FAST). One program per work item.
    """
    block_n, stages = tiles
    h, d = q.shape[1], q.shape[2]
    total = table.numel() * h
    _ws_fwd_silu[(total,)](
        _desc(q, _ROWS), _desc(k, block_n), _desc(v, block_n), _desc(o, _ROWS), o, q_off, kv_off, table, o.stride(0),
        o.stride(1), float(alpha), float(inv_n), n_tiles_q, table.numel(), total, CAUSAL=causal, BLOCK_N=block_n,
        HEAD_D=d, STAGES=stages, FAST=bool(fast), num_warps=4)


SILU_ROWS = 2 * _ROWS  # query rows per work item of forward_silu (two consumer warpgroups of 64)


def supports_bwd(device_type: str, capability: tuple[int, int], act: int, plain: bool, dtype: torch.dtype,
                 dims: tuple[int, int, int], strides: tuple[tuple[int, int, int], ...], aligned: bool) -> bool:
    """The rule behind ``eligible_bwd`` (pure, testable without a GPU): as ``supports`` but for the silu (act 1)
    backward's dV + dS^T launch, head dims all 128 or all 256 (two 64-row key / value boxes and STAGES query /
    dO slots in shared memory)."""
    d = dims[0]
    if device_type != "cuda" or tuple(capability) != (9, 0) or act != 1 or not plain:
        return False
    if dtype not in (torch.bfloat16, torch.float16) or d not in (128, 256) or any(x != d for x in dims):
        return False
    return aligned and all(st[2] == 1 and st[1] == d and (st[0] * 2) % 16 == 0 for st in strides)


def eligible_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, act: int,
                 plain: bool) -> bool:
    """Whether ``backward_dv_ds`` can run the call (``supports_bwd`` on the tensors); q / do: [Tq, H, D], k / v:
    [Tk, H, D]."""
    xs = (q, k, v, do)
    if q.device.type != "cuda" or k.shape[0] == 0 or q.shape[0] == 0:  # a TMA descriptor needs >= 1 row
        return False
    return supports_bwd(q.device.type, _capability(q.device), act, plain, q.dtype,
                        (q.shape[2], k.shape[2], v.shape[2]), tuple(x.stride() for x in xs),
                        all(x.data_ptr() % 16 == 0 for x in xs) and all(x.dtype == q.dtype for x in xs))


def backward_dv_ds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, dv: torch.Tensor,
                   ds: torch.Tensor, q_off: torch.Tensor, kv_off: torch.Tensor, table: torch.Tensor,
                   n_tiles_k: int, causal: bool, alpha: float, inv_n: float, tiles: tuple[int, int],
                   fast: bool = True) -> None:
    """Launch the warp-specialized dV + dS^T part of the silu backward on one work table.

    q / do: [Tq, H, D], k / v: [Tk, H, D] (bf16 or fp16, ``eligible_bwd``); dv: [Tk, H, D] output (rows of each
    sequence written, unit dim stride); ds: [H, Tk, W] scratch (W >= max query length; unit column stride) that
    receives dS^T = dP^T silu'(alpha S^T) (0 where masked) for _gdpa_dq_ds / _gdpa_dk_ds; q_off / kv_off: [B+1]
    int64; table: [items] int32 key-tile table of 128-key tiles (``jagged_attention._k_table``), n_tiles_k its
    tiles per sequence; alpha: score scale; inv_n: the 1/N factor applied to dV; tiles: (BLOCK_M query rows per
    step, STAGES slots); fast: tanh.approx silu (16-bit inputs).
    """
    bm, stages = tiles
    h, d = q.shape[1], q.shape[2]
    total = table.numel() * h
    t_k = k.shape[0]
    ds2 = ds.view(h * t_k, ds.shape[2])
    ds_desc = TensorDescriptor(ds2, list(ds2.shape), [ds2.stride(0), 1], [_ROWS, bm],
                               _smem_layout(_ROWS, bm, ds.dtype == torch.bfloat16))
    _ws_dv_ds[(total,)](
        _desc(q, bm), _desc(do, bm), _desc(k, 64), _desc(v, 64), ds_desc, ds, dv, q_off, kv_off, table,
        dv.stride(0), dv.stride(1), ds.stride(0), ds.stride(1), t_k, float(alpha), float(inv_n), n_tiles_k,
        table.numel(), total, CAUSAL=causal, BLOCK_M=bm, HEAD_D=d, STAGES=stages, FAST=bool(fast),
        num_warps=4)


def ds_gemm(ds: torch.Tensor, b: torch.Tensor, out: torch.Tensor, q_off: torch.Tensor, kv_off: torch.Tensor,
            table: torch.Tensor, n_tiles: int, dq: bool, causal: bool, scale: float, stages: int) -> None:
    """Launch dK = scale * dS^T Q (``dq`` false) or dQ = scale * dS K (``dq`` true) from the dS^T that
    ``backward_dv_ds`` stored, warp-specialized (two consumer warpgroups of 64 output rows, a TMA loader warp).

    ds: [H, Tk, W] (W a multiple of 64, unit column stride), the dS^T scratch ``backward_dv_ds`` wrote: only
    entries it wrote are read (each 64-key row block from its first key on; rows past lk / columns past lq come
    as zeros through a per-(head, sequence) descriptor made on the device, so the caller must have set Triton's
    allocator); b: queries [Tq, H, D] for dK, keys [Tk, H, D] for dQ (``eligible_bwd``'s layout rules); out:
    [Tk, H, D] dK or [Tq, H, D] dQ (unit dim stride; each sequence's rows written); q_off / kv_off: [B+1] int64;
    table: [items] int32 of 128-row tiles (dK: ``jagged_attention._k_table`` with BWD_KEYS, as
    ``backward_dv_ds``'s; dQ: ``_q_table`` with 128 rows), ``n_tiles`` its tiles per sequence; scale: the
    gradient's factor (alpha / N for silu); stages: ring slots (48 KiB each at D = 256).
    """
    h, d = b.shape[1], b.shape[2]
    total = table.numel() * h
    _ws_ds_gemm[(total,)](
        _desc(b, 64), ds, out, table, q_off, kv_off, ds.stride(0), ds.stride(1), out.stride(0), out.stride(1),
        float(scale), n_tiles, table.numel(), total, DQ=bool(dq), CAUSAL=causal, HEAD_D=d, STAGES=stages,
        A_LAYOUT=_smem_layout(64, 64, b.dtype == torch.bfloat16), num_warps=4)


BWD_KEYS = 2 * 64  # key rows per work item of backward_dv_ds (two consumer warpgroups of 64)


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_m(tiles: tuple) -> int:
    """Query rows per work item of a tile choice (64 per consumer warpgroup)."""
    return _ROWS * tiles[0]


__all__ = ["BWD_KEYS", "SILU_ROWS", "backward_dv_ds", "block_m", "ds_gemm", "eligible", "eligible_bwd", "forward",
           "forward_silu", "silu_tiles_fit", "supports", "supports_bwd"]
