"""Load a user's ``model.py`` and call it under the model-file contract.

The contract (documented in the README)::

    def build_model() -> torch.nn.Module      # required; may be called under torch.device("meta")
    def sample_batch(batch_size: int)         # required; returns (inputs, targets)
    def loss_fn(outputs, targets) -> Tensor   # optional

``inputs`` is a Tensor, a tuple of Tensors (positional arguments) or a dict (keyword arguments).
Every failure that is the user's to fix becomes a `BadInput` with one line naming the file, the
function and the cause; the original exception is chained for ``--debug``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
import torch.nn.functional as F

from planner.errors import BadInput

REQUIRED = ("build_model", "sample_batch")


def _where(exc: BaseException, path: Path) -> str:
    """`file:line` of the deepest frame of `exc` that lies in the user's file, or ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
    return f" ({path.name}:{frames[-1].lineno})" if frames else ""


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@dataclass(frozen=True)
class ModelHandle:
    """A loaded model file: its functions, its name and the hash of its source."""

    path: Path
    name: str
    source_sha256: str
    module: ModuleType

    # -- the contract -------------------------------------------------------------------------
    def build_model(self, device: str | torch.device | None = None) -> torch.nn.Module:
        """Call the user's build_model(), under `device` (e.g. "meta") when given."""
        try:
            if device is None:
                model = self.module.build_model()
            else:
                with torch.device(device):
                    model = self.module.build_model()
        except Exception as exc:  # noqa: BLE001 - any user error is reported, not raised
            hint = (
                " (build_model() ran under torch.device('meta'), where tensors have no values: "
                "avoid .item() and value-dependent code while building)"
                if str(device) == "meta" else ""
            )
            raise BadInput(
                f"{self.path}: build_model() raised {_describe(exc)}{_where(exc, self.path)}{hint}"
            ) from exc
        if not isinstance(model, torch.nn.Module):
            raise BadInput(
                f"{self.path}: build_model() returned {type(model).__name__}, "
                "expected a torch.nn.Module"
            )
        return model

    def sample_batch(self, batch_size: int) -> tuple[Any, Any]:
        """Call the user's sample_batch(batch_size) and check the (inputs, targets) shape of it."""
        try:
            batch = self.module.sample_batch(batch_size)
        except Exception as exc:  # noqa: BLE001
            raise BadInput(
                f"{self.path}: sample_batch({batch_size}) raised "
                f"{_describe(exc)}{_where(exc, self.path)}"
            ) from exc
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise BadInput(
                f"{self.path}: sample_batch({batch_size}) must return (inputs, targets), "
                f"got {type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            )
        inputs, targets = batch
        ok = (
            isinstance(inputs, torch.Tensor)
            or (isinstance(inputs, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in inputs))
            or (isinstance(inputs, dict) and all(isinstance(k, str) for k in inputs))
        )
        if not ok:
            raise BadInput(
                f"{self.path}: sample_batch({batch_size}) inputs must be a Tensor, a tuple of "
                f"Tensors or a dict of keyword arguments, got {type(inputs).__name__}"
            )
        return inputs, targets

    @property
    def has_loss_fn(self) -> bool:
        return callable(getattr(self.module, "loss_fn", None))

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The user's loss_fn, or the default one; a scalar tensor."""
        fn: Callable = self.module.loss_fn if self.has_loss_fn else default_loss
        try:
            loss = fn(outputs, targets)
        except BadInput as exc:
            if str(self.path) in str(exc):
                raise
            raise BadInput(f"{self.path}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001
            who = "loss_fn" if self.has_loss_fn else "the default loss"
            raise BadInput(
                f"{self.path}: {who} raised {_describe(exc)}{_where(exc, self.path)}"
            ) from exc
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise BadInput(f"{self.path}: loss_fn must return a scalar tensor, got {got}")
        return loss

    def forward(self, model: torch.nn.Module, inputs: Any) -> Any:
        """Run model(inputs) the way the contract says (positional, tuple or keyword)."""
        try:
            return call_model(model, inputs)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, BadInput):
                raise
            raise BadInput(
                f"{self.path}: the model's forward rejected the batch from sample_batch(): "
                f"{_describe(exc)}{_where(exc, self.path)}"
            ) from exc


def call_model(model: torch.nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def logits_of(outputs: Any) -> torch.Tensor:
    """The prediction tensor in a model's outputs: the tensor, `.logits`, or the first element."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if hasattr(outputs, "logits"):
        return outputs.logits
    if isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    if isinstance(outputs, dict) and "logits" in outputs:
        return outputs["logits"]
    raise BadInput(
        f"cannot find the predictions in the model's output ({type(outputs).__name__}); "
        "define loss_fn(outputs, targets) in the model file"
    )


def default_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for integer targets (class per position), MSE for float targets.

    Logits that a tensor-parallel head left sharded over the vocabulary (a DTensor) get the same
    cross-entropy computed on the shards (`sharded_cross_entropy`)."""
    logits = logits_of(outputs)
    if not isinstance(targets, torch.Tensor):
        raise BadInput("the default loss needs a Tensor of targets; define loss_fn(outputs, targets)")
    sharded = type(logits).__name__ == "DTensor"
    if targets.is_floating_point():
        if sharded:
            logits = logits.full_tensor()  # type: ignore[attr-defined]
        return F.mse_loss(logits.float(), targets.float())
    flat = logits.reshape(-1, logits.shape[-1]).float()
    if sharded:
        return sharded_cross_entropy(flat, targets.reshape(-1))
    return F.cross_entropy(flat, targets.reshape(-1))


class _WithGrad(torch.autograd.Function):
    """Returns `value`; in backward hands `grad` (scaled by the incoming gradient) to `logits`."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, value: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, None, None]:
        from torch.distributed.tensor import DTensor, Replicate

        (grad,) = ctx.saved_tensors
        mesh = grad.device_mesh
        scale = DTensor.from_local(grad_out.reshape(()), mesh, [Replicate()] * mesh.ndim, run_check=False)
        return grad * scale, None, None


def sharded_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (N, classes) logits sharded over the classes (a DTensor, Shard(1) on a
    one-dimensional tensor-parallel mesh) and (N,) class indices, without gathering the logits:
    torch's ``loss_parallel`` (max, sum of exponentials and the target logit all-reduced over the
    shards). Its backward must run inside that context too, which the caller's ``loss.backward()``
    does not, so the gradient of the logits is taken here, and handed back in backward; returns a
    plain scalar tensor (the same on every rank)."""
    from torch.distributed.tensor.parallel import loss_parallel

    needs_grad = logits.requires_grad and torch.is_grad_enabled()
    leaf = logits.detach().requires_grad_(needs_grad)
    with loss_parallel():
        loss = F.cross_entropy(leaf, targets)
        grad = torch.autograd.grad(loss, leaf)[0] if needs_grad else None
    value = loss.detach().to_local()
    return _WithGrad.apply(logits, value, grad) if grad is not None else value


def load_model_file(path: str | Path) -> ModelHandle:
    """Import `path` as a fresh module and check that it honours the contract."""
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise BadInput(f"{path}: no such model file")
    if not path.is_file():
        raise BadInput(f"{path}: not a file")
    source = path.read_bytes()
    try:
        compile(source, str(path), "exec")
    except SyntaxError as exc:  # lineno is None for some errors (null bytes)
        where = f":{exc.lineno}" if exc.lineno else ""
        raise BadInput(f"{path}{where}: syntax error: {exc.msg}") from exc
    except ValueError as exc:  # e.g. null bytes
        raise BadInput(f"{path}: not a Python source file ({exc})") from exc

    mod_name = f"_plan_model_{path.stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None, f"no import spec for {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    # Like `python model.py`: the file's folder is importable, so model files can share helpers.
    folder = str(path.parent)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        what = f"module '{missing}' is not installed" if missing and isinstance(exc, ModuleNotFoundError) else _describe(exc)
        raise BadInput(f"{path}: import failed{_where(exc, path)}: {what}") from exc
    except SystemExit as exc:
        raise BadInput(f"{path}: the file called exit({exc.code}) while being imported") from exc
    except Exception as exc:  # noqa: BLE001
        raise BadInput(f"{path}: raised {_describe(exc)} while being imported{_where(exc, path)}") from exc

    for fn in REQUIRED:
        if not hasattr(module, fn):
            raise BadInput(f"{path}: missing required function {fn}() (see the model-file contract in the README)")
        if not callable(getattr(module, fn)):
            raise BadInput(f"{path}: {fn} must be a function, got {type(getattr(module, fn)).__name__}")
    if hasattr(module, "loss_fn") and not callable(module.loss_fn):
        raise BadInput(f"{path}: loss_fn must be a function, got {type(module.loss_fn).__name__}")

    return ModelHandle(
        path=path,
        name=path.stem,
        source_sha256=hashlib.sha256(source).hexdigest(),
        module=module,
    )
