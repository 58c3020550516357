"""Expert parallelism's single-process pieces (runtime.expert_parallel), on a gloo group of one rank
in this process: the dispatch arithmetic, the record / replay of a hand-written list block and
the wrapped Hugging Face stacked experts (eager, batched_mm and grouped_mm) give the unmodified
block's outputs and gradients; the split keeps a rank's experts under their names (placeholders
for the others, stacked weights sliced); routing that changes between the two runs of a block's
forward, a forward that changes its input in place and experts that do not map the hidden size
to itself are refused with one line. The multi-rank runs are tests/distributed/test_expert_parallel.py.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from planner.errors import BadInput
from planner.profile.moe import find_moe
from runtime.expert_parallel import RemoteExpert, exchange, split_block, split_list_block, split_stacked_block
from tests.conftest import EXAMPLES

sys.path.insert(0, str(EXAMPLES))
from moe import MoEConfig, SparseMoE  # noqa: E402

CFG = MoEConfig(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=24, vocab=32, seq_len=8, n_experts=4, top_k=2)


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group in this process (what exchange and the blocks run their all-to-alls on)."""
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield dist.group.WORLD
    if started:
        dist.destroy_process_group()


def _grads(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x = x.clone().requires_grad_(True)
    y = module(x)
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _assert_same(got, want) -> None:
    (y, gx, gp), (y0, gx0, gp0) = got, want
    torch.testing.assert_close(y, y0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, gx0, rtol=1e-6, atol=1e-6)
    assert gp.keys() == gp0.keys()
    for name in gp0:
        torch.testing.assert_close(gp[name], gp0[name], rtol=1e-6, atol=1e-6, msg=name)


def test_exchange_regroups_by_expert_and_returns_in_order(group):
    rows = torch.randn(7, 3, requires_grad=True)
    counts = torch.tensor([2, 0, 4, 1])  # rows of experts 0, 1, 2, 3, in that order
    seen = []

    def compute(received, per_expert):
        seen.append(per_expert)
        ids = torch.repeat_interleave(torch.arange(len(per_expert)), torch.tensor(per_expert))
        return received * (ids[:, None] + 1)  # expert e scales by e + 1

    out = exchange(rows, counts, group, compute)
    scale = torch.tensor([1, 1, 3, 3, 3, 3, 4.0])[:, None]
    torch.testing.assert_close(out, rows * scale)
    assert seen == [[2, 0, 4, 1]]
    out.sum().backward()
    torch.testing.assert_close(rows.grad, scale.expand(7, 3))


def _list_block(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SparseMoE(CFG)


def _ep_list(block: nn.Module, group) -> nn.Module:
    (moe,) = find_moe(block)
    split_block(block, moe, 1, 0, group)
    return block


def test_list_block_record_replay_matches_the_plain_block(group):
    x = torch.randn(2, 8, CFG.dim)
    want = _grads(_list_block(), x)
    ep = _ep_list(_list_block(), group)
    _assert_same(_grads(ep, x), want)
    assert all(type(e).__name__ == "FeedForward" for e in ep.experts)  # the stand-ins are gone after forward


def test_list_block_with_random_router_noise_routes_alike_in_both_passes(group):
    """Both passes start from one RNG state: noise drawn by the router is the same in each, and the
    state after the block is the one a single forward leaves."""

    class Noisy(SparseMoE):
        def forward(self, x):
            return super().forward(x + 0.5 * torch.randn_like(x))

    x = torch.randn(2, 8, CFG.dim)
    torch.manual_seed(0)
    plain = Noisy(CFG)
    ep = _ep_list(copy.deepcopy(plain), group)
    torch.manual_seed(7)
    want = _grads(plain, x)
    after_plain = torch.rand(())
    torch.manual_seed(7)
    got = _grads(ep, x)
    assert torch.rand(()) == after_plain
    _assert_same(got, want)


def test_routing_that_changes_between_passes_is_refused(group):
    class Drifting(SparseMoE):
        calls = 0

        def forward(self, x):
            Drifting.calls += 1  # state outside the input and the RNG: the second pass routes otherwise
            return super().forward(x * (1.0 if Drifting.calls % 2 else -1.0))

    torch.manual_seed(0)
    ep = _ep_list(Drifting(CFG), group)
    with pytest.raises(BadInput, match="the routing differs between two runs of the same forward") as info:
        ep(torch.randn(2, 8, CFG.dim))
    assert "\n" not in str(info.value)
    assert all(type(e).__name__ == "FeedForward" for e in ep.experts)  # the list is restored after the error


def test_a_forward_that_changes_its_input_in_place_is_refused(group):
    class InPlace(SparseMoE):
        def forward(self, x):
            x.mul_(1.0)
            return super().forward(x)

    torch.manual_seed(0)
    ep = _ep_list(InPlace(CFG), group)
    with pytest.raises(BadInput, match="changes its input in place"):
        ep(torch.randn(2, 8, CFG.dim))


def test_experts_must_map_the_hidden_size_to_itself():
    class Wide(SparseMoE):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.experts = nn.ModuleList(nn.Linear(cfg.dim, 2 * cfg.dim) for _ in range(cfg.n_experts))

    block = Wide(CFG)
    (moe,) = find_moe(block)
    with pytest.raises(BadInput, match=r"experts: each expert maps \[n, 16\] rows to \[2, 32\]"):
        split_list_block(block, moe, 2, 0)


def test_split_keeps_this_ranks_experts_under_their_names():
    block = _list_block()
    original = {n: p.detach().clone() for n, p in block.named_parameters()}
    (moe,) = find_moe(block)
    local = split_list_block(block, moe, 2, 1)
    assert local == [block.experts[2], block.experts[3]]
    assert [type(e) for e in block.experts[:2]] == [RemoteExpert, RemoteExpert]
    assert "held by expert-parallel rank 0" in repr(block.experts[0])
    names = {n for n, _ in block.named_parameters()}
    assert names == {n for n in original if not n.startswith(("experts.0.", "experts.1."))}
    with pytest.raises(RuntimeError, match="expert 1 is held by expert-parallel rank 0"):
        block.experts[1](torch.zeros(1, CFG.dim))


# ---------------------------------------------------------------------------------------------
# Hugging Face stacked experts
# ---------------------------------------------------------------------------------------------


def _mixtral_block(implementation: str) -> nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(config)
    for p in block.parameters():  # HF leaves the stacked weights uninitialised (torch.empty)
        nn.init.normal_(p, std=0.2)
    return block


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_stacked_experts_dispatch_matches_the_plain_block(group, implementation):
    x = torch.randn(2, 8, 16)
    plain = _mixtral_block(implementation)
    ep = copy.deepcopy(plain)
    (moe,) = find_moe(ep)
    assert moe.stacked and moe.experts == "experts"
    split_block(ep, moe, 1, 0, group)
    _assert_same(_grads(ep, x), _grads(plain, x))


def test_stacked_split_slices_every_weight():
    block = _mixtral_block("eager")
    whole = {n: p.detach().clone() for n, p in block.experts.named_parameters()}
    (moe,) = find_moe(block)
    split_stacked_block(block, moe, 2, 1)
    assert block.experts.num_experts == 2
    for name, p in block.experts.named_parameters():
        assert isinstance(p, nn.Parameter) and torch.equal(p, whole[name][2:4])


def test_stacked_experts_with_no_rows_still_get_a_gradient(group):
    """A rank that receives no rows gives its stacked weights zero gradients (FSDP2 reduces the same
    units on every replica), where the eager implementation alone would leave them None."""
    block = _mixtral_block("eager")
    (moe,) = find_moe(block)
    split_block(block, moe, 1, 0, group)
    out = block.experts(torch.zeros(0, 16, requires_grad=True), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in block.experts.parameters())
