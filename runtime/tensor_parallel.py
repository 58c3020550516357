"""Tensor parallelism: DTensor ``parallelize_module`` on each splittable layer, ``ColwiseParallel`` on
the layer's column-wise Linears and ``RowwiseParallel`` on its row-wise ones (names from the
profiler's TPInfo, relative to the layer). Embeddings and the head stay replicated in this slice.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from runtime.layout import tp_layers
from runtime.preflight import LayerSplit

log = logging.getLogger(__name__)


def apply_tp(model: nn.Module, layers: tuple[LayerSplit, ...], tp_mesh: DeviceMesh) -> int:
    """Shard the Linear pairs of every splittable layer over `tp_mesh`; returns the layer count."""
    split = tp_layers(layers, tp_mesh.size())
    for layer in split:
        assert layer.tp is not None
        plan: dict[str, Any] = {name: ColwiseParallel() for name in layer.tp.colwise}
        plan.update({name: RowwiseParallel() for name in layer.tp.rowwise})
        parallelize_module(model.get_submodule(layer.name), tp_mesh, plan)
    log.info("tensor parallel: %d layer(s) over %d ranks", len(split), tp_mesh.size())
    return len(split)
