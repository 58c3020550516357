"""The plan's explanation of recompute: what it costs the step is its time on the slowest rank."""

from types import SimpleNamespace as NS

from planner.search.explain import _recompute_line


def _device(rank: int, per_microbatch_s: float, recompute_s: float) -> NS:
    return NS(rank=rank, time_per_microbatch_s=per_microbatch_s, compute_s=per_microbatch_s - recompute_s,
              recompute_s=recompute_s, tp_comm_s=0.0, cp_comm_s=0.0, ep_comm_s=0.0, p2p_s=0.0, sync_s=0.0)


def _scored(*devices: NS) -> NS:
    return NS(evaluation=NS(devices=devices, pipeline_s=1.0), cand=NS(num_microbatches=8), optimizer_s=lambda: [0.0])


def test_recompute_on_the_slowest_stage_costs_the_step():
    line = _recompute_line(_scored(_device(0, 0.010, 0.0), _device(1, 0.012, 0.002)), "full")
    assert line == "Recompute (full) trades 16.00 ms per step for activation memory.", line


def test_recompute_only_off_the_slowest_stage_costs_nothing():
    """A pipeline's first stage holds the most micro-batches' activations: it may recompute and
    still finish before the slowest stage, which sets the pace."""
    line = _recompute_line(_scored(_device(0, 0.010, 0.002), _device(1, 0.012, 0.0)), "mixed")
    assert line == ("Recompute (mixed) runs on rank 0, for its activation memory, and costs the step nothing: "
                    "the slowest stage does not recompute.")
    line = _recompute_line(_scored(_device(0, 0.010, 0.002), _device(1, 0.011, 0.001), _device(2, 0.012, 0.0)), "mixed")
    assert line.startswith("Recompute (mixed) runs on ranks 0, 1, for their activation memory")
