"""Find the Megatron-style tensor-parallel plan of one layer: which ``nn.Linear`` to shard how.

A plan is column-wise then row-wise pairs (Shoeybi et al. 2019): a column-wise Linear splits its
output features over the TP ranks (``ColwiseParallel``: replicated input, sharded output), the
row-wise Linear after it splits its input features (``RowwiseParallel``: sharded input, partial
sums all-reduced into a replicated output). One forward all-reduce per row-wise Linear, and one in
backward for the column-wise inputs' gradient. Only ``nn.Linear`` is ever sharded: never GPT-2's
``Conv1D`` nor a fused projection (``qkv``, ``gate_up``), which plain ``ColwiseParallel`` splits wrong.

Rules, in priority order (names are relative to the layer, as in ``layer.named_modules()``):

1. Hugging Face plan: when ``model`` carries one (``model._tp_plan``, the whole model's plan with
   the base-model prefix, e.g. ``"model.layers.*.mlp.down_proj": "rowwise"``; or
   ``model.config.base_model_tp_plan``, relative to the base model), its patterns (``*`` = one name
   part) are matched against ``layer_name + "." + sub_name`` with and without the prefix. Only the
   styles that are exactly ``ColwiseParallel``/``RowwiseParallel`` count (``colwise``,
   ``local_colwise``; ``rowwise``, ``local_rowwise``); gathering variants (``colwise_rep``,
   ``colwise_gather_output``, ``rowwise_split_input``, ...) and packed/expert/embedding styles
   are ignored. When the plan names any module of the layer it is authoritative: no fallback.
2. Names: in each parent module, direct ``nn.Linear`` children named in ``COLWISE_NAMES`` /
   ``ROWWISE_NAMES``; the parent is taken only when every Linear child is classified.
3. Structure: a parent whose only parameters are two ``nn.Linear`` children A (h -> f) then
   B (f -> h) in registration order (the call order is not visible), neither with a name of
   rule 2: A column-wise, B row-wise.

Every rule keeps a parent's Linears only as a pair (at least one column-wise and one row-wise in
the same parent), so a sharded output always meets a row-wise input. ``None``: no pair (embeddings,
norms, heads, convolutional blocks). Code between the pair that needs the whole model's features
(a per-head table with a row for every head, a norm over all heads) is found by running the block
split on fake tensors (planner.profile.tp_roles.split_blocker), which then leaves it whole. Not
found: a ``view`` with a hard-coded head count that still reshapes a shard (each head a slice of
its features, not whole heads), which runs but is not the same model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

from torch import nn

COLWISE_NAMES = frozenset(
    "q k v q_proj k_proj v_proj query key value wq wk wv up up_proj gate_proj gate w1 w3 "
    "fc1 fc_in c_fc dense_h_to_4h".split()
)
ROWWISE_NAMES = frozenset(
    "o o_proj out_proj proj wo down down_proj w2 fc2 fc_out dense_4h_to_h c_proj dense".split()
)
HEAD_COUNT_NAMES = (
    "n_head", "n_heads", "num_heads", "num_attention_heads",
    "n_kv_heads", "num_kv_heads", "num_key_value_heads", "n_kv_head",
)
CONFIG_ATTRS = ("config", "cfg", "args", "params")
HF_COLWISE = frozenset({"colwise", "local_colwise"})
HF_ROWWISE = frozenset({"rowwise", "local_rowwise"})


@dataclass(frozen=True)
class TPPlan:
    """The Linears of one layer that tensor parallelism shards, and the TP degrees it allows."""

    colwise: tuple[str, ...]
    """``nn.Linear`` sharded column-wise (output features), names relative to the layer."""
    rowwise: tuple[str, ...]
    """``nn.Linear`` sharded row-wise (input features); each output is all-reduced in forward."""
    divisors: tuple[int, ...]
    """Head and kv-head counts (sorted, unique): the TP degree must divide each."""
    sizes: tuple[int, ...]
    """Sharded feature sizes: colwise out_features, then rowwise in_features, in name order."""
    source: str
    """"hf_tp_plan", "names" or "structure": the rule that found the plan."""

    @property
    def num_allreduces(self) -> int:
        """Forward all-reduces per call of the layer (as many in backward)."""
        return len(self.rowwise)

    def legal(self, tp: int) -> bool:
        """True when `tp` divides every head count and every sharded feature size."""
        return tp >= 1 and all(n % tp == 0 for n in (*self.divisors, *self.sizes))

    @property
    def max_tp(self) -> int:
        """The largest legal TP degree (the gcd of divisors and sizes)."""
        return math.gcd(*self.divisors, *self.sizes)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _pairs(linears: dict[str, nn.Linear], col: list[str], row: list[str]) -> tuple[list[str], list[str]]:
    """Keep the parents that hold at least one column-wise and one row-wise Linear."""
    col = [n for n in col if n in linears]
    row = [n for n in row if n in linears]
    both = {_parent(n) for n in col} & {_parent(n) for n in row}
    return [n for n in col if _parent(n) in both], [n for n in row if _parent(n) in both]


def _hf_patterns(model: nn.Module) -> dict[str, str]:
    """The model's Hugging Face TP plan (pattern -> style): its own, then its config's base plan."""
    plans: dict[str, str] = {}
    config = getattr(model, "config", None)
    for plan in (getattr(model, "_tp_plan", None), getattr(config, "base_model_tp_plan", None)):
        if isinstance(plan, dict):
            plans.update({k: v for k, v in plan.items() if isinstance(v, str) and k not in plans})
    return plans


def _hf_rule(layer: nn.Module, model: nn.Module, layer_name: str) -> tuple[list[str], list[str]] | None:
    """(colwise, rowwise) from the HF plan, or None when the plan names no module of the layer."""
    plans = _hf_patterns(model)
    if not plans:
        return None
    regexes = [(re.compile(re.escape(p).replace(r"\*", r"[^.]+")), s) for p, s in plans.items()]
    prefix = getattr(model, "base_model_prefix", "")
    col: list[str] = []
    row: list[str] = []
    named_any = False
    for sub, module in layer.named_modules():
        if not sub:
            continue
        full = f"{layer_name}.{sub}" if layer_name else sub
        names = {full, full.removeprefix(f"{prefix}.")} if prefix else {full}
        style = next((s for rx, s in regexes for n in names if rx.fullmatch(n)), None)
        if style is None:
            continue
        named_any = True
        if isinstance(module, nn.Linear):
            (col if style in HF_COLWISE else row if style in HF_ROWWISE else []).append(sub)
    return (col, row) if named_any else None


def _structure_rule(layer: nn.Module) -> tuple[list[str], list[str]]:
    col: list[str] = []
    row: list[str] = []
    for parent_name, parent in layer.named_modules():
        kids = [(n, m) for n, m in parent.named_children() if isinstance(m, nn.Linear)]
        linear_params = sum(p.numel() for _, m in kids for p in m.parameters())
        if len(kids) != 2 or sum(p.numel() for p in parent.parameters()) != linear_params:
            continue  # not exactly two Linears, or other parameters (a norm) between them
        if any(n in COLWISE_NAMES or n in ROWWISE_NAMES for n, _ in kids):
            continue  # the names rule had its say (two column-wise q and k are no pair)
        (a_name, a), (b_name, b) = kids
        if a.out_features == b.in_features and a.in_features == b.out_features:
            col.append(f"{parent_name}.{a_name}" if parent_name else a_name)
            row.append(f"{parent_name}.{b_name}" if parent_name else b_name)
    return col, row


def _names_rule(linears: dict[str, nn.Linear]) -> tuple[list[str], list[str]]:
    by_parent: dict[str, list[str]] = {}
    for name in linears:
        by_parent.setdefault(_parent(name), []).append(name)
    col: list[str] = []
    row: list[str] = []
    for kids in by_parent.values():
        last = [n.rpartition(".")[2] for n in kids]
        if all(x in COLWISE_NAMES or x in ROWWISE_NAMES for x in last):
            col += [n for n, x in zip(kids, last) if x in COLWISE_NAMES]
            row += [n for n, x in zip(kids, last) if x in ROWWISE_NAMES]
    return col, row


def _head_counts(objects: Iterable[Any]) -> set[int]:
    found: set[int] = set()
    for obj in objects:
        for attr in HEAD_COUNT_NAMES:
            value = getattr(obj, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                found.add(value)
    return found


def _divisors(layer: nn.Module, model: nn.Module | None) -> tuple[int, ...]:
    holders: list[Any] = []
    for module in layer.modules():  # the modules and their config objects (self.config, self.cfg)
        configs = (getattr(module, a, None) for a in CONFIG_ATTRS)
        holders += [module, *(c for c in configs if c is not None and not isinstance(c, nn.Module))]
    if model is not None:
        for a in ("config", "cfg"):
            cfg = getattr(model, a, None)
            if cfg is not None:
                text = getattr(cfg, "get_text_config", None)
                holders.append(text() if callable(text) else cfg)
    return tuple(sorted(_head_counts(holders)))


def find_tp_plan(layer: nn.Module, model: nn.Module | None = None, layer_name: str = "") -> TPPlan | None:
    """The TP plan of `layer` (rules in the module docstring), or None when it has no Linear pair.

    `model` is the whole model (for a Hugging Face plan and config) and `layer_name` the layer's
    name in it; when empty and `model` is given, the name is looked up."""
    if model is not None and not layer_name and layer is not model:
        layer_name = next((n for n, m in model.named_modules() if m is layer), "")
    linears = {n: m for n, m in layer.named_modules() if n and isinstance(m, nn.Linear)}
    hf = _hf_rule(layer, model, layer_name) if model is not None else None
    if hf is not None:
        col, row, source = *_pairs(linears, *hf), "hf_tp_plan"
    else:
        col, row, source = *_pairs(linears, *_names_rule(linears)), "names"
        if not row:
            col, row, source = *_pairs(linears, *_structure_rule(layer)), "structure"
    if not col or not row:
        return None
    sizes = tuple(linears[n].out_features for n in col) + tuple(linears[n].in_features for n in row)
    return TPPlan(tuple(col), tuple(row), _divisors(layer, model), sizes, source)


def tp_param_count(layer: nn.Module, plan: TPPlan) -> int:
    """Parameters that TP divides: column-wise weights and biases, row-wise weights (row-wise
    biases are added after the all-reduce, so they stay replicated)."""
    modules = dict(layer.named_modules())
    col = sum(p.numel() for n in plan.colwise for p in modules[n].parameters())
    return col + sum(modules[n].weight.numel() for n in plan.rowwise)
