"""How a GEMM's shape limits its speed (planner.cost.gemm_shapes): the measured table read as a
share of its best, the Linears of a layer weighted by their FLOPs, and the profile's Linears."""

from __future__ import annotations

import math

import pytest

from planner.cost.gemm_shapes import SM90, SM100, linear_factor, shape_efficiency
from planner.cost.setup import Training
from planner.cost.stage_costs import atom_table
from planner.hardware import make_cluster
from tests.unit.test_cost_formulas import gpt_bf16  # noqa: F401  (fixture)

BEST = max(SM90.values())


def test_a_measured_shape_reads_as_measured():
    """Rows up to 4096 are one GEMM, beyond it 2 or 4 of them (the table's b)."""
    assert BEST == 810.5  # 2 x 4096^3
    assert shape_efficiency(SM90, 2048, 2048, 2048) == pytest.approx(SM90[(1, 2048, 2048, 2048)] / BEST)
    assert shape_efficiency(SM90, 16384, 1024, 512) == pytest.approx(SM90[(4, 4096, 1024, 512)] / BEST)
    assert shape_efficiency(SM90, 8192, 4096, 4096) == pytest.approx(1.0)


def test_between_and_beyond_the_measured_shapes():
    """Interpolated in log2 of a side; clamped beyond the table (64k rows run as 16k, a side of 8192
    as 4096, a side of 128 as 256)."""
    mid = math.sqrt(1024 * 2048)  # half-way in log2
    expect = (SM90[(1, 4096, 1024, 4096)] + SM90[(1, 4096, 2048, 4096)]) / 2 / BEST
    assert shape_efficiency(SM90, 4096, mid, 4096) == pytest.approx(expect)
    assert shape_efficiency(SM90, 65536, 8192, 128) == pytest.approx(SM90[(4, 4096, 4096, 256)] / BEST)
    # small and skinny GEMMs reach much less than large ones, on a B200 more so than on an H100
    assert shape_efficiency(SM90, 4096, 512, 512) < 0.35 < 0.9 < shape_efficiency(SM90, 16384, 4096, 4096)
    assert max(SM100.values()) == 1670.5  # 4 x 4096^3
    assert shape_efficiency(SM100, 16384, 2048, 2048) < shape_efficiency(SM90, 16384, 2048, 2048)


def test_a_layers_linears_weighted_by_their_flops():
    """One Linear of 16384 x 1024 -> 4096 split column-wise by tp 4: forward 16384 x 1024 x 1024;
    backward the input gradient (16384 x 1024, inner 1024) and the weight gradient (1024 x 1024,
    inner 16384). Two Linears: the harmonic mean of their shares, weighted by FLOPs."""
    fwd, bwd = linear_factor(SM90, ((8192, 4096, 1024, "col"),), 2.0, 4)
    assert fwd == pytest.approx(shape_efficiency(SM90, 16384, 1024, 1024))
    d, w = shape_efficiency(SM90, 16384, 1024, 1024), shape_efficiency(SM90, 1024, 1024, 16384)
    assert bwd == pytest.approx(2 / (1 / d + 1 / w))
    big, small = (16384, 4096, 4096, ""), (16384, 512, 512, "")
    fwd, _ = linear_factor(SM90, (big, small), 1.0, 1)
    eb, es = shape_efficiency(SM90, *big[:3]), shape_efficiency(SM90, *small[:3])
    flops_b, flops_s = 4096 * 4096, 512 * 512
    assert fwd == pytest.approx((flops_b + flops_s) / (flops_b / eb + flops_s / es))
    # a row-wise split divides the inner side
    assert linear_factor(SM90, ((16384, 4096, 4096, "row"),), 1.0, 8)[0] == pytest.approx(
        shape_efficiency(SM90, 16384, 4096, 512))


def test_the_profile_records_each_linears_shape(gpt_bf16):  # noqa: F811
    """examples/gpt.py (s 256, h 384, one sample): a block's q, k, v and the first MLP Linear are
    column-wise, the two projections row-wise; the head, vocabulary-parallel, is column-wise."""
    block = next(l for l in gpt_bf16.layers if l.name == "blocks.0")
    shapes = sorted(block.linears)
    assert shapes == sorted([(256, 384, 384, "col")] * 3 + [(256, 384, 384, "row"), (256, 1536, 384, "col"),
                                                          (256, 384, 1536, "row")])
    head = gpt_bf16.layers[-1]
    assert head.linears == ((256, head.linears[0][1], 384, "col"),)


def test_hopper_runs_small_gemms_slower_and_other_gpus_do_not_know(gpt_bf16, monkeypatch):  # noqa: F811
    """On an H100 (sm_90 table) examples/gpt.py's small block costs more than at the catalogue's
    best-shape share; an A100 has no table, so its cost is the roofline's alone. (Its GEMMs are
    small enough that their bytes bound them at the fitted memory share: HBM is taken as free here,
    so that the FLOPs' time, which the table changes, is what the block costs.)"""
    from dataclasses import replace

    import planner.cost.compute as compute

    monkeypatch.setattr(compute, "MEMORY_EFFICIENCY", 1e6)
    training = Training("bf16", "adamw", 8, 80 * 2**30)
    i = next(k for k, l in enumerate(gpt_bf16.layers) if l.name == "blocks.0")
    for name, slower in (("h100-sxm-80gb", True), ("a100-80gb", False)):
        cluster = make_cluster(name, 1)
        plain = replace(cluster, gpu=replace(cluster.gpu, matmul_shapes=None))
        with_table, without = (atom_table(gpt_bf16, c, training, 1, 64)[i] for c in (cluster, plain))
        assert (with_table.fwd_s > without.fwd_s) is slower and (with_table.bwd_s > without.bwd_s) is slower


def test_expert_parallelism_leaves_the_experts_gemms_whole():
    """examples/moe.py: the experts' Linears are marked inside the mixture-of-experts block; TP
    splits them, and under expert parallelism (torchtitan's ETP 1) they stay whole, so at tp 2
    their shares are those of the unsplit shapes."""
    from planner.model_file import load_model_file
    from planner.profile import profile_model
    from tests.conftest import EXAMPLES

    moe = profile_model(load_model_file(EXAMPLES / "moe.py"), batch_size=4, dtype="bf16", measure=False)
    block = next(l for l in moe.layers if l.tp is not None and l.tp.moe)
    roles = {role for *_, role in block.linears}
    assert {"col", "row", "moe:col", "moe:row"} <= roles
    # the example's experts are tiny (64 x 128, below the table): the same roles at 32x the sides
    experts = tuple((r * 64, n * 32, k * 32, role) for r, n, k, role in block.linears if role.startswith("moe:"))
    whole = tuple((r, n, k, "") for r, n, k, _ in experts)
    assert linear_factor(SM90, experts, 1.0, 2) != linear_factor(SM90, whole, 1.0, 2)
    assert linear_factor(SM90, whole, 1.0, 2) == linear_factor(SM90, whole, 1.0, 1)


def test_an_experts_gemm_runs_the_rows_routed_to_it():
    """A grouped GEMM of 32768 rows over 128 experts, 2048 -> 1536 (Qwen3-30B-A3B's fc1 at one
    sample of 4096 tokens, top-8): each expert's GEMM is 256 x 1536 x 2048 on one GPU; under
    expert parallelism 8 a rank's 16 experts each gather 8 ranks' rows, 2048 x 1536 x 2048, and
    run closer to the best rate. Weighted by the rank's rows beside a Linear."""
    grouped = ((32768, 1536, 2048, 128),)
    for ep in (1, 8):
        r = 32768 * ep / 128
        fwd, bwd = linear_factor(SM100, (), 1.0, 1, grouped, ep)
        assert fwd == pytest.approx(shape_efficiency(SM100, r, 1536, 2048))
        d, w = shape_efficiency(SM100, r, 2048, 1536), shape_efficiency(SM100, 1536, 2048, r)
        assert bwd == pytest.approx(2 / (1 / d + 1 / w))
    assert linear_factor(SM100, (), 1.0, 1, grouped, 1)[0] < 0.25 < 0.5 < linear_factor(SM100, (), 1.0, 1, grouped, 8)[0]
    linear = (4096, 4096, 2048, "")
    fwd, _ = linear_factor(SM100, (linear,), 1.0, 1, grouped, 8)
    e_lin, e_grp = shape_efficiency(SM100, 4096, 4096, 2048), shape_efficiency(SM100, 2048, 1536, 2048)
    f_lin, f_grp = 4096 * 4096 * 2048, 32768 * 1536 * 2048
    assert fwd == pytest.approx((f_lin + f_grp) / (f_lin / e_lin + f_grp / e_grp))
