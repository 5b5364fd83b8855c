"""Head diversity's first components by block Lanczos (`circuits.top_spectrum`): the same numbers as the full
eigendecomposition, within the bound it reports, the total variance from the trace."""

import pytest
import torch

from dcinterp import DCFormerConfig, HookedDCFormer
from dcinterp.circuits import concat_factor, gram_lower, head_diversity, top_spectrum


def decaying(m: int, n: int, seed: int = 0) -> torch.Tensor:
    """A random m x n matrix whose singular values decay as trained weights' do, with a cluster at the top."""
    generator = torch.Generator().manual_seed(seed)
    r = min(m, n)
    U = torch.linalg.qr(torch.randn(m, r, generator=generator, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(n, r, generator=generator, dtype=torch.float64))[0]
    sigma = torch.arange(1, r + 1, dtype=torch.float64) ** -0.7
    sigma[:4] = sigma[0]  # four equal singular values
    return ((U * sigma) @ V.T).float()


@pytest.mark.parametrize("shape", [(600, 480), (480, 600)])
def test_top_spectrum_equals_the_full_decomposition_within_its_bound(shape):
    Z = decaying(*shape)
    full = torch.linalg.svdvals(Z.double()) ** 2
    top = top_spectrum(Z, 24, tol=1e-6, generator=torch.Generator().manual_seed(0))
    assert top.krylov_dim > 0 and top.bound <= 1e-6  # the Krylov path, not the fallback
    assert abs(top.total - float(full.sum())) / top.total < 1e-6
    shares, exact = top.sigma2.double().cumsum(0) / top.total, full[:24].cumsum(0) / full.sum()
    assert (shares - exact).abs().max() <= top.bound + 1e-6  # the bound, plus float32 rounding


def test_a_spectrum_too_flat_for_lanczos_falls_back_to_the_full_decomposition():
    Z = torch.randn(90, 90, generator=torch.Generator().manual_seed(0))
    top = top_spectrum(Z, 20)
    assert top.krylov_dim == 0 and top.bound == 0
    torch.testing.assert_close(top.sigma2, (torch.linalg.svdvals(Z.double()) ** 2)[:20].float(), rtol=1e-5, atol=1e-5)


def crowded(m: int, n: int, top: int, seed: int = 0) -> torch.Tensor:
    """A random m x n matrix whose `top` largest squared singular values crowd into [1, 1.1], the rest small."""
    generator = torch.Generator().manual_seed(seed)
    r = min(m, n)
    U = torch.linalg.qr(torch.randn(m, r, generator=generator, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(n, r, generator=generator, dtype=torch.float64))[0]
    tail = 0.01 / torch.arange(1, r - top + 1, dtype=torch.float64)
    sigma2 = torch.cat([1 + 0.1 * torch.rand(top, generator=generator, dtype=torch.float64), tail])
    return ((U * sigma2.sqrt()) @ V.T).float()


@pytest.mark.parametrize("kind", ["iid", "crowded"])
def test_a_flat_spectrum_is_reached_by_lanczos_within_half_the_dimension(kind):
    # i.i.d. weights (effective rank n/2) or a crowded top (the first 150 of 700 within 10%): the first 32 of 700
    # take a few hundred Krylov vectors, less than the dense decomposition costs
    Z = torch.randn(700, 1000, generator=torch.Generator().manual_seed(0)) if kind == "iid" else crowded(700, 1000, 150)
    top = top_spectrum(Z, 32, generator=torch.Generator().manual_seed(0))
    assert 0 < top.krylov_dim <= 350 and top.bound <= 1e-6
    exact = torch.linalg.svdvals(Z.double()) ** 2
    assert ((top.sigma2.double().cumsum(0) - exact[:32].cumsum(0)) / exact.sum()).abs().max() <= top.bound + 1e-6


def test_lanczos_stops_at_half_the_dimension_and_computes_every_eigenvalue_instead(monkeypatch):
    Z = torch.randn(400, 400, generator=torch.Generator().manual_seed(0))  # the first 64 of a flat 400: > 200 vectors
    blocks, qr = [], torch.linalg.qr
    monkeypatch.setattr(torch.linalg, "qr", lambda W: blocks.append(W.shape[1]) or qr(W))
    top = top_spectrum(Z, 64, generator=torch.Generator().manual_seed(0))  # blocks of 16
    # every block of the Krylov space is a QR, and so is the residual block R that a check reads
    assert top.krylov_dim == 0 and top.bound == 0 and 200 - 16 < sum(blocks) <= 200 + 16
    exact = torch.linalg.svdvals(Z.double()) ** 2
    assert ((top.sigma2.double().cumsum(0) - exact[:64].cumsum(0)) / exact.sum()).abs().max() < 1e-6


@pytest.mark.parametrize("shape", [(300, 200), (200, 300)])
def test_gram_lower_is_the_smaller_gram_matrix_on_and_below_the_diagonal(shape):
    Z = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    full = Z.T @ Z if shape[1] <= shape[0] else Z @ Z.T
    lower = gram_lower(Z, block=64)  # 200 = 3 blocks of 64 and one of 8
    assert lower.shape == (200, 200)
    torch.testing.assert_close(lower.tril(), full.tril())
    torch.testing.assert_close(torch.linalg.eigvalsh(lower), torch.linalg.eigvalsh(full))


def test_head_diversity_components_are_the_first_entries_of_the_full_curve():
    torch.manual_seed(0)
    model = HookedDCFormer(DCFormerConfig(n_layers=2, d_model=384, n_heads=6, d_head=64, d_mlp=32, d_vocab=10, n_ctx=8))
    with torch.no_grad():  # trained-like circuits: decaying spectra
        for block in model.blocks:
            for name in ("W_Q", "W_K", "W_V"):
                w = getattr(block.attn, name)
                w.copy_(w * torch.arange(1, 385, dtype=torch.float32)[None, :, None] ** -0.8)
    full = head_diversity(model, components="all")
    first = head_diversity(model, components=16)
    assert full.qk.shape == (2, 384) and first.qk.shape == (2, 16) and first.options["components"] == 16
    assert 0 < first.bound <= 1e-6
    assert (first.qk - full.qk[:, :16]).abs().max() < 2e-6
    assert (first.ov - full.ov[:, :16]).abs().max() < 2e-6
    assert head_diversity(model).qk.shape == (2, 384)  # "auto": all components of a small model
    with pytest.raises(ValueError, match="components must be a positive int"):
        head_diversity(model, components=0)


def test_top_spectrum_gives_the_same_numbers_every_call_and_leaves_the_global_generator_alone():
    Z = decaying(600, 480)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first, second = top_spectrum(Z, 24), top_spectrum(Z, 24)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first.sigma2, second.sigma2) and first.bound == second.bound


def test_concat_factor_covers_heads_with_a_singular_gram_matrix():
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(3, 40, 8, generator=generator, dtype=torch.float64)
    right = torch.randn(3, 8, 30, generator=generator, dtype=torch.float64)
    right[1, 4:] = 0  # head 1 reads 4 directions only: its 8 x 8 Gram matrix has no Cholesky factor
    M = torch.cat([left[h] @ right[h] for h in range(3)], dim=1)
    Z = concat_factor(left, right)
    torch.testing.assert_close(Z @ Z.T, M @ M.T)
    right[1, 4:] = 1  # every Gram matrix positive definite: the Cholesky path
    M = torch.cat([left[h] @ right[h] for h in range(3)], dim=1)
    Z = concat_factor(left, right)
    torch.testing.assert_close(Z @ Z.T, M @ M.T)


def test_head_diversity_shows_a_progress_bar_only_where_layers_take_seconds(capsys):
    model = HookedDCFormer(DCFormerConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_mlp=32, d_vocab=10, n_ctx=8))
    head_diversity(model)  # a Gram size of 64: no bar
    assert "head diversity" not in capsys.readouterr().err
    head_diversity(model, progress=True)
    assert "head diversity: 100%" in capsys.readouterr().err


def test_a_half_precision_model_is_read_in_float32_and_a_16_bit_dtype_is_one_clear_error():
    model = HookedDCFormer(DCFormerConfig(n_layers=2, d_model=64, n_heads=4, d_head=16, d_mlp=32, d_vocab=10, n_ctx=8))
    reference = head_diversity(model)
    halved = head_diversity(model.to(torch.bfloat16))  # the bfloat16 weights, computed in float32
    torch.testing.assert_close(halved.qk, reference.qk, atol=1e-2, rtol=0)
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16 is what the spectra are computed in"):
        head_diversity(model, dtype=torch.bfloat16)
