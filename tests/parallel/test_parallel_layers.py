import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks

from pystronghold.parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                   copy_to_tp_region, gather_from_tp_region, gather_tp_param,
                                   gather_tp_tensor, init_parallel, reduce_from_tp_region,
                                   scatter_to_tp_region, tp_slice)

close = torch.testing.assert_close


# ---- one process: everything is the plain layer

def test_regions_are_identity_without_a_group():
    x = torch.randn(3, 4)
    for fn in (copy_to_tp_region, reduce_from_tp_region, scatter_to_tp_region, gather_from_tp_region):
        assert fn(x, None) is x


def test_layers_without_a_group_are_plain_torch():
    x = torch.randn(2, 5, 8)
    col = ColumnParallelLinear(8, 12)
    close(col(x), F.linear(x, col.weight, col.bias))
    row = RowParallelLinear(12, 8, bias=False)
    close(row(col(x)), F.linear(F.linear(x, col.weight, col.bias), row.weight))
    emb = VocabParallelEmbedding(10, 8)
    idx = torch.tensor([[0, 9, 3]])
    close(emb(idx), emb.weight[idx])
    y, b = ColumnParallelLinear(8, 6, skip_bias_add=True)(x)
    assert y.shape == (2, 5, 6) and b.shape == (6,)


def test_init_is_seeded_normal():
    a, b = ColumnParallelLinear(64, 64, seed=1), ColumnParallelLinear(64, 64, seed=1)
    close(a.weight, b.weight, rtol=0, atol=0)
    assert not torch.equal(a.weight, ColumnParallelLinear(64, 64, seed=2).weight)
    assert abs(ColumnParallelLinear(64, 64, init_std=0.5).weight.std().item() - 0.5) < 0.05


def test_tp_slice_cuts_the_rank_rows_and_refuses_an_uneven_split():
    full = torch.arange(24.0).reshape(4, 6)
    assert tp_slice(full, (0, 0, 1)) is full and gather_tp_tensor(full, (0, 0, 1), None) is full
    close(tp_slice(full, (0, 1, 2)), full[2:], rtol=0, atol=0)
    close(tp_slice(full, (1, 2, 3)), full[:, 4:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="does not split 4 ways"):
        tp_slice(full, (1, 0, 4))
    with pytest.raises(ValueError, match="split 2 ways but the group has 1 ranks"):
        gather_tp_tensor(full, (0, 0, 2), None)


def test_a_packed_split_cuts_the_rank_rows_of_each_part():
    """An MoE's (E, 2 I, C) gate and up, packed on dim 1: rank r holds its rows of the gate, then of the up."""
    full = torch.arange(2 * 8 * 3.0).reshape(2, 8, 3)  # gate rows 0-3, up rows 4-7
    close(tp_slice(full, (1, 1, 2, 2)), full[:, [2, 3, 6, 7]], rtol=0, atol=0)
    close(tp_slice(full, (1, 0, 4, 2)), full[:, [0, 4]], rtol=0, atol=0)
    with pytest.raises(ValueError, match="does not split 3 ways in each of 2 parts"):
        tp_slice(full, (1, 0, 3, 2))


def test_bad_layer_arguments():
    with pytest.raises(ValueError, match="gather_output"):
        ColumnParallelLinear(4, 4, gather_output=True, skip_bias_add=True)


# ---- two processes: each TP layer equals the single-process layer

def _regions(r: int, g) -> None:
    X, G = torch.randn(3, 8), torch.randn(3, 8)  # same on both ranks (same seed)
    x = X.clone().requires_grad_()
    y = scatter_to_tp_region(x, g)
    close(y, X.chunk(2, -1)[r])
    y.backward(G.chunk(2, -1)[r])
    close(x.grad, G)  # every rank's slice of the gradient gathered back
    x_local = X.chunk(2, -1)[r].clone().requires_grad_()
    y = gather_from_tp_region(x_local, g)
    close(y, X)
    y.backward(G)
    close(x_local.grad, G.chunk(2, -1)[r])
    x = X.clone().requires_grad_()
    copy_to_tp_region(x, g).backward(torch.full_like(X, r + 1.0))
    close(x.grad, torch.full_like(X, 3.0))  # 1 + 2
    x = X.clone().requires_grad_()
    y = reduce_from_tp_region(x * (r + 1), g)
    close(y, 3 * X)
    y.backward(G)
    close(x.grad, G * (r + 1))
    with pytest.raises(ValueError, match="equal chunks"):
        scatter_to_tp_region(torch.randn(2, 3), g)


def _column(r: int, g) -> None:
    full = ColumnParallelLinear(8, 12, seed=3)
    par = ColumnParallelLinear(8, 12, seed=3, group=g, gather_output=True)
    close(par.weight, full.weight.chunk(2, 0)[r], rtol=0, atol=0)
    bias = torch.randn(12)
    with torch.no_grad():
        full.bias.copy_(bias)
        par.bias.copy_(bias.chunk(2)[r])
    X, up = torch.randn(2, 5, 8), torch.randn(2, 5, 12)
    x_full, x_par = X.clone().requires_grad_(), X.clone().requires_grad_()
    y_full, y_par = full(x_full), par(x_par)
    close(y_par, y_full)
    (y_full * up).sum().backward()
    (y_par * up).sum().backward()
    close(x_par.grad, x_full.grad)
    close(par.weight.grad, full.weight.grad.chunk(2, 0)[r])
    close(par.bias.grad, full.bias.grad.chunk(2)[r])
    close(gather_tp_param(par.weight, g), full.weight)
    moment = torch.randn(12, 8)  # a whole tensor (e.g. an Adam moment): slice, then gather back
    close(gather_tp_tensor(tp_slice(moment, par.weight.tp_split), par.weight.tp_split, g), moment, rtol=0, atol=0)
    packed = torch.arange(2 * 8 * 3.0).reshape(2, 8, 3)  # an MoE's gate and up: rank r's rows of each
    close(gather_tp_tensor(tp_slice(packed, (1, r, 2, 2)), (1, r, 2, 2), g), packed, rtol=0, atol=0)
    par.gather_output = False
    close(par(X), full(X).chunk(2, -1)[r])
    par.skip_bias_add = True
    y, b = par(X)
    close(y + b, full(X).chunk(2, -1)[r])
    assert b is par.bias


def _row(r: int, g) -> None:
    full = RowParallelLinear(12, 8, seed=4)
    par = RowParallelLinear(12, 8, seed=4, group=g)
    close(gather_tp_param(par.weight, g), full.weight, rtol=0, atol=0)
    with torch.no_grad():
        full.bias.normal_()
        par.bias.copy_(full.bias)
    X, up = torch.randn(2, 5, 12), torch.randn(2, 5, 8)
    x_local = X.chunk(2, -1)[r].clone().requires_grad_()
    x_full = X.clone().requires_grad_()
    y_par, y_full = par(x_local), full(x_full)
    close(y_par, y_full)
    (y_full * up).sum().backward()
    (y_par * up).sum().backward()
    close(x_local.grad, x_full.grad.chunk(2, -1)[r])
    close(par.weight.grad, full.weight.grad.chunk(2, 1)[r])
    close(par.bias.grad, full.bias.grad)
    par.input_is_parallel = False  # split here instead
    close(par(X), full(X))
    par.skip_bias_add = True
    y, b = par(X)
    close(y + b, full(X))


def _embedding(r: int, g) -> None:
    full = VocabParallelEmbedding(10, 6, seed=5)
    par = VocabParallelEmbedding(10, 6, seed=5, group=g)
    assert (par.vocab_start, par.vocab_end) == ((0, 5) if r == 0 else (5, 10))
    idx = torch.tensor([[0, 4, 5, 9], [9, 9, 2, 7]])  # ids on both ranks, repeated ids
    up = torch.randn(2, 4, 6)
    y_full, y_par = full(idx), par(idx)
    close(y_par, y_full)
    (y_full * up).sum().backward()
    (y_par * up).sum().backward()
    close(par.weight.grad, full.weight.grad.chunk(2, 0)[r])
    close(gather_tp_param(par.weight, g), full.weight)
    with pytest.raises(ValueError, match="num_embeddings=7"):
        VocabParallelEmbedding(7, 6, group=g)
    with pytest.raises(ValueError, match="out_features=5"):
        ColumnParallelLinear(4, 5, group=g)


def _all_layers(rank: int, world: int) -> None:
    g = init_parallel(tp_size=2).tp_group
    for check in (_regions, _column, _row, _embedding):
        torch.manual_seed(10)  # both ranks draw the same inputs
        check(rank, g)


def test_tp2_layers_equal_single_process():
    run_ranks(_all_layers, 2)


@pytest.mark.parametrize("shape", [(7,), (17, 3), (1023, 5), (64, 48)])
def test_init_normal_in_place_draw_equals_the_general_path(shape):
    """A contiguous fp32 parameter is drawn in place; a non-contiguous one of the same shape takes the
    general path (draw a temporary, scale, copy): the values must be the same, bit for bit."""
    from pystronghold.parallel import init_normal_

    fast = torch.nn.Parameter(torch.empty(shape))  # a leaf that requires grad, as in a model
    general = torch.empty(tuple(reversed(shape))).t() if len(shape) == 2 else torch.empty(shape[0] * 2)[::2]
    assert not general.is_contiguous()
    with torch.no_grad():
        init_normal_(fast, 0.02, 5, "blocks.0.mlp.fc1.weight")
    init_normal_(general, 0.02, 5, "blocks.0.mlp.fc1.weight")
    assert torch.equal(fast, general)
