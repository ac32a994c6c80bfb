"""HSTUEncoder (jagged, through gemray.ops) against the same math written padded [B, N, D] with explicit masks."""

import math

import pytest
import torch
import torch.nn.functional as F

from gemray.config import ModelConfig
from gemray.jagged import jagged_to_padded, lengths_to_offsets, padded_to_jagged
from gemray.model.hstu import HSTUEncoder


def padded_encoder(enc: HSTUEncoder, tok: torch.Tensor, offsets: torch.Tensor, ts: torch.Tensor, N: int):
    """Dense re-statement of HSTU: x [B, N, D], mask [B, N, N] from lengths, bias from a python lookup."""
    cfg = enc.cfg
    lengths = offsets[1:] - offsets[:-1]
    B, D, H, A, V = lengths.numel(), cfg.width, cfg.num_heads, cfg.attention_dim, cfg.linear_dim
    x = jagged_to_padded(tok, offsets, N) * math.sqrt(D) + enc.pos_emb[:N].unsqueeze(0)
    tsp = jagged_to_padded(ts.view(-1, 1), offsets, N).view(B, N)
    i = torch.arange(N)
    valid = (i.view(1, N, 1) >= i.view(1, 1, N)) & (i.view(1, 1, N) < lengths.view(B, 1, 1)) \
        & (i.view(1, N, 1) < lengths.view(B, 1, 1))                                   # [B, N, N]
    # buckets spelled out: position |i-j| (exact when num_position_buckets >= N), time floor(ln|dt|/0.301)
    dist = (i.view(N, 1) - i.view(1, N)).abs().clamp(max=cfg.num_position_buckets - 1)
    dt = (tsp.unsqueeze(2) - tsp.unsqueeze(1)).abs().double().clamp(min=1)
    tb = (torch.log(dt) / 0.301).floor().long().clamp(0, cfg.num_time_buckets - 1)
    for blk in enc.blocks:
        xn = F.layer_norm(x, (D,), eps=1e-6)
        h = F.silu(xn @ blk.uvqk_weight + blk.uvqk_bias)
        u, v, q, k = torch.split(h, [H * V, H * V, H * A, H * A], -1)
        q = q.view(B, N, H, A).permute(0, 2, 1, 3)
        k = k.view(B, N, H, A).permute(0, 2, 1, 3)
        v = v.view(B, N, H, V).permute(0, 2, 1, 3)
        rab = blk.rel_bias.pos_w[dist].unsqueeze(0) + blk.rel_bias.ts_w[tb]           # [B, N, N]
        a = F.silu(q @ k.transpose(-1, -2) + rab.unsqueeze(1)) / enc.max_seq_len * valid.unsqueeze(1)
        o = (a @ v).permute(0, 2, 1, 3).reshape(B, N, H * V)
        y = F.layer_norm(o, (H * V,), eps=1e-6) * u
        x = x + y @ blk.o_weight.T + blk.o_bias
    return padded_to_jagged(F.normalize(x, dim=-1, eps=1e-6), offsets)


@pytest.mark.parametrize("lengths", [[3, 0, 1, 12, 5], [1], [12, 7, 12], [0, 0, 4]])
def test_encoder_matches_padded_dense(lengths):
    N = 12
    cfg = ModelConfig(embedding_dim=8, num_blocks=2, num_heads=2, attention_dim=3, linear_dim=4, dropout=0.0,
                      num_position_buckets=16, num_time_buckets=64, attention_backend="reference")
    torch.manual_seed(0)
    enc = HSTUEncoder(cfg, max_seq_len=N).double()
    with torch.no_grad():  # non-trivial biases and relative weights so every parameter matters
        for blk in enc.blocks:
            blk.uvqk_bias.normal_(std=0.3)
            blk.o_bias.normal_(std=0.3)
            blk.rel_bias.pos_w.normal_(std=0.5)
            blk.rel_bias.ts_w.normal_(std=0.5)
            blk.uvqk_weight.normal_(std=0.5)
    offsets = lengths_to_offsets(torch.tensor(lengths))
    T = int(offsets[-1])
    g = torch.Generator().manual_seed(1)
    tok = torch.randn(T, 8, generator=g, dtype=torch.float64, requires_grad=True)
    ts = torch.cumsum(torch.randint(0, 10 ** 6, (T,), generator=g), 0)

    out = enc(tok, offsets, ts)
    exp = padded_encoder(enc, tok, offsets, ts, N)
    assert out.shape == (T, 8)
    torch.testing.assert_close(out, exp, rtol=1e-10, atol=1e-12)
    if T:
        assert torch.allclose(out.norm(dim=-1), torch.ones(T, dtype=torch.float64))

    w = torch.randn(T, 8, generator=g, dtype=torch.float64)
    params = [tok] + list(enc.parameters())
    g1 = torch.autograd.grad((out * w).sum(), params, allow_unused=True)
    g2 = torch.autograd.grad((exp * w).sum(), params, allow_unused=True)
    names = ["tok"] + [n for n, _ in enc.named_parameters()]
    for name, a, b in zip(names, g1, g2):
        if b is None:
            continue
        assert a is not None, name
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"grad of {name}")
    if T > 1:
        assert g1[names.index("blocks.0.rel_bias.ts_w")].abs().sum() > 0


def test_encoder_is_causal():
    cfg = ModelConfig(embedding_dim=8, num_blocks=2, num_heads=2, attention_dim=3, linear_dim=4, dropout=0.0)
    enc = HSTUEncoder(cfg, max_seq_len=10)
    offsets = torch.tensor([0, 6])
    tok = torch.randn(6, 8)
    ts = torch.arange(6) * 100
    a = enc(tok, offsets, ts)
    tok2 = tok.clone()
    tok2[4:] = torch.randn(2, 8)
    b = enc(tok2, offsets, ts)
    torch.testing.assert_close(a[:4], b[:4])
    assert not torch.allclose(a[4:], b[4:])


def test_encoder_rejects_too_long():
    cfg = ModelConfig(embedding_dim=8, num_blocks=1, num_heads=2, attention_dim=3, linear_dim=4)
    enc = HSTUEncoder(cfg, max_seq_len=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        enc(torch.randn(5, 8), torch.tensor([0, 5]), torch.arange(5))


def test_relative_bias_off_has_no_bias_and_ignores_time():
    """model.relative_bias = false: the blocks hold no rab^{p,t} parameters and the output no longer depends on the
    timestamps (with the bias on, it does: the check can fail)."""
    kw = dict(embedding_dim=8, num_blocks=2, num_heads=2, attention_dim=3, linear_dim=4, dropout=0.0)
    offsets, tok = torch.tensor([0, 2, 6]), torch.randn(6, 8)
    ts_a, ts_b = torch.arange(6) * 100, torch.arange(6) * 100_000
    torch.manual_seed(0)
    on = HSTUEncoder(ModelConfig(**kw), max_seq_len=10)
    torch.manual_seed(0)
    off = HSTUEncoder(ModelConfig(**kw, relative_bias=False), max_seq_len=10)
    assert all(b.rel_bias is None for b in off.blocks)
    assert not any("rel_bias" in n for n, _ in off.named_parameters())
    assert any("rel_bias" in n for n, _ in on.named_parameters())
    torch.testing.assert_close(off(tok, offsets, ts_a), off(tok, offsets, ts_b))
    assert not torch.allclose(on(tok, offsets, ts_a), on(tok, offsets, ts_b))
    off.init_weights()  # skips the absent bias


def test_kernel_tiles_reach_the_blocks(tmp_path):
    """model.kernel_tiles (inline JSON or a file) becomes the KernelConfig every block's self-attention is called
    with; "" is the kernels' DEFAULT; bad values are refused naming model.kernel_tiles."""
    from gemray.kernels.config import DEFAULT

    spec = ('{"medium": {"fwd_silu": {"256": [64, 64, 4, 2]}, "mode": {"ds_store": false}}, '
            '"long": {"dk_ds": {"256": [32, 128, 8, 2]}, "mode": {"dk_from_ds": true}}}')
    f = tmp_path / "tiles.json"
    f.write_text(spec)
    for value in (spec, str(f)):
        enc = HSTUEncoder(ModelConfig(embedding_dim=16, num_blocks=2, num_heads=2, attention_dim=8, linear_dim=8,
                                      kernel_tiles=value), max_seq_len=32)
        cfgs = {id(b.kernel_config) for b in enc.blocks}
        assert len(cfgs) == 1
        kc = enc.blocks[0].kernel_config
        assert kc.medium.tiles.get("fwd_silu", 256) == (64, 64, 4, 2) and not kc.medium.ds_store
        assert kc.long.dk_from_ds and kc.long.ds_store and kc.long.tiles.get("dk_ds", 256) == (32, 128, 8, 2)
        assert kc.long.tiles.get("dkdv_ds", 256) == DEFAULT.long.tiles.get("dkdv_ds", 256) and not kc.medium.dk_from_ds
        assert kc.xlong == DEFAULT.xlong and kc.name != DEFAULT.name
    assert HSTUEncoder(ModelConfig(embedding_dim=16, num_blocks=1, num_heads=2, attention_dim=8, linear_dim=8),
                       max_seq_len=32).blocks[0].kernel_config is DEFAULT
    for bad, why in (('{"huge": {}}', "unknown regime"), ('{"long": {"fwd": {"96": [64, 64, 4, 2]}}}', "bucket"),
                     ('{"long": {"fwd": {"128": [64, 64, 4]}}}', "BLOCK_M"), ("{", "malformed inline JSON"),
                     (str(tmp_path / "missing.json"), "is neither a JSON file")):
        with pytest.raises(ValueError, match=f"model.kernel_tiles.*{why}"):
            HSTUEncoder(ModelConfig(embedding_dim=16, num_blocks=1, num_heads=2, attention_dim=8, linear_dim=8,
                                    kernel_tiles=bad), max_seq_len=32)


def _residual_run(fp32_residual: bool, autocast: bool):
    """One encoder forward / backward on a random jagged batch (an empty and a length-1 sequence among them):
    (the dtypes each block received, output, grad of the input tokens, grad of block 0's uvqk weight)."""
    cfg = ModelConfig(embedding_dim=16, num_blocks=3, num_heads=2, attention_dim=8, linear_dim=8, dropout=0.0,
                      attention_backend="reference", fp32_residual=fp32_residual)
    torch.manual_seed(0)
    enc = HSTUEncoder(cfg, max_seq_len=20)
    seen = []
    for blk in enc.blocks:
        blk.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
    offsets = lengths_to_offsets(torch.tensor([5, 0, 1, 20, 9]))
    T = int(offsets[-1])
    g = torch.Generator().manual_seed(1)
    tok = torch.randn(T, 16, generator=g, requires_grad=True)
    ts = torch.cumsum(torch.randint(0, 10 ** 6, (T,), generator=g), 0)
    w = torch.randn(T, 16, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = enc(tok, offsets, ts)
    gt, gw = torch.autograd.grad((out.float() * w).sum(), [tok, enc.blocks[0].uvqk_weight])
    return seen, out, gt, gw


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_l2norm_returns_the_stream_dtype_with_a_float32_norm(device):
    """The encoder's output norm keeps its input's dtype under autocast (CUDA's autocast runs ``norm`` in float32 and
    the division promoted a bf16 stream to float32) and takes the norm in float32: bf16 rows equal the float32
    normalisation rounded once; float32 rows are F.normalize's bit for bit; gradients keep the input's dtype."""
    from gemray.model.hstu import L2Norm
    g = torch.Generator().manual_seed(3)
    x32 = (torch.randn(37, 64, generator=g) * torch.rand(37, 1, generator=g) * 50).to(device)
    x32[5] = 0.0  # a zero row: eps keeps it finite
    norm = L2Norm(eps=1e-6)
    with torch.autocast(device, dtype=torch.bfloat16):
        xb = x32.to(torch.bfloat16).requires_grad_()
        yb = norm(xb)
        y32 = norm(x32)
    assert yb.dtype == torch.bfloat16 and y32.dtype == torch.float32
    assert torch.equal(yb, F.normalize(xb.detach().float(), dim=-1, eps=1e-6).to(torch.bfloat16))
    assert torch.equal(y32, F.normalize(x32, dim=-1, eps=1e-6))
    assert torch.isfinite(yb.float()).all() and float(yb[5].detach().float().abs().max()) == 0.0
    (gx,) = torch.autograd.grad((yb.float() * torch.randn(37, 64, device=device)).sum(), [xb])
    assert gx.dtype == torch.bfloat16 and torch.isfinite(gx.float()).all()


def test_fp32_residual_off_keeps_the_stream_in_the_autocast_dtype():
    """model.fp32_residual = false: under bf16 autocast every block receives (and so adds its output to) a bf16
    stream, and forward / backward stay within bf16's error of the float32 stream; without autocast the flag changes
    nothing (bit for bit: the ML-1M config trains in float32)."""
    seen32, out32, gt32, gw32 = _residual_run(True, autocast=True)
    seen16, out16, gt16, gw16 = _residual_run(False, autocast=True)
    assert seen32 == [torch.float32] * 3 and seen16 == [torch.bfloat16] * 3
    assert out16.dtype == torch.bfloat16 and gt16.dtype == torch.float32
    for a, b, tol in ((out16, out32, 2e-2), (gt16, gt32, 2e-2), (gw16, gw32, 3e-2)):
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert 0 < err < tol, err  # not the same computation, but the same result to bf16 precision

    plain = [_residual_run(flag, autocast=False) for flag in (True, False)]
    assert plain[0][0] == plain[1][0] == [torch.float32] * 3
    for a, b in zip(plain[0][1:], plain[1][1:]):
        assert torch.equal(a, b)
