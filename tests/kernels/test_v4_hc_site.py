"""The fused Triton mHC sites and write-backs against the torch reference ops and a float64 evaluation."""

from __future__ import annotations

import pytest
import torch

from support.kernel_cases import TOLERANCE, generator, randn, strided
from mla_func.kernels.reference import v4_hc as ref
from mla_func.kernels.triton import v4_hc_site
from mla_func.kernels.triton.v4_hc_site import hc_head, hc_site, hc_write_back, hc_write_back_site

ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6
# Sizes: T = 0, 1 and block-straddling counts; N = 4 and 2; D not a power of two (nor a multiple of a chunk).
CASES = [(0, 4, 24), (1, 4, 40), (37, 4, 72), (5, 2, 100), (19, 2, 33)]


def _site_params(n: int, dim: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    width = (2 + n) * n
    fn = torch.randn((width, n * dim), generator=gen, device=device) / (n * dim) ** 0.5 * 4
    base = torch.randn((width,), generator=gen, device=device) * 0.5
    scale = 1 + 0.2 * torch.randn((3,), generator=gen, device=device)
    norm_weight = randn((dim,), dtype, device, gen, scale=0.5) + 1
    return fn, base, scale, norm_weight


def _write_back_inputs(t: int, n: int, dim: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    post = 2 * torch.rand((t, n), generator=gen, device=device)
    comb = torch.softmax(torch.randn((t, n, n), generator=gen, device=device), dim=-1)
    return post, comb, randn((t, dim), dtype, device, gen, scale=2.0), randn((t, n, dim), dtype, device, gen)


def _site64(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The site's math in float64 with no intermediate rounding (the truth both implementations approximate)."""
    n = streams.shape[1]
    flat = streams.flatten(1).double()
    mixes = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + NORM_EPS) @ fn.double().T
    s, b = scale.double(), base.double()
    pre = torch.sigmoid(mixes[:, :n] * s[0] + b[:n]) + HC_EPS
    post = 2 * torch.sigmoid(mixes[:, n:2 * n] * s[1] + b[n:2 * n])
    comb = torch.softmax(mixes[:, 2 * n:].view(-1, n, n) * s[2] + b[2 * n:].view(n, n), dim=-1) + HC_EPS
    collapsed = (pre.unsqueeze(-1) * streams.double()).sum(1)
    x = collapsed * torch.rsqrt(collapsed.square().mean(-1, keepdim=True) + NORM_EPS) * norm_weight.double()
    return x, post, ref.sinkhorn(comb, ITERS, HC_EPS)


def _write_back64(post, comb, out, streams) -> torch.Tensor:
    return comb.double().transpose(-1, -2) @ streams.double() + post.double().unsqueeze(-1) * out.double().unsqueeze(1)


def _check_x(got: torch.Tensor, want: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        return
    torch.testing.assert_close(got.double(), want.double(), **TOLERANCE[dtype])
    if got.numel():
        # No further from the float64 truth than the reference's own bf16 rounding takes it, with the
        # slack of half a bf16 step of each value (the two round different float32 sums).
        limit = 1.5 * (want.double() - truth).abs().max() + truth.abs() * 2.0 ** -9 + 1e-3
        assert torch.all((got.double() - truth).abs() <= limit)


def _check_weights(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...],
                   truth: tuple[torch.Tensor, ...] | None, dtype: torch.dtype) -> None:
    assert len(got) == len(want) == 2
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == torch.float32 and g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        if truth is not None and dtype == torch.float32:
            torch.testing.assert_close(g.double(), truth[i], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, n, dim", CASES)
def test_site_equals_the_reference(device, dtype, tokens, n, dim):
    gen = generator(tokens * 1000 + n * 100 + dim, device)
    fn, base, scale, norm_weight = _site_params(n, dim, dtype, device, gen)
    streams = randn((tokens, n, dim), dtype, device, gen, scale=2.0)
    got = hc_site(streams, fn, base, scale, norm_weight, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    want = ref.hc_site(streams, fn, base, scale, norm_weight, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    truth = _site64(streams, fn, base, scale, norm_weight)
    _check_x(got[0], want[0], truth[0], dtype)
    _check_weights(got[1:], want[1:], truth[1:], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, n, dim", CASES)
def test_write_back_site_equals_the_reference(device, dtype, tokens, n, dim):
    gen = generator(tokens * 1000 + n * 100 + dim + 7, device)
    fn, base, scale, norm_weight = _site_params(n, dim, dtype, device, gen)
    post, comb, out, streams = _write_back_inputs(tokens, n, dim, dtype, device, gen)
    got = hc_write_back_site(post, comb, out, streams, fn, base, scale, norm_weight, iters=ITERS, hc_eps=HC_EPS,
                             norm_eps=NORM_EPS)
    want = ref.hc_write_back_site(post, comb, out, streams, fn, base, scale, norm_weight, iters=ITERS,
                                  hc_eps=HC_EPS, norm_eps=NORM_EPS)
    _check_write_back_site(got, want, post, comb, out, streams, fn, base, scale, norm_weight, dtype)


def _check_write_back_site(got, want, post, comb, out, streams, fn, base, scale, norm_weight, dtype) -> None:
    """The written-back streams against float64 and the reference; the site against the reference's
    site of the same written-back streams (the two write-backs may round a value to neighbouring
    bf16 steps, and a site's weights follow its streams)."""
    assert got[0].dtype == dtype and got[0].shape == streams.shape
    torch.testing.assert_close(got[0].double(), _write_back64(post, comb, out, streams), **TOLERANCE[dtype])
    # Each write-back term is rounded before the add, the matmul's sums in another order: up to two steps.
    step = 1e-5 if dtype == torch.float32 else 2.0 ** -6
    torch.testing.assert_close(got[0].double(), want[0].double(), rtol=step, atol=step)
    same_streams = ref.hc_site(got[0], fn, base, scale, norm_weight, iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    truth = _site64(got[0], fn, base, scale, norm_weight)
    _check_x(got[1], same_streams[0], truth[0], dtype)
    _check_weights(got[2:], same_streams[1:], truth[1:], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, n, dim", CASES)
def test_write_back_equals_the_reference(device, dtype, tokens, n, dim):
    gen = generator(tokens * 1000 + n * 100 + dim + 11, device)
    post, comb, out, streams = _write_back_inputs(tokens, n, dim, dtype, device, gen)
    got = hc_write_back(post, comb, out, streams)
    want = ref.hc_write_back(post, comb, out, streams)
    assert got.dtype == dtype and got.shape == streams.shape
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(got.double(), _write_back64(post, comb, out, streams), **TOLERANCE[dtype])


def _head64(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    flat = streams.flatten(1).double()
    mixes = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + NORM_EPS) @ fn.double().T
    pre = torch.sigmoid(mixes * scale.double() + base.double()) + HC_EPS
    return (pre.unsqueeze(-1) * streams.double()).sum(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, n, dim", CASES)
def test_head_equals_the_reference(device, dtype, tokens, n, dim):
    gen = generator(tokens * 1000 + n * 100 + dim + 13, device)
    fn = torch.randn((n, n * dim), generator=gen, device=device) / (n * dim) ** 0.5 * 4
    base = torch.randn((n,), generator=gen, device=device) * 0.5
    scale = 1 + 0.2 * torch.randn((1,), generator=gen, device=device)
    streams = randn((tokens, n, dim), dtype, device, gen, scale=2.0)
    got = hc_head(streams, fn, base, scale, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    want = ref.hc_head(streams, fn, base, scale, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    _check_x(got, want, _head64(streams, fn, base, scale), dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), _head64(streams, fn, base, scale), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="scale"):
        hc_head(streams, fn, base, scale.expand(3), hc_eps=HC_EPS, norm_eps=NORM_EPS)


# 6 tokens take the per-token streams kernel, 20 the block kernel (its last block ragged).
@pytest.mark.parametrize("tokens, geometry", [(6, (2, 3)), (20, (1, 5))])
def test_many_chunks_a_slice_and_strided_inputs(device, monkeypatch, tokens, geometry):
    """Few programs (each slice several chunks, the last slice ragged), the per-token kernel's two passes over
    D in chunks (its row wider than one tile), and non-contiguous inputs."""
    monkeypatch.setattr(v4_hc_site, "_TARGET_PROGRAMS", 2)
    monkeypatch.setattr(v4_hc_site, "_MAX_SITE_BLOCK_D", 64)
    gen = generator(5 + tokens, device)
    n, dim = 4, 300
    fn, base, scale, norm_weight = _site_params(n, dim, torch.float32, device, gen)
    post, comb, out, streams = _write_back_inputs(tokens, n, dim, torch.float32, device, gen)
    post, comb, out, streams, fn = (strided(t, gen) for t in (post, comb, out, streams, fn))
    assert v4_hc_site._block_dot(tokens) == (tokens >= 8)
    assert v4_hc_site._geometry(tokens, dim)[1:] == geometry
    kwargs = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    got = hc_write_back_site(post, comb, out, streams, fn, base, scale, norm_weight, **kwargs)
    want = ref.hc_write_back_site(post, comb, out, streams, fn, base, scale, norm_weight, **kwargs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_rows_give_finite_outputs(device, dtype):
    """Padded rows (zero streams, zero output, zero write-back weights) stay finite and inert."""
    gen = generator(9, device)
    n, dim = 4, 40
    fn, base, scale, norm_weight = _site_params(n, dim, dtype, device, gen)
    post, comb, out, streams = _write_back_inputs(5, n, dim, dtype, device, gen)
    padded = torch.tensor([False, True, False, False, True], device=device)
    streams, out = streams.masked_fill(padded[:, None, None], 0), out.masked_fill(padded[:, None], 0)
    post, comb = post.masked_fill(padded[:, None], 0), comb.masked_fill(padded[:, None, None], 0)
    kwargs = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    new, x, post2, comb2 = hc_write_back_site(post, comb, out, streams, fn, base, scale, norm_weight, **kwargs)
    x1, post1, comb1 = hc_site(streams, fn, base, scale, norm_weight, **kwargs)
    head = hc_head(streams, fn[:n], base[:n], scale[:1], hc_eps=HC_EPS, norm_eps=NORM_EPS)
    for t in (new, x, post2, comb2, x1, post1, comb1, head):
        assert torch.isfinite(t).all()
    assert not new[padded].any() and not x[padded].any() and not x1[padded].any() and not head[padded].any()
    want = ref.hc_site(streams, fn, base, scale, norm_weight, **kwargs)
    torch.testing.assert_close(comb1[padded], want[2][padded], rtol=1e-5, atol=1e-6)


def test_bad_arguments_name_the_field(device):
    gen = generator(2, device)
    n, dim = 4, 24
    fn, base, scale, norm_weight = _site_params(n, dim, torch.float32, device, gen)
    post, comb, out, streams = _write_back_inputs(3, n, dim, torch.float32, device, gen)
    kwargs = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    with pytest.raises(ValueError, match="fn"):
        hc_site(streams, fn[:, :-1], base, scale, norm_weight, **kwargs)
    with pytest.raises(ValueError, match="norm_weight"):
        hc_site(streams, fn, base, scale, norm_weight[:-1], **kwargs)
    with pytest.raises(ValueError, match="iters"):
        hc_site(streams, fn, base, scale, norm_weight, iters=0, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    with pytest.raises(ValueError, match="comb"):
        hc_write_back(post, comb[:, :2], out, streams)
    with pytest.raises(ValueError, match="out"):
        hc_write_back_site(post, comb, out[:, :-1], streams, fn, base, scale, norm_weight, **kwargs)
    with pytest.raises(ValueError, match="streams"):
        hc_write_back(post, comb, out, streams.flatten(1))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64])
def test_v4_mini_sizes_on_the_gpu(tokens):
    """v4-mini's site (N = 4, D = 4096) in bf16 at decode sizes, as the model calls it."""
    device = torch.device("cuda")
    gen = generator(tokens, device)
    n, dim, dtype = 4, 4096, torch.bfloat16
    fn, base, scale, norm_weight = _site_params(n, dim, dtype, device, gen)
    post, comb, out, streams = _write_back_inputs(tokens, n, dim, dtype, device, gen)
    kwargs = dict(iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS)
    got = hc_write_back_site(post, comb, out, streams, fn, base, scale, norm_weight, **kwargs)
    want = ref.hc_write_back_site(post, comb, out, streams, fn, base, scale, norm_weight, **kwargs)
    _check_write_back_site(got, want, post, comb, out, streams, fn, base, scale, norm_weight, dtype)
    x, post1, comb1 = hc_site(streams, fn, base, scale, norm_weight, **kwargs)
    want1 = ref.hc_site(streams, fn, base, scale, norm_weight, **kwargs)
    _check_x(x, want1[0], _site64(streams, fn, base, scale, norm_weight)[0], dtype)
    _check_weights((post1, comb1), want1[1:], None, dtype)
    torch.testing.assert_close(hc_write_back(post, comb, out, streams), want[0], rtol=2.0 ** -6, atol=2.0 ** -6)
    head_fn = fn[:n] / 4
    torch.testing.assert_close(hc_head(streams, head_fn, base[:n], scale[:1], hc_eps=HC_EPS, norm_eps=NORM_EPS),
                               ref.hc_head(streams, head_fn, base[:n], scale[:1], hc_eps=HC_EPS, norm_eps=NORM_EPS),
                               rtol=2.0 ** -6, atol=2.0 ** -6)
