"""Split a model into pipeline stages with ``torch.distributed.pipelining``'s tracer.

Used twice, the same way: by the profiler, on the model built on the meta device, to decide whether
cuts that are not a plain hand-over of one layer's output can still be pipeline boundaries (the
tracer then carries every tensor that crosses them: masks, position embeddings, ...); and by the
runtime (runtime/pipeline.py), on the real model, to build the stages.

``pipeline(module, mb_args, mb_kwargs, split_spec={layer: SplitPoint.BEGINNING, ...})`` exports the
whole forward as one graph (``torch.export``) and cuts it before each named layer's call. It fails on
what export cannot capture (data-dependent Python control flow, ``.item()``, graph breaks); the
reason, with the module whose forward was running, comes back as one line.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _innermost(exc: BaseException) -> BaseException:
    """The export error under pipelining's generic "cannot capture your model" wrapper."""
    seen = 0
    while exc.__cause__ is not None and seen < 8:
        exc = exc.__cause__
        seen += 1
    return exc


@contextmanager
def _running_modules(model: nn.Module) -> Iterator[list[str]]:
    """The names of the modules whose forward is running (innermost last)."""
    stack: list[str] = []
    handles = []

    def pre(name: str):
        def hook(module, args):
            stack.append(name)

        return hook

    def post(name: str):
        def hook(module, args, output):
            if stack and stack[-1] == name:
                stack.pop()

        return hook

    for name, module in model.named_modules():
        name = name or type(model).__name__
        handles.append(module.register_forward_pre_hook(pre(name)))
        handles.append(module.register_forward_hook(post(name)))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _quiet() -> Iterator[None]:
    """Export and FakeTensorMode log whole tracebacks on failure; the caller reports one line."""
    names = ("torch._subclasses.fake_tensor", "torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes",
             "torch.distributed.pipelining", "torch._dynamo")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        sink = io.StringIO()  # export prints the graph it failed on
        with warnings.catch_warnings(), contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class SplitFailed(Exception):
    """The tracer could not split the model; str() is one line with the reason."""


def as_call(inputs: Any) -> tuple[tuple, dict]:
    """(args, kwargs) of the model call under the model-file contract."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def trace_split(model: nn.Module, inputs: Any, split_before: list[str]) -> Any:
    """``pipeline()`` of `model` on one micro-batch `inputs`, split before each module named in
    `split_before`; the Pipe. Raises SplitFailed (one line: what failed and in which module).

    `model` is modified (pipelining wraps the split modules' forward; `without_inference_cache`):
    pass a copy you can drop."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    args, kwargs = as_call(inputs)
    without_inference_cache(model)
    for name in split_before:
        try:
            model.get_submodule(name)
        except AttributeError as exc:
            raise SplitFailed(f"no module {name} to split before") from exc
    with _quiet(), _running_modules(model) as stack:
        try:
            pipe = pipeline(model, mb_args=args, mb_kwargs=kwargs or None,
                            split_spec={name: SplitPoint.BEGINNING for name in split_before})
        except Exception as exc:
            where = f" in {stack[-1]}" if stack else ""
            raise SplitFailed(f"the pipelining tracer failed{where}: {_first_line(_innermost(exc))}") from exc
    if pipe.num_stages != len(split_before) + 1:
        raise SplitFailed(
            f"the pipelining tracer made {pipe.num_stages} stage(s) for {len(split_before)} split point(s) "
            "(a layer called more than once, or not called in forward)"
        )
    relay_skip_connections(pipe)
    contiguous_handovers(pipe)
    return pipe


def without_inference_cache(model: nn.Module) -> list[Any]:
    """A Hugging Face model whose config says `use_cache` (the default of its causal LMs) makes an
    inference key-value cache in every forward and returns it: training never reads it, and the
    tracer cannot split a forward that returns one (transformers' DynamicCache is no pytree). Off
    in what is traced, in every config the model holds (T5's decoder keeps a copy of its own), as
    transformers' own training paths turn it off (gradient checkpointing), so the pipeline stages
    run without it. Left on elsewhere: without a cache, transformers takes position ids that jump
    (context parallelism's load-balanced order) for packed sequences. Returns the configs it turned
    off (to turn on again after a trace that must leave the model as it was)."""
    turned = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False
            turned.append(config)
    return turned


def contiguous_handovers(pipe: Any) -> None:
    """Make every tensor a stage hands over contiguous: what a cut sends can be a strided view (a
    ViT's class token sliced out before its classifier), and the schedules' buffers copy the
    traced layout (torch's stages allocate receives with the traced strides) while isend and irecv
    refuse a strided tensor. Each such output is returned through `.contiguous()`, and the stages
    that take it are told so. Rewrites the Pipe's stage graphs in place."""
    from torch import fx

    gm = pipe.split_gm
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    subs = [gm.get_submodule(str(c.target)) for c in calls]

    def strided(node: Any) -> bool:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        return isinstance(val, torch.Tensor) and not val.is_contiguous()

    def contiguous(graph: fx.Graph, output: fx.Node, arg: fx.Node) -> fx.Node:
        if not strided(arg):
            return arg
        with graph.inserting_before(output):
            copy = graph.call_method("contiguous", (arg,))
        copy.meta["val"] = arg.meta["val"].contiguous()
        return copy

    for sub in subs:
        for node in list(sub.graph.nodes):
            if node.op == "placeholder" and strided(node):
                node.meta["val"] = node.meta["val"].contiguous()
            elif node.op == "output":
                node.args = fx.node.map_arg(node.args, lambda arg, g=sub.graph, out=node: contiguous(g, out, arg))
        sub.recompile()


def relay_skip_connections(pipe: Any) -> int:
    """Make every stage take its inputs from the stage just before it (the schedules send between
    adjacent stages only): a tensor made by stage i and used by stage j > i + 1 (a mask, position
    ids or embeddings made once before the first block) is passed through stages i+1 .. j-1, each
    taking it as one more input and returning it as one more output (the same tensor, so its
    gradient flows back unchanged). Rewrites the Pipe's graphs in place; returns the relays added."""
    from torch import fx
    from torch.utils._pytree import tree_flatten

    gm = pipe.split_gm
    graph = gm.graph
    calls = [n for n in graph.nodes if n.op == "call_module"]
    stage_of = {c.name: i for i, c in enumerate(calls)}
    subs = [gm.get_submodule(str(c.target)) for c in calls]

    def source(v: fx.Node) -> tuple[int, fx.Node, int | None]:
        """(stage that makes v or -1 for a model input, its call node, output index or None)."""
        if v.op == "placeholder":
            return -1, v, None
        node, index = v, None
        if v.op == "call_function" and v.target is operator.getitem:
            node, index = v.args[0], v.args[1]  # type: ignore[assignment]
        if node.op != "call_module" or node.name not in stage_of:
            raise SplitFailed(f"the pipelining tracer left {v.name} between stages")
        return stage_of[node.name], node, index  # type: ignore[return-value]

    def output_node(sub: fx.GraphModule) -> fx.Node:
        return next(n for n in sub.graph.nodes if n.op == "output")

    def example(v: fx.Node) -> Any:
        stage, _, index = source(v)
        if stage == -1:
            if v not in calls[0].args:  # the schedules hand the model's inputs to the first stage alone
                raise SplitFailed(f"the model's input {v.name} is read only after the first stage "
                                  f"(compute what needs it in sample_batch, or read it before the first layer)")
            ph = [n for n in subs[0].graph.nodes if n.op == "placeholder"][list(calls[0].args).index(v)]
            return ph.meta.get("val")
        out = output_node(subs[stage]).args[0]
        leaves = tree_flatten(out)[0] if index is not None else [out]
        return leaves[index or 0].meta.get("val")

    def add_output(k: int, value: fx.Node, val: Any) -> fx.Node:
        """Stage k returns `value` (a node of its graph) as one more output; the outer getitem."""
        call, sub = calls[k], subs[k]
        out = output_node(sub)
        current = out.args[0]
        if not isinstance(current, (tuple, list)):  # a single output becomes a 1-tuple
            with graph.inserting_after(call):
                first = graph.call_function(operator.getitem, (call, 0))
            first.meta["val"] = val_of_single(sub)
            call.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)
            current = (current,)
        out.args = (tuple(current) + (value,),)
        getters = [u for u in call.users if u.op == "call_function" and u.target is operator.getitem]
        with graph.inserting_after(getters[-1] if getters else call):
            getter = graph.call_function(operator.getitem, (call, len(current)))
        getter.meta["val"] = val
        return getter

    def val_of_single(sub: fx.GraphModule) -> Any:
        return output_node(sub).args[0].meta.get("val")

    relayed: dict[tuple[fx.Node, int], fx.Node] = {}
    added = 0

    def at(v: fx.Node, made_by: int, k: int) -> fx.Node:
        """The outer node that carries v out of stage k (k >= made_by; made_by -1: a model input)."""
        nonlocal added
        if k == made_by:
            return v
        if (v, k) in relayed:
            return relayed[(v, k)]
        call, sub = calls[k], subs[k]
        val = example(v)
        if k == 0:  # a model input that a later stage uses: stage 0 must take it already
            if v not in call.args:
                raise SplitFailed(f"the model input {v.name} is used after the first stage only")
            inner = [n for n in sub.graph.nodes if n.op == "placeholder"][list(call.args).index(v)]
        else:
            before = at(v, made_by, k - 1)
            placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
            if before in call.args:
                inner = placeholders[list(call.args).index(before)]
            else:
                with sub.graph.inserting_after(placeholders[-1]):
                    inner = sub.graph.placeholder(f"relay_{v.name}")
                inner.meta["val"] = val
                call.args = tuple(call.args) + (before,)
        relayed[(v, k)] = add_output(k, inner, val)
        added += 1
        return relayed[(v, k)]

    for k in range(1, len(calls)):
        for a in range(len(calls[k].args)):
            v = calls[k].args[a]  # re-read: relaying may rewrite this stage's arguments
            if not isinstance(v, fx.Node):
                continue
            made_by = source(v)[0]
            if made_by < k - 1:
                carried = at(v, made_by, k - 1)
                args = list(calls[k].args)
                args[a] = carried
                calls[k].args = tuple(args)
    out = next(n for n in graph.nodes if n.op == "output")
    for v in tree_flatten(out.args)[0]:
        if isinstance(v, fx.Node) and source(v)[0] != len(calls) - 1:
            raise SplitFailed("the model's output uses tensors of a stage other than the last")
    if added:
        for sub in subs:
            sub.graph.lint()
            sub.recompile()
        graph.lint()
    return added



def meta_trace_split(handle: Any, dtype: torch.dtype, inputs: Any, split_before: list[str]) -> str | None:
    """Whether the tracer splits the model file's model before each of `split_before`, traced on
    the meta device (no memory: works for models that do not fit; export runs the forward on its
    own fake tensors, where value-dependent mask code that plain meta tensors refuse works). None
    when it does, else the reason (one line)."""
    from torch.utils._pytree import tree_map

    import planner.profile.materialize as mat

    if not split_before:
        return None
    model = handle.build_model("meta").to(dtype).train()
    meta_inputs = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, mat.cast_floats(inputs, dtype))
    try:
        trace_split(model, meta_inputs, split_before)
    except SplitFailed as exc:
        return str(exc)
    return None
