"""Types the runtime's modules share: a layer as the runtime shards it (LayerSplit, with its
TPRole), a plan that passed the preflight checks (Prepared), and small constants.

A leaf module: it imports nothing from the runtime, so preflight, layout, the parallelisms, the
pipeline and the worker all import it without importing one another.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from planner.model_file import ModelHandle
from planner.plan import Plan
from planner.profile.types import TPInfo

NO_BLOCK = "the model has no block with a column/row-wise Linear pair"
"""The sp_blocker of a model where only embeddings and the head split (nothing to warn about)."""


@dataclass(frozen=True)
class TPRole:
    """How tensor parallelism treats one layer besides its TPInfo (names relative to the layer)."""

    kind: str
    """"embedding", "block", "norm", "head" or "other"."""
    seq_len: int | None = None
    """The model's sequence length (the second dim of its 2-D integer input), None without one."""
    seq_dim: int | None = None
    """embedding: the dim of its output that is the sequence (1 for [batch, seq, hidden], 0 for
    position embeddings [seq, hidden]); None when it has none."""
    norms: tuple[str, ...] = ()
    """block: norm-like submodules on the hidden states, run sequence-parallel."""
    gathers: tuple[str, ...] = ()
    """block: submodules whose one input feeds all their column-wise Linears: gathered once."""
    sp_blocker: str = ""
    """Why sequence parallelism cannot run in this model ("" when it can): the same in every layer."""
    tied: str = ""
    """embedding/head: the parameter of another layer that shares its weight ("" when none)."""
    loss_blocker: str = ""
    """head: why its logits cannot stay vocabulary-sharded into the loss ("" when they can)."""
    shard_dropout: tuple[str, ...] = ()
    """Dropout modules (p > 0) of the model outside the gathered submodules: with sequence
    parallelism they run on each rank's sequence shard (the same in every layer)."""


@dataclass(frozen=True)
class LayerSplit:
    """One layer of the model as the runtime shards it."""

    name: str
    """The layer's main module (``blocks.3``), as in plan.model.layer_names."""
    tp: TPInfo | None
    """Its tensor-parallel plan (column-/row-wise Linear names relative to the layer), or None."""
    role: TPRole | None = None
    """What else tensor parallelism does to it (vocabulary-parallel embedding or head, sequence
    parallelism; runtime.tp_structure); None when unknown (its Linear pair only, as before)."""


@dataclass(frozen=True)
class Prepared:
    """A plan that passed the checks, with what the launcher and the workers need."""

    plan: Plan
    plan_path: Path
    handle: ModelHandle
    layers: tuple[LayerSplit, ...]
    device_type: str
    """"cpu" (gloo) or "cuda" (nccl)."""

    @property
    def world_size(self) -> int:
        p = self.plan.parallel
        return p.dp * p.tp * p.pp
