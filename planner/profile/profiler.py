"""profile_model: ModelHandle -> ModelProfile.

1. Build the model as fake tensors (free, any size) and trace one step: FLOPs, saved bytes, flows
   (a long stack of identical blocks through 4 of them, the others copied: repeats.py).
2. If it fits in RAM (and --meta was not asked), build it for real, trace again on real tensors
   and, when asked, time each unit. Otherwise keep the fake trace: no timings.
3. Group units into layers, attribute parameters, find the tensors crossing each cut, and mark
   identical layers as one kind.
"""

from __future__ import annotations

import logging
import math
import os
import time
import traceback
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from planner.errors import BadInput
from planner.model_file import ModelHandle
import planner.profile.materialize as mat
from planner.profile.layers import Unit, find_units, group_units, has_params
from planner.profile.moe import balanced_dispatch, find_moe
from planner.profile.repeats import MIN_BLOCKS, find_stacks, trace_with_repeats
from planner.profile.split import meta_trace_split
from planner.profile.timing import time_units
from planner.profile.trace import BEFORE_ANY, TraceResult, run_trace, storage_key
from planner.profile.tp_plan import find_tp_plan, tp_param_count
from planner.profile.tp_roles import tp_roles
from planner.profile.types import Edge, LayerProfile, ModelProfile, ProfileTotals, TPInfo, plain_from

FAKE_ERRORS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


def _input_shapes(inputs: Any) -> dict[str, tuple[int, ...]]:
    if isinstance(inputs, torch.Tensor):
        items = [("input", inputs)]
    elif isinstance(inputs, dict):
        items = list(inputs.items())
    else:
        items = [(f"arg{i}", t) for i, t in enumerate(inputs)]
    return {k: tuple(v.shape) for k, v in items if isinstance(v, torch.Tensor)}


def seq_len_of(inputs: Any) -> int | None:
    """The sequence length: the second dim of the first 2-D integer input (token ids), if any."""
    values = inputs.values() if isinstance(inputs, dict) else ([inputs] if isinstance(inputs, torch.Tensor) else inputs)
    for t in values:
        if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point():
            return int(t.shape[1])
    return None


def _trace_fake(handle: ModelHandle, dtype: torch.dtype, inputs: Any, targets: Any, reuse_min_blocks: int | None):
    """Build the model on fake tensors and trace one step: through a few blocks of each long stack
    of identical ones when that is shown to give the whole trace (repeats.py), else every block."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = mat.build_meta(handle, dtype)
    balanced_dispatch(model)
    units = find_units(model)
    stacks = find_stacks(model, units, reuse_min_blocks) if reuse_min_blocks is not None else []
    # blocks that no run of the shortcut calls keep their meta tensors (shapes are all it reads)
    mat.make_fake(model, fake_mode, tuple(m for s in stacks for m in s.untraced))
    # FakeTensorMode logs a full traceback when an op fails (e.g. a batch the forward rejects);
    # the user gets our one-line error instead. (Set after import: torch resets it at import.)
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        with fake_mode:
            f_inputs, f_targets = mat.fake_batch(inputs, fake_mode), mat.fake_batch(targets, fake_mode)
            trace = trace_with_repeats(handle, model, units, stacks, f_inputs, f_targets) if stacks else None
        if trace is None:
            if stacks:  # the runs may have changed the model's Python state: start afresh
                stacks = []
                fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
                model = mat.build_meta(handle, dtype)
                balanced_dispatch(model)
                model = mat.make_fake(model, fake_mode)
                units = find_units(model)
            with fake_mode:
                f_inputs, f_targets = mat.fake_batch(inputs, fake_mode), mat.fake_batch(targets, fake_mode)
                trace = run_trace(handle, model, units, f_inputs, f_targets)
    finally:
        fake_log.setLevel(level)
    members = tuple(tuple(units[i].name for i in s.members) for s in stacks)
    return model, units, trace, _FakeModel(model, fake_mode, members)


@dataclass(frozen=True)
class _FakeModel:
    """The model as the fake trace left it: its fake mode, and the stacks whose interior blocks
    it did not run (repeats.py; their tensors are still meta)."""

    model: torch.nn.Module
    mode: FakeTensorMode
    stacks: tuple[tuple[str, ...], ...]


def _with_roles(handle: ModelHandle, fake: _FakeModel | None, dtype: torch.dtype, layers: list[LayerProfile],
                seq_len: int | None, warnings: list[str]) -> list[LayerProfile]:
    """`layers` with their TPRole (tp_roles.py) when any has a TPInfo; a warning when none could be found."""
    if not any(layer.tp is not None for layer in layers):
        return layers
    if fake is None and dtype != torch.bfloat16:
        # The roles read shapes and how tensors flow, not values: where the trace's dtype failed on
        # fake tensors (torch's meta _grouped_mm takes bf16 only: a Hugging Face MoE in fp32), in bf16.
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = mat.build_meta(handle, torch.bfloat16)
        balanced_dispatch(model)
        fake, dtype = _FakeModel(mat.make_fake(model, fake_mode), fake_mode, ()), torch.bfloat16
    found = "the forward on fake tensors failed" if fake is None else tp_roles(
        handle, fake.model, fake.mode, dtype, tuple(layers), seq_len, fake.stacks)
    if isinstance(found, str):
        warnings.append(f"what tensor parallelism may split beyond the Linear pairs is unknown ({found}): "
                        "no sequence parallelism, and the logits are gathered before the loss")
        return layers
    whole = [(layer.name, role.split_blocker) for layer, role in zip(layers, found) if role.split_blocker]
    if whole:
        warnings.append(f"tensor parallelism leaves {len(whole)} layer(s) whole on every rank: {whole[0][1]}")
    return [replace(layer, tp=None if role.split_blocker else layer.tp, tp_role=role)
            for layer, role in zip(layers, found)]


def _is_fake_failure(exc: BaseException) -> bool:
    """Whether the fake trace failed for want of real tensors: an op whose output depends on
    values, or a meta kernel stricter than the real one (torch's meta _grouped_mm takes bf16 only,
    its CPU kernel fp32 too: a Hugging Face MoE profiled in fp32). A real trace then decides."""
    while exc is not None:
        if isinstance(exc, FAKE_ERRORS):
            return True
        if any(frame.filename.endswith(META_KERNELS) for frame in traceback.extract_tb(exc.__traceback__)):
            return True
        exc = exc.__cause__
    return False


META_KERNELS = os.path.join("torch", "_meta_registrations.py")


def _one_line(exc: BaseException) -> str:
    """The innermost cause of `exc`, on one line."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def profile_model(
    handle: ModelHandle,
    *,
    batch_size: int = 1,
    dtype: str = "bf16",
    force_meta: bool = False,
    measure: bool = True,
    repeats: int = 3,
    check_split: bool = True,
    reuse_min_blocks: int | None = MIN_BLOCKS,
) -> ModelProfile:
    """`check_split`: when some cut is not a plain hand-over of one layer's output, try the
    pipelining tracer on the meta-built model (seconds) to see whether it can be cut there.

    `reuse_min_blocks`: on fake tensors, a stack (ModuleList/Sequential) of at least this many
    blocks (4 at least) whose interior blocks are alike is traced through a few of them, and the
    others' figures are copies of the representative's, after a check that this reproduces one
    more traced block exactly (repeats.py); None traces every block."""
    start = time.perf_counter()
    tdtype = mat.torch_dtype(dtype)
    inputs, targets = handle.sample_batch(batch_size)
    inputs, targets = mat.cast_floats(inputs, tdtype), mat.cast_floats(targets, tdtype)
    warnings: list[str] = []

    fake_error: BaseException | None = None
    fake: _FakeModel | None = None
    try:
        with mat.one_sequence_per_row():
            model, units, trace, fake = _trace_fake(handle, tdtype, inputs, targets, reuse_min_blocks)
        activation_bytes = sum(trace.saved_bytes.values())
        num_params = sum(p.numel() for p in model.parameters())
    except BadInput as exc:
        if not _is_fake_failure(exc):
            raise
        fake_error = exc
        with torch.device("meta"):
            num_params = sum(p.numel() for p in handle.build_model().parameters())
        activation_bytes = 0

    need = mat.materialised_bytes_estimate(num_params, tdtype, activation_bytes)
    avail = mat.available_ram_bytes()
    fits = need < mat.RAM_SHARE * avail
    if fake_error is not None and (force_meta or not fits):
        raise BadInput(
            f"{handle.path}: cannot profile on fake tensors (the forward depends on tensor values, or an op's fake "
            f"kernel refuses it: "
            f"{fake_error.__cause__}) and the model is too large to run for real"
        ) from fake_error
    mode, device = "meta", "fake"
    if fake_error is not None:
        warnings.append("the forward cannot run on fake tensors (it depends on tensor values, or an op's fake kernel "
                        f"refuses it: {_one_line(fake_error)}); profiled on real tensors instead")
    # Materialise only to measure time (a real trace gives the same FLOPs and bytes as the fake
    # one, tests/unit check it) or when the fake trace failed.
    if not force_meta and fits and (measure or fake_error is not None):
        model = mat.build_materialised(handle, tdtype)
        units = find_units(model)
        trace = run_trace(handle, model, units, inputs, targets)  # doubles as the timing warm-up
        mode, device = "materialized", "cpu"
    elif measure and not force_meta:
        warnings.append(
            f"materialising needs about {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available: "
            "profiled on fake tensors, no timings"
        )
    fwd_s = bwd_s = None
    thread_speedup = None
    if mode == "materialized" and measure:
        first = trace.order[0] if trace.order else 0
        fwd_s, bwd_s = time_units(handle, model, units, first, inputs, targets, repeats)
        threads = torch.get_num_threads()
        if threads > 1:  # what the threads bought: processes that share the cores get fewer
            torch.set_num_threads(1)
            try:
                serial = time_units(handle, model, units, first, inputs, targets, repeats)
            finally:
                torch.set_num_threads(threads)
            thread_speedup = max(1.0, (sum(serial[0]) + sum(serial[1])) / max(sum(fwd_s) + sum(bwd_s), 1e-12))

    layers, edges = _assemble(model, units, trace, fwd_s, bwd_s, warnings)
    split, split_note = "sequential", None
    # The tracer (seconds) is tried only where it can open a cut worth having: next to a block of a
    # stack (a cut between two embeddings, as in examples/gpt.py, is not worth the time).
    stacked = {u.name for u in units if u.in_container}
    in_stack = [any(m in stacked for m in layer.modules) for layer in layers]
    open_cuts = [i for i in range(len(layers) - 1) if not layers[i].cut_after_ok and (in_stack[i] or in_stack[i + 1])]
    # A valid cut followed by glue between later layers (a head slicing the norm's output) needs
    # the tracer too: the runtime splits without it only where the layers run in sequence.
    first_plain = plain_from(layers)
    glued = any(layer.cut_after_ok and layer.index < first_plain for layer in layers[:-1])
    if check_split and (open_cuts or glued):
        layers, split, split_note = _traced_cuts(handle, tdtype, inputs, layers)
    with mat.one_sequence_per_row():
        layers = _with_roles(handle, fake, tdtype, layers, seq_len_of(inputs), warnings)
    totals = ProfileTotals(
        num_params=sum(lp.num_params for lp in layers),
        param_bytes=sum(lp.param_bytes for lp in layers),
        fwd_flops=sum(lp.fwd_flops for lp in layers),
        bwd_flops=sum(lp.bwd_flops for lp in layers),
        activation_bytes=sum(lp.activation_bytes for lp in layers),
        fwd_s=sum(lp.fwd_s for lp in layers) if fwd_s is not None else None,
        bwd_s=sum(lp.bwd_s for lp in layers) if bwd_s is not None else None,
    )
    uncounted = tuple(f"{name} (x{n})" for name, n in sorted(trace.uncounted_ops.items()))
    if uncounted:
        warnings.append(f"{len(uncounted)} op(s) have no FLOP formula and count as 0: " + ", ".join(uncounted))
    return ModelProfile(
        model_name=handle.name,
        source_sha256=handle.source_sha256,
        batch_size=batch_size,
        dtype=dtype,
        mode=mode,
        device=device,
        input_shapes=_input_shapes(inputs),
        seq_len=seq_len_of(inputs),
        layers=tuple(layers),
        edges=tuple(edges),
        totals=totals,
        uncounted_ops=uncounted,
        warnings=tuple(warnings),
        profile_s=round(time.perf_counter() - start, 3),
        num_threads=torch.get_num_threads() if fwd_s is not None else None,
        thread_speedup=thread_speedup,
        pipeline_split=split,
        pipeline_split_note=split_note,
        cp_blocker=cp_blocker(trace, units, seq_len_of(inputs), mat.packed_rows(inputs)),
        output_bytes=trace.loss_memory[0] if trace.loss_memory else None,
        loss_working_bytes=trace.loss_memory[1] if trace.loss_memory else None,
        loss_saved_bytes=trace.loss_memory[2] if trace.loss_memory else None,
        own_loss=handle.has_loss_fn,
    )


def cp_blocker(trace: TraceResult, units: list[Unit], seq_len: int | None, packed: bool = False) -> str:
    """Why context parallelism cannot run on the traced model ("" when it can). It splits the
    sequence over ranks (in a load-balanced order, for causal attention) and turns every fused
    attention into a ring over their keys and values (torch's context_parallel): attention done
    with plain matmuls, a mask that is not causal, positions the forward makes over the whole
    sequence, or rows packing several sequences (`packed`: the sample batch's position ids restart
    in a row, for which Hugging Face's models build a mask) would be wrong on a shard, so they block it."""
    if not seq_len:
        return "its inputs have no sequence dimension (a 2-D integer input)"
    if packed:
        return ("the sample batch packs several sequences in a row (its position_ids restart), which needs a mask "
                "(a ring splits one causal sequence per row only)")

    def where(unit: int) -> str:
        return units[unit].name if unit >= 0 else "the forward, outside its submodules,"

    fwd = trace.fwd
    for unit, n in fwd.masked_attention.items():
        if n:
            return f"{where(unit)} gives scaled_dot_product_attention an explicit mask (a ring splits causal or unmasked attention only)"
    for unit, n in fwd.square_scores.items():
        if n == seq_len:
            return f"{where(unit)} computes attention scores with matmuls, not scaled_dot_product_attention"
    for unit, n in fwd.aranges.items():
        if n == seq_len:
            return (f"{where(unit)} makes positions with torch.arange over the whole sequence (each rank holds a "
                    "reordered shard of it: take position ids as an input, or a buffer of seq_len rows)")
    if not any(fwd.attention_kv_bytes.values()):
        return "it has no scaled_dot_product_attention to split"
    return ""


def _traced_cuts(
    handle: ModelHandle, dtype: torch.dtype, inputs: Any, layers: list[LayerProfile]
) -> tuple[list[LayerProfile], str, str | None]:
    """Some cuts carry more than one layer's output: they are valid when the pipelining tracer
    splits the model before every layer (tried once, all boundaries at once, on the meta-built
    model; the runtime splits at a subset of them the same way). (layers, split, note)."""
    reason = meta_trace_split(handle, dtype, inputs, [layer.name for layer in layers[1:]])
    if reason is None:
        last = len(layers) - 1
        return [replace(layer, cut_after_ok=True) if layer.index < last else layer for layer in layers], "traced", None
    split = "sequential" if any(layer.cut_after_ok for layer in layers[:-1]) else "none"
    return layers, split, reason


def _assemble(
    model: torch.nn.Module,
    units: list[Unit],
    trace: TraceResult,
    fwd_s: list[float] | None,
    bwd_s: list[float] | None,
    warnings: list[str],
) -> tuple[list[LayerProfile], list[Edge]]:
    order = list(trace.order)
    if not order:
        raise BadInput("the model's forward called none of its submodules; nothing to profile")
    unused = [units[i].name for i in range(len(units)) if i not in order]
    if unused:
        warnings.append(f"modules never called in forward (their parameters join the last layer): {', '.join(unused)}")
    ordered = [units[i] for i in order]
    groups = group_units(ordered)
    # unit index -> layer index; glue before any unit belongs to the first layer
    layer_of = {order[pos]: li for li, g in enumerate(groups) for pos in g}
    layer_of[BEFORE_ANY] = 0
    num_layers = len(groups)

    # Parameters: owned by the first layer (in execution order) whose modules hold them; loose
    # ones (owned by no unit) by the layer that first used them; unused ones by the last layer.
    params = {storage_key(p): p for p in model.parameters()}
    param_layer: dict[int, int] = {}
    for li, g in enumerate(groups):
        for pos in g:
            for p in ordered[pos].module.parameters():
                param_layer.setdefault(storage_key(p), li)
    for key, unit in trace.loose_param_use.items():
        param_layer.setdefault(key, layer_of[unit])
    for key in params:
        if key not in param_layer:
            param_layer[key] = num_layers - 1
    num_params = [0] * num_layers
    param_bytes = [0] * num_layers
    for key, li in param_layer.items():
        num_params[li] += params[key].numel()
        param_bytes[li] += params[key].numel() * params[key].element_size()
    # the modules of each layer that hold parameters themselves, and their tensors (a tied weight
    # in each module that holds it: a trainer gathering module by module fetches it in each)
    holders = [[m for pos in g for m in ordered[pos].module.modules() if next(m.parameters(recurse=False), None) is not None]
               for g in groups]
    tensors = [sum(len(list(m.parameters(recurse=False))) for m in ms) for ms in holders]

    def per_layer(counter) -> list[int]:
        out = [0] * num_layers
        for unit, v in counter.items():
            out[layer_of.get(unit, num_layers - 1)] += int(v)
        return out

    fwd_flops, bwd_flops = per_layer(trace.fwd.flops), per_layer(trace.bwd.flops)
    saved = per_layer(trace.saved_bytes)
    matmul_out, dropped = per_layer(trace.matmul_out_bytes), per_layer(trace.fwd.alternate_out_bytes)
    matmul_out_tp, dropped_tp = per_layer(trace.matmul_out_tp_bytes), per_layer(trace.fwd.alternate_out_tp_bytes)
    extra = {
        "activation_matmul_bytes": matmul_out,
        "activation_alternate_bytes": [a - b for a, b in zip(matmul_out, dropped)],
        "activation_alternate_tp_bytes": [a - b for a, b in zip(matmul_out_tp, dropped_tp)],
        "fwd_alternate_flops": per_layer(trace.fwd.alternate_flops),
        "fwd_alternate_io_bytes": per_layer(trace.fwd.alternate_io_bytes),
        "fwd_selective_flops": per_layer(trace.fwd.selective_flops),
        "fwd_selective_io_bytes": per_layer(trace.fwd.selective_io_bytes),
        "fwd_tail_flops": per_layer(trace.tail.flops),
        "fwd_tail_matmul_io_bytes": per_layer(trace.tail.matmul_io_bytes),
        "fwd_tail_other_io_bytes": per_layer(trace.tail.other_io_bytes),
        "fwd_tail_ops": per_layer(trace.tail.ops),
        "fwd_tail_linear_flops": per_layer(trace.tail.linear_flops),
        "fwd_tail_attention_flops": per_layer(trace.tail.attention_flops),
        "fwd_tail_causal_attention_flops": per_layer(trace.tail.causal_attention_flops),
        "fwd_tail_alternate_flops": per_layer(trace.tail.alternate_flops),
        "fwd_tail_alternate_io_bytes": per_layer(trace.tail.alternate_io_bytes),
        "fwd_tail_rowwise_linears": per_layer(trace.tail_rowwise),
        "activation_matmul_tail_bytes": per_layer(trace.tail_kept),
        "activation_alternate_tail_bytes": per_layer(trace.tail_kept_alternate),
        "fwd_matmul_io_bytes": per_layer(trace.fwd.matmul_io_bytes),
        "fwd_other_io_bytes": per_layer(trace.fwd.other_io_bytes),
        "bwd_matmul_io_bytes": per_layer(trace.bwd.matmul_io_bytes),
        "bwd_other_io_bytes": per_layer(trace.bwd.other_io_bytes),
        "fwd_fused_io_bytes": per_layer(trace.fwd.fused_io_bytes),
        "bwd_fused_io_bytes": per_layer(trace.bwd.fused_io_bytes),
        "activation_tp_bytes": per_layer(trace.saved_tp_bytes),
        "activation_fused_bytes": per_layer(trace.saved_fused_bytes),
        "activation_fused_tp_bytes": per_layer(trace.saved_fused_tp_bytes),
        "activation_linear_input_bytes": per_layer(trace.saved_linear_in_bytes),
        "activation_linear_input_tp_bytes": per_layer(trace.saved_linear_in_tp_bytes),
        "activation_linear_input_copies": per_layer(trace.saved_linear_in_copies),
        "activation_matmul_tp_bytes": matmul_out_tp,
        "fwd_other_io_tp_bytes": per_layer(trace.fwd_other_io_tp_bytes),
        "fwd_linear_flops": per_layer(trace.fwd.linear_flops),
        "bwd_linear_flops": per_layer(trace.bwd.linear_flops),
        "fwd_linear_operand_bytes": per_layer(trace.fwd.linear_operand_bytes),
        "bwd_linear_operand_bytes": per_layer(trace.bwd.linear_operand_bytes),
        "fwd_linear_weight_bytes": per_layer(trace.fwd.linear_weight_bytes),
        "bwd_linear_weight_bytes": per_layer(trace.bwd.linear_weight_bytes),
        "fwd_grouped_flops": per_layer(trace.fwd.grouped_flops),
        "bwd_grouped_flops": per_layer(trace.bwd.grouped_flops),
        "fwd_grouped_operand_bytes": per_layer(trace.fwd.grouped_operand_bytes),
        "bwd_grouped_operand_bytes": per_layer(trace.bwd.grouped_operand_bytes),
        "grouped_gemms": _by_shape(trace.fwd.grouped_shapes, layer_of, num_layers),
        "fwd_ops": per_layer(trace.fwd.ops),
        "bwd_ops": per_layer(trace.bwd.ops),
        "fwd_attention_flops": per_layer(trace.fwd.attention_flops),
        "bwd_attention_flops": per_layer(trace.bwd.attention_flops),
        "fwd_causal_attention_flops": per_layer(trace.fwd.causal_attention_flops),
        "bwd_causal_attention_flops": per_layer(trace.bwd.causal_attention_flops),
        "attention_kv_bytes": per_layer(trace.fwd.attention_kv_bytes),
        "attention_kv_unique_bytes": per_layer(trace.fwd.attention_kv_unique_bytes),
    }

    # Tensors crossing each cut, and the layer graph's edges.
    crossing = [0] * num_layers
    crossing_count = [0] * num_layers
    # A cut after layer i is a pipeline boundary the runtime can use when what crosses it is what
    # layer i's (last) module returned: the next stage then starts from that output alone.
    foreign = [0] * num_layers
    returned_by = [trace.returned.get(order[g[-1]], set()) for g in groups]
    edge_bytes: dict[tuple[int, int], int] = {}
    for tid, flow in enumerate(trace.flows):
        src = layer_of.get(flow.creator, num_layers - 1)
        dsts = {layer_of.get(c, num_layers - 1) for c in flow.consumers} - {src}
        later = [d for d in dsts if d > src]
        if not later:
            continue
        for d in later:
            edge_bytes[(src, d)] = edge_bytes.get((src, d), 0) + flow.num_bytes
        for cut in range(src, max(later)):
            crossing[cut] += flow.num_bytes
            crossing_count[cut] += 1
            if tid not in returned_by[cut]:
                foreign[cut] += 1

    def seconds(values: list[float] | None, li: int) -> float | None:
        if values is None:
            return None
        return sum(values[order[pos]] for pos in groups[li])

    # A layer is named after its first module with parameters (the others are merged into it).
    mains = [next((pos for pos in g if has_params(ordered[pos].module)), g[0]) for g in groups]
    # A cut is a plain hand-over only if the next layer was called with that tensor alone too (a
    # later stage calls it so): arguments beside it that are not its forward's defaults (a flag)
    # need the tracer; nn.TransformerEncoder's src_mask=None, is_causal=False do not (called_alone)
    alone = [not trace.called_with_more.get(order[pos]) for pos in mains]
    plain = [li < num_layers - 1 and crossing_count[li] > 0 and foreign[li] == 0 and alone[li + 1]
             for li in range(num_layers)]
    sigs = [_signature(ordered, g, fwd_flops[li], bwd_flops[li], saved[li]) for li, g in enumerate(groups)]
    kinds = _kind_names(sigs, [type(ordered[pos].module).__name__ for pos in mains])
    layers = []
    for li, g in enumerate(groups):
        names = tuple(ordered[pos].name for pos in g)
        main = ordered[mains[li]].name
        layers.append(
            LayerProfile(
                index=li,
                name=main,
                modules=names,
                kind=kinds[li],
                num_params=num_params[li],
                param_bytes=param_bytes[li],
                param_tensors=tensors[li],
                param_modules=len(holders[li]),
                fwd_flops=fwd_flops[li],
                bwd_flops=bwd_flops[li],
                activation_bytes=saved[li],
                output_bytes=crossing[li] if li < num_layers - 1 else 0,
                cut_after_ok=plain[li],
                cut_plain=plain[li],
                fwd_s=seconds(fwd_s, li),
                bwd_s=seconds(bwd_s, li),
                **{k: v[li] for k, v in extra.items()},
            )
        )
    edges = [Edge(src=s, dst=d, num_bytes=b) for (s, d), b in sorted(edge_bytes.items())]
    for li, figures in _moe_figures(model, [layer.modules for layer in layers], trace.io_bytes).items():
        layers[li] = replace(layers[li], **figures)
    for li, pos in enumerate(mains):
        is_head = li == num_layers - 1
        tp = _tp_info(model, ordered[pos], layers[li].num_params, trace.io_bytes, is_head)
        layers[li] = replace(layers[li], tp=tp, linears=_linears(model, ordered[pos].name, layers[li].modules, tp,
                                                                 trace.io_bytes))
    return layers, edges


def _by_shape(shapes: Counter, layer_of: dict, num_layers: int) -> list[tuple]:
    """LayerProfile.grouped_gemms per layer: each unit's calls (trace.PhaseCosts.grouped_shapes)
    with the same n, k and groups summed into one (rows over the calls)."""
    out: list[Counter] = [Counter() for _ in range(num_layers)]
    for unit, calls in shapes.items():
        for rows, n, k, groups in calls:
            out[layer_of.get(unit, num_layers - 1)][n, k, groups] += rows
    return [tuple((rows, n, k, g) for (n, k, g), rows in sorted(c.items())) for c in out]


def _linears(model: torch.nn.Module, main: str, modules: tuple[str, ...], tp: TPInfo | None,
             io_bytes: dict[int, tuple[int, int]]) -> tuple[tuple[int, int, int, str], ...]:
    """LayerProfile.linears: every nn.Linear the layer's modules ran (the rows its input held over
    the forward's calls, from the trace's hooks), with the side TP splits (its plan's names are
    relative to the layer's main module), "moe:" before it inside a mixture-of-experts block."""
    def full(n: str) -> str:
        return ".".join(part for part in (main, n) if part)

    col = {full(n) for n in tp.colwise} if tp else set()
    row = {full(n) for n in tp.rowwise} if tp else set()
    moe = [full(b) for b in tp.moe] if tp else []
    out, seen = [], set()
    for name in modules:
        for sub, m in model.get_submodule(name).named_modules(prefix=name):
            if not isinstance(m, torch.nn.Linear) or id(m) in seen:
                continue
            seen.add(id(m))
            ins = io_bytes.get(id(m), (0, 0))[0]
            rows = ins // (m.in_features * m.weight.element_size())
            if rows:
                role = "col" if sub in col else "row" if sub in row else ""
                if any(sub == b or sub.startswith(b + ".") for b in moe):
                    role = "moe:" + role  # whole under expert parallelism (TPInfo.under_ep)
                out.append((int(rows), m.out_features, m.in_features, role))
    return tuple(out)


def _moe_figures(model: torch.nn.Module, layer_modules: list[tuple[str, ...]],
                 io_bytes: dict[int, tuple[int, int]]) -> dict[int, dict[str, int]]:
    """Layer index -> its mixture-of-experts fields (LayerProfile.moe_*, expert_params), for the
    layers holding a block (moe.py). The rows sent to the experts are what the trace's hooks saw
    enter them (trace.linear_io); top-k is the block's attribute, else those rows over the tokens
    that entered a Linear router."""
    out: dict[int, dict[str, int]] = {}

    def layer_of(name: str) -> int | None:
        """The layer holding module `name`, or the first holding a part of it (its units may be
        the experts themselves)."""
        for li, modules in enumerate(layer_modules):
            if any(m == "" or name == m or name.startswith(m + ".") or m.startswith(name + ".") for m in modules):
                return li
        return None

    for block in find_moe(model):
        li = layer_of(block.experts)
        if li is None:
            continue
        experts = model.get_submodule(block.experts)
        members = [experts] if block.stacked else list(experts)
        rows = sum(io_bytes.get(id(m), (0, 0))[0] for m in members)
        top_k = block.top_k
        router = model.get_submodule(block.router)
        routed = io_bytes.get(id(router), (0, 0))[0] if isinstance(router, torch.nn.Linear) else 0
        if top_k is None and routed:
            top_k = round(rows / routed)
        figures = out.setdefault(li, {"moe_experts": 0, "moe_top_k": 0, "expert_params": 0, "moe_dispatch_bytes": 0})
        figures["moe_experts"] = math.gcd(figures["moe_experts"], block.num_experts)
        figures["moe_top_k"] = max(figures["moe_top_k"], top_k or 0)
        figures["expert_params"] += sum(p.numel() for p in experts.parameters())
        figures["moe_dispatch_bytes"] += rows
    return out


def _tp_info(
    model: torch.nn.Module, unit: Unit, num_params: int, io_bytes: dict[int, tuple[int, int]], is_head: bool
) -> TPInfo | None:
    """How tensor parallelism splits the layer whose main module is `unit`.

    Blocks: their column/row-wise Linear pairs (tp_plan.py), one all-reduce per row-wise output.
    An Embedding layer, and a Linear that is the last layer (the LM head, its loss computed on the
    shards), are vocabulary-parallel, as in Megatron-LM and torchtitan: the embedding's output is
    all-reduced in forward, the head's input gradient in backward.
    """
    m = unit.module
    ins, outs = io_bytes.get(id(m), (0, 0))
    if isinstance(m, torch.nn.Embedding):
        return TPInfo((), ("",), min(num_params, m.weight.numel()), outs, (m.num_embeddings,), required=False)
    if isinstance(m, torch.nn.Linear):
        return TPInfo(("",), (), num_params, ins, (m.out_features,), required=False) if is_head else None
    plan = find_tp_plan(m, model, unit.name)
    if plan is None:
        return None
    subs = dict(m.named_modules())
    allreduce = sum(io_bytes.get(id(subs[name]), (0, 0))[1] for name in plan.rowwise)
    # Mixture-of-experts blocks: expert parallelism leaves their Linears whole (TPInfo.under_ep)
    moe = tuple(block.name for block in find_moe(m))

    def in_moe(name: str) -> bool:
        return any(b == "" or name == b or name.startswith(b + ".") for b in moe)

    moe_col, moe_row = [n for n in plan.colwise if in_moe(n)], [n for n in plan.rowwise if in_moe(n)]
    moe_params = sum(p.numel() for n in moe_col for p in subs[n].parameters()) + sum(subs[n].weight.numel() for n in moe_row)
    return TPInfo(
        plan.colwise, plan.rowwise, min(num_params, tp_param_count(m, plan)), allreduce,
        tuple(sorted(set(plan.divisors) | set(plan.sizes))),
        moe=moe, moe_sharded_params=moe_params,
        moe_allreduce_bytes=sum(io_bytes.get(id(subs[name]), (0, 0))[1] for name in moe_row),
    )


def _signature(ordered: list[Unit], group: list[int], *costs: int) -> tuple:
    parts = []
    for pos in group:
        m = ordered[pos].module
        parts.append(
            (
                tuple(type(x).__name__ for x in m.modules()),
                tuple((n, tuple(p.shape), str(p.dtype)) for n, p in m.named_parameters()),
            )
        )
    return (tuple(parts), costs)


def _kind_names(sigs: list[tuple], class_names: list[str]) -> list[str]:
    """Name each distinct signature by its class; a second signature of a class gets ':2', etc."""
    names: dict[tuple, str] = {}
    per_class: dict[str, int] = {}
    out = []
    for sig, cls in zip(sigs, class_names):
        if sig not in names:
            per_class[cls] = per_class.get(cls, 0) + 1
            names[sig] = cls if per_class[cls] == 1 else f"{cls}:{per_class[cls]}"
        out.append(names[sig])
    return out
