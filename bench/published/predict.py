"""Profiling each row's model (once per shape, on fake tensors) and predicting the row's published
configuration with the planner's search."""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from planner.cost.setup import tensor_dtype
from planner.errors import BadInput
from planner.model_file import load_model_file
from planner.profile import profile_model
from planner.search.search import run_search
from planner.search.space import Fixed

from .models import model_source
from .rows import Row


def _profile(source: str, dtype: str):
    """Profile a model file's text on fake tensors (run in a worker process)."""
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.py"
        path.write_text(source)
        return profile_model(load_model_file(path), dtype=dtype, measure=False, force_meta=True)


class Profiles:
    """Profiles by shape (and tensor width), made on fake tensors once each per run."""

    def __init__(self) -> None:
        self.cache: dict[tuple, object] = {}
        self.seconds = 0.0

    @staticmethod
    def key(row: Row) -> tuple:
        # bf16, fp16, fp8 and fp4 (bf16 tensors, 8- or 4-bit Linear matmuls) profiles are the same: one serves all
        return row.shape, "bf16" if row.precision == "fp16" else tensor_dtype(row.precision)

    def prefetch(self, rows: list[Row], workers: int) -> None:
        """Profile every shape the rows need, `workers` at a time (one thread each)."""
        todo = list(dict.fromkeys(k for k in map(self.key, rows) if k not in self.cache))
        if not todo:
            return
        start = time.perf_counter()
        print(f"profiling {len(todo)} models on {workers} process(es) ...", file=sys.stderr, flush=True)
        if workers <= 1:
            for key in todo:
                self.cache[key] = _profile(model_source(key[0]), key[1])
        else:
            import concurrent.futures
            import multiprocessing

            ctx = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
                # largest first, so the long ones do not come last
                todo.sort(key=lambda k: -k[0].layers * k[0].hidden**2 * k[0].seq_len)
                futures = {key: pool.submit(_profile, model_source(key[0]), key[1]) for key in todo}
                for key, future in futures.items():
                    self.cache[key] = future.result()
        self.seconds += time.perf_counter() - start

    def get(self, row: Row):
        if self.key(row) not in self.cache:
            self.prefetch([row], workers=1)
        return self.cache[self.key(row)]


@dataclass
class Result:
    row: Row
    scored: object | None
    """The planner's Scored plan for the published configuration, None when refused."""
    need_bytes: float | None
    """When refused: the least memory per GPU the configuration needs."""
    seconds: float
    free: object | None = None
    free_s: float | None = None
    free_same_recompute: object | None = None
    """With --free: the free search with the row's recompute kept (None where the row leaves it free)."""
    tight: bool = False
    """It fits only without the allocator's fragmentation (search.SearchResult.tight)."""

    @property
    def step_s(self) -> float | None:
        return self.scored.step_time_s if self.scored else None

    @property
    def peak_bytes(self) -> float | None:
        return self.scored.evaluation.peak_bytes if self.scored else self.need_bytes

    @property
    def error(self) -> float | None:
        return self.step_s / self.row.measured_step_s - 1 if self.scored else None

    @property
    def memory_error(self) -> float | None:
        m = self.row.measured_peak_bytes
        return self.peak_bytes / m - 1 if m and self.peak_bytes else None


def predict(row: Row, profile, free: bool = False) -> Result:
    cluster, training = row.cluster(), row.training()
    start = time.perf_counter()
    found = run_search(profile, cluster, training, row.fixed, top_k=1)
    result = Result(row, found.best, None if found.best else found.min_need_bytes, time.perf_counter() - start,
                    tight=found.tight)
    if free:
        start = time.perf_counter()
        # every choice free but what the trainer can do: TP and EP overlap where the row's trainer runs them
        overlaps = Fixed(tp_overlap=row.fixed.tp_overlap, ep_overlap=row.fixed.ep_overlap)
        result.free = run_search(profile, cluster, training, overlaps, top_k=1).best
        result.free_s = time.perf_counter() - start
        if row.fixed.recompute is not None:
            # the trainers ran full recompute where less fits (Korthikanti et al. 2022 measured what that
            # costs): searched again with the row's recompute, what is left is the rest of the choice
            result.free_same_recompute = run_search(
                profile, cluster, training, replace(overlaps, recompute=row.fixed.recompute), top_k=1).best
    return result


def predict_all(rows: list[Row], profiles: Profiles, free: bool = False,
                unexpressed: list[tuple[str, str]] | None = None) -> list[Result]:
    """Each row's prediction; a row whose configuration the planner cannot express (a choice it
    refuses with BadInput: an expert parallelism it does not run, say) goes to `unexpressed` as
    (row id, why) instead, or raises where that list is not given."""
    out = []
    for row in rows:
        try:
            out.append(predict(row, profiles.get(row), free))
        except BadInput as exc:
            if unexpressed is None:
                raise
            unexpressed.append((row.id, str(exc)))
    return out
