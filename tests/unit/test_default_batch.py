"""The default global batch (planner/default_batch.py) and how a what-if sweep holds it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner import default_batch, planning
from planner.model_file import load_model_file
from planner.report.whatif import Batching, SweepSpec, plan_line, run_sweep
from tests.conftest import EXAMPLES
from tests.unit.test_partition import synthetic_profile


@pytest.fixture(scope="module")
def gpt_profile():
    handle = load_model_file(EXAMPLES / "gpt.py")
    return handle, planning.profile_for(handle, planning.PlanRequest(gpus=1))


def test_token_budget_follows_gpt3_table():
    # the rows of Brown et al. 2020 Table 2.1 exactly, and monotone in between
    assert default_batch.tokens_per_step(125e6) == 0.5e6
    assert default_batch.tokens_per_step(1.3e9) == pytest.approx(1e6)
    assert default_batch.tokens_per_step(6.7e9) == pytest.approx(2e6)
    assert default_batch.tokens_per_step(175e9) == pytest.approx(3.2e6)
    assert default_batch.tokens_per_step(1e6) == 0.5e6 and default_batch.tokens_per_step(1e12) == 3.2e6
    sizes = [10 ** (6 + k / 4) for k in range(25)]
    budgets = [default_batch.tokens_per_step(n) for n in sizes]
    assert budgets == sorted(budgets)


def _llm(params: float, seq: int):
    """A synthetic sequence model with `params` parameters (its layers' counts scaled)."""
    p = synthetic_profile(n_blocks=2, s=seq)
    k = params / p.num_params
    layers = tuple(replace(l, num_params=int(l.num_params * k)) for l in p.layers)
    return replace(p, layers=layers, totals=replace(p.totals, num_params=sum(l.num_params for l in layers)), seq_len=seq)


def test_a_7b_model_trains_with_about_2m_tokens_rounded_for_the_cluster():
    profile = _llm(6.7e9, 4096)
    d = default_batch.for_cluster(profile, 8, on_cpu=False)
    # 2M tokens / 4096 = 488 sequences: 8 GPUs x 64 (the nearest power of two per GPU)
    assert d.global_batch == 512
    assert "2M tokens" in d.basis and "Brown et al. 2020" in d.basis
    for n in (1, 2, 3, 8, 24, 64, 96):
        b = default_batch.for_cluster(profile, n, on_cpu=False).global_batch
        assert b % n == 0 and 488 / 1.5 <= b <= 488 * 1.5, (n, b)
        assert (b // n) & (b // n - 1) == 0, (n, b)  # a power of two per GPU: micro-batches split it


def test_more_gpus_than_sequences_gives_one_per_gpu():
    profile = _llm(175e9, 131072)  # 3.2M tokens = 24 sequences of 128k
    assert default_batch.for_cluster(profile, 1024, on_cpu=False).global_batch == 1024


def test_models_without_a_sequence_take_samples_per_gpu():
    profile = replace(synthetic_profile(n_blocks=2), seq_len=None)
    assert default_batch.for_cluster(profile, 8, on_cpu=False).global_batch == 8 * default_batch.SAMPLES_PER_GPU
    assert default_batch.for_cluster(profile, 4, on_cpu=True).global_batch == 4 * default_batch.SAMPLES_PER_CPU_PROCESS


def test_sweep_holds_one_batch_that_every_count_divides():
    profile = _llm(6.7e9, 4096)
    spec = SweepSpec(gpu_types=("h100-sxm-80gb",), gpu_counts=(8, 16, 24, 32, 64))
    b = Batching.of(profile, spec, on_cpu=False)
    assert all(b.for_count(n) == (b.global_batch, "") for n in spec.gpu_counts)
    assert b.global_batch % 192 == 0  # lcm(8, 16, 24, 32, 64)
    # one count equals plan's default for that count
    single = Batching.of(profile, replace(spec, gpu_counts=(8,)), on_cpu=False)
    assert single.global_batch == default_batch.for_cluster(profile, 8, on_cpu=False).global_batch


def test_a_count_the_batch_does_not_split_over_gets_the_nearest_and_says_so():
    profile = _llm(6.7e9, 4096)
    spec = SweepSpec(gpu_types=("h100-sxm-80gb",), gpu_counts=(8, 1024))
    b = Batching.of(profile, spec, on_cpu=False)
    assert b.global_batch == 512
    batch, note = b.for_count(1024)
    assert batch == 1024 and "512 does not split over 1024 GPUs" in note
    # a batch the user fixed is the user's: never rounded (the search finds a dp that divides it)
    fixed = Batching.of(profile, replace(spec, global_batch=500), on_cpu=False)
    assert fixed.for_count(1024) == (500, "")


def test_scale_batch_keeps_samples_per_gpu():
    profile = _llm(6.7e9, 4096)
    spec = SweepSpec(gpu_types=("h100-sxm-80gb",), gpu_counts=(8, 16, 64), scale_batch=True)
    b = Batching.of(profile, spec, on_cpu=False)
    per_gpu = b.global_batch // 8
    assert [b.for_count(n)[0] for n in spec.gpu_counts] == [per_gpu * n for n in spec.gpu_counts]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    counts=st.sets(st.sampled_from((1, 2, 3, 4, 8, 16)), min_size=1, max_size=3),
    gpu=st.sampled_from(("a100-80gb", "h100-sxm-80gb")),
    limit=st.sampled_from((None, 1.3, 2.0)),
)
def test_whatif_rows_are_plan_at_the_row_batch(gpt_profile, counts, gpu, limit):
    """A what-if row is `plan` for that cluster and global batch; one batch unless a row says why."""
    handle, profile = gpt_profile
    spec = SweepSpec(gpu_types=(gpu,), gpu_counts=tuple(sorted(counts)), memory_limit_gib=limit)
    sweep = run_sweep(handle, spec, profile=profile)
    assert {p.global_batch for p in sweep.points if not p.batch_note} <= {sweep.batching.global_batch}
    for p in sweep.points:
        request = spec.request(gpu, p.num_gpus, p.global_batch)
        if not p.fits:
            assert not planning.feasible(profile, request)
            continue
        plan = planning.make_plan(handle, request, profile=profile)
        assert p.plan == plan_line(plan)  # the plan's line, marked when tight
        assert p.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
