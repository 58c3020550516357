"""Properties of run_search's answer, for any cluster size, batch, memory limit, precision and
fixed choices (hypothesis). Every plan in result.ranked must be a legal, fitting configuration
that honours what the user fixed, and the ranking must follow the documented order.
(tests/unit/test_search_consistency.py: how answers with different fixed choices relate.)"""

from __future__ import annotations

from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cost.constants import RESERVE_GPU_BYTES
from planner.cost.evaluate import evaluate
from planner.cost.setup import OPTIMIZERS, PRECISIONS, SCHEDULES, Training
from planner.cost.stage_costs import KIND_OF, KINDS, atoms_of
from planner.hardware import make_cluster
from planner.errors import BadInput
from planner.model_file import load_model_file
from planner.profile import profile_model
from planner.profile.types import ModelProfile
from planner.search.search import run_search
from planner.search.space import Fixed, memory_lower_bound, time_lower_bound
from tests.conftest import EXAMPLES
from tests.unit.test_partition import synthetic_profile

GIB = 2**30
GPUS = (1, 2, 4, 8, 16, 32)
GPUS_PER_NODE = 8  # a100-80gb's node: fewer GPUs make one partial node, more whole nodes
MODES = KIND_OF

# Memory limits per GPU (GiB) from "nothing fits" to "everything fits", per model: the 1 GiB
# reserve dominates the two small examples.
LIMITS_GIB = {"synthetic": (1.0, 24.0), "gpt": (1.0, 1.6), "llama": (1.0, 1.4)}


@lru_cache(maxsize=None)
def get_profile(name: str) -> ModelProfile:
    if name == "synthetic":
        # embedding, 8 blocks (16 heads, width 2048: TP 1-16 legal), head: 10 atoms, 0.5 B params
        return synthetic_profile(n_blocks=8, h=2048, s=1024, heads=16, vocab=32768)
    return profile_model(load_model_file(EXAMPLES / f"{name}.py"), measure=False)


@st.composite
def problems(draw):
    name = draw(st.sampled_from(sorted(LIMITS_GIB)))
    num_gpus = draw(st.sampled_from(GPUS))
    # mostly batches the cluster divides, sometimes any
    global_batch = draw(
        st.one_of(
            st.integers(1, 8).map(lambda k: k * num_gpus),
            st.sampled_from([num_gpus * 16, 256]),
            st.integers(1, 96),
        )
    )
    lo, hi = LIMITS_GIB[name]
    limit = int(draw(st.floats(lo, hi)) * GIB)
    precision = draw(st.sampled_from(PRECISIONS))
    optimizer = draw(st.sampled_from(OPTIMIZERS))
    fixed = Fixed(
        tp=draw(st.one_of(st.none(), st.none(), st.sampled_from([1, 2]))),
        pp=draw(st.one_of(st.none(), st.none(), st.sampled_from([1, 2, 4]))),
        cp=draw(st.one_of(st.none(), st.none(), st.sampled_from([1, 2]))),
        micro_batch=draw(st.one_of(st.none(), st.none(), st.sampled_from([1, 2, 3, 4]))),
        zero=draw(st.one_of(st.none(), st.none(), st.sampled_from([0, 1, 2, 3]))),
        schedule=draw(st.one_of(st.none(), st.none(), st.sampled_from(SCHEDULES))),
        virtual_stages=draw(st.one_of(st.none(), st.none(), st.none(), st.just(2))),
        recompute=draw(st.one_of(st.none(), st.none(), st.sampled_from(sorted(MODES)))),
    )
    top_k = draw(st.sampled_from([1, 3, 5]))
    return name, num_gpus, global_batch, limit, precision, optimizer, fixed, top_k


def check_ranking(ranked) -> None:
    """Best first by (score, simplicity); the best plan of each distinct shape."""
    keys = [s.key for s in ranked]
    assert keys == sorted(keys), keys
    shapes = [s.shape for s in ranked]
    assert len(shapes) == len(set(shapes)), shapes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_every_ranked_plan_is_legal_and_fits(problem):
    name, num_gpus, global_batch, limit, precision, optimizer, fixed, top_k = problem
    profile = get_profile(name)
    # FP8 needs FP8 tensor cores, NVFP4 Blackwell's FP4 ones and Transformer Engine's recipe
    gpu = {"fp8": "h100-sxm-80gb", "fp4": "b200"}.get(precision, "a100-80gb")
    cluster = make_cluster(gpu, num_gpus)
    assert cluster.gpus_per_node == min(GPUS_PER_NODE, num_gpus)
    training = Training(precision, optimizer, global_batch, limit, fp8_recipe="te" if precision == "fp4" else "torchao")
    if fixed.cp and fixed.cp > 1 and (profile.cp_blocker != "" or profile.seq_len % (2 * fixed.cp)):
        with pytest.raises(BadInput, match=f"--cp {fixed.cp}: "):  # a model or sequence CP cannot split
            run_search(profile, cluster, training, fixed, top_k)
        return
    result = run_search(profile, cluster, training, fixed, top_k)

    num_atoms = len(atoms_of(profile))
    required_tp = [l.tp for l in profile.layers if l.tp is not None and l.tp.required]
    for plan in result.ranked:
        c, ev, part, costs = plan.cand, plan.evaluation, plan.partition, plan.costs
        where = f"{name} {num_gpus} GPUs batch {global_batch} limit {limit} {fixed}: {c.label()}"
        assert c.dp * c.tp * c.pp * c.cp == num_gpus, where
        assert c.cp == 1 or (profile.cp_blocker == "" and profile.seq_len % (2 * c.cp) == 0), where
        assert c.dp * c.micro_batch * c.num_microbatches == global_batch, where
        assert c.tp == 1 or (required_tp and all(t.legal(c.tp) for t in required_tp)), where
        v = c.virtual_stages
        assert c.num_stages == c.pp * v and c.pp * v <= num_atoms, where
        assert v == 1 or (c.schedule == "interleaved" and c.pp > 1), where
        if c.schedule == "interleaved" and c.pp > 1:  # torch's ScheduleInterleaved1F1B: m // pp equal rounds
            assert c.num_microbatches % max(1, c.num_microbatches // c.pp) == 0, where
        bounds = list(part.bounds)
        assert len(bounds) == c.num_stages + 1 and bounds[0] == 0 and bounds[-1] == num_atoms, (where, bounds)
        assert all(a < b for a, b in zip(bounds, bounds[1:])), (where, bounds)
        assert len(part.choice) == num_atoms and set(part.choice) <= set(KINDS), where
        # every device fits, and the figures are evaluate()'s for the chosen assignment
        assert ev.fits and all(d.total_bytes <= limit for d in ev.devices), (where, ev.peak_bytes)
        assert ev == evaluate(costs, bounds, list(part.choice)), where
        assert sorted(a for d in ev.devices for a in d.atoms) == list(range(num_atoms)), where
        # the pruning bounds are bounds
        assert ev.step_time_s >= time_lower_bound(costs) * (1 - 1e-9), where
        assert ev.peak_bytes >= memory_lower_bound(costs) * (1 - 1e-9), where
        assert c.zero == 0 or c.dp * c.cp > 1, where
        # what the user fixed
        for key in ("tp", "pp", "dp", "cp", "micro_batch", "zero", "schedule"):
            want = getattr(fixed, key)
            assert want is None or getattr(c, key) == want, (where, key)
        if fixed.virtual_stages is not None and c.schedule == "interleaved" and c.pp > 1:
            assert v == fixed.virtual_stages, where
        if fixed.recompute is not None:
            assert set(part.choice) == {MODES[fixed.recompute]}, (where, part.choice)
    check_ranking(result.ranked)

    if result.data_parallel is not None:
        dp = result.data_parallel.cand
        assert (dp.tp, dp.pp, dp.cp, dp.zero, dp.dp) == (1, 1, 1, 0, num_gpus) and result.data_parallel.evaluation.fits
    if not result.ranked:
        # nothing fits: the result says how much memory the leanest candidate needs
        if result.stats.enumerated == 0:
            assert result.min_need_bytes is None  # no legal candidate at all (batch, fixed choices)
        else:
            assert result.min_need_bytes is not None and result.min_need_bytes > limit, (
                f"{name} {num_gpus} GPUs batch {global_batch} limit {limit} {fixed}: nothing ranked, "
                f"but {result.min_need_cand} needs only {result.min_need_bytes}"
            )


def test_need_respects_fixed_recompute():
    """Found by the property test: with recompute fixed to "none" nothing fits, and the need the
    search reports must be above the limit (it was computed with full recompute, below it)."""
    limit = 1_115_684_864
    result = run_search(
        get_profile("llama"), make_cluster("a100-80gb", 8), Training("bf16", "adamw", 8, limit),
        Fixed(micro_batch=4, recompute="none", cp=1), top_k=1,  # (context parallelism would fit it)
    )
    assert result.ranked == []
    assert result.min_need_bytes is not None and result.min_need_bytes > limit, (result.min_need_cand, result.min_need_bytes)


def test_time_lower_bound_is_a_bound():
    """Found by the property test: a ZeRO-2 pipeline whose slowest rank holds fewer atoms than
    the average; the bound charged it the average number of per-atom collective latencies."""
    result = run_search(
        get_profile("gpt"), make_cluster("a100-80gb", 32), Training("bf16", "adamw", 128, int(1.5 * GIB)),
        Fixed(zero=2), top_k=3,
    )
    assert result.ranked
    for plan in result.ranked:
        assert plan.step_time_s >= time_lower_bound(plan.costs) * (1 - 1e-9), plan.cand.label()


@pytest.mark.parametrize("name", sorted(LIMITS_GIB))
def test_nothing_fits_reports_the_need(name):
    """Below the reserve nothing fits: the search says so and how much the leanest plan needs."""
    profile = get_profile(name)
    limit = RESERVE_GPU_BYTES // 2
    result = run_search(profile, make_cluster("a100-80gb", 8), Training("bf16", "adamw", 64, limit))
    assert result.ranked == [] and result.status == "infeasible"
    assert result.min_need_bytes is not None and result.min_need_bytes > limit
    assert result.data_parallel is None and result.data_parallel_need_bytes > limit


@pytest.mark.parametrize("name", sorted(LIMITS_GIB))
def test_generous_limit_finds_plans(name):
    profile = get_profile(name)
    result = run_search(profile, make_cluster("a100-80gb", 8), Training("bf16", "adamw", 64, 80 * GIB), top_k=3)
    assert result.ranked and result.status == "optimal"
    assert len({s.shape for s in result.ranked}) == len(result.ranked) >= 3
    check_ranking(result.ranked)


def test_the_search_tries_every_chunk_count_that_splits_a_ranks_layers_evenly():
    """Interleaved 1F1B's chunks per rank: 2-4, and the divisors of the atoms a rank holds above them
    (NeMo's Nemotron-4 340B runs 12 one-layer chunks on each of 8 ranks: 96 blocks and 3 other atoms;
    its Llama 3.1 405B 7 chunks of two on 9), while every stage keeps an atom."""
    from planner.search.space import interleave_options

    assert interleave_options(99, 8) == [2, 3, 4, 6, 12]
    assert interleave_options(129, 9) == [2, 3, 4, 7, 14]
    assert interleave_options(10, 4) == [2]  # 3 chunks of 4 ranks would need 12 atoms
    assert interleave_options(4, 4) == []
