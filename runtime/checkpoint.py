"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), and the manifest that makes them safe to load.

Layout: ``DIR/step-00000004/`` holds one DCP checkpoint (every rank's ``*.distcp`` shards and the
coordinator's ``.metadata``) plus ``manifest.json``, written last by rank 0 (temp file +
``os.replace``) after every rank finished writing::

    {"format": "planner.Checkpoint", "version": 1, "step": 4, "plan_sha256": ..., "model_sha256": ...,
     "files": {"__0_0.distcp": "<sha256>", ".metadata": "<sha256>", ...}}

DCP's ``load`` unpickles ``.metadata``, so a checkpoint is loaded only after ``verify``: it has a
manifest of this format, made for the same plan file and model file, and the files in its directory
are exactly the manifest's, each with the recorded sha256 (no symbolic links). Anything else is
refused with a one-line ``CheckpointRefused`` naming the reason.

The state: the model and optimizer state from ``get_state_dict`` (DDP, FSDP2 and DTensor TP shards
each saved as what they are), under ``model`` and ``optim`` (the optimizer's flattened to one key
per parameter name); the step is the manifest's. The data of
step s comes from ``torch.manual_seed(DATA_SEED + s)``, so the step number is the whole data
position and RNG state. Pipeline ranks save the parameters their stages use, under their original
names (distinct across stages), so one checkpoint holds the whole model.

Only directories named ``step-NNNNNNNN`` holding a manifest of this format for this plan are ever
deleted (the older ones, keeping the newest ``KEEP``), and a step another plan checkpointed in the
same folder is never overwritten (the save is refused in one line); a checkpoint is written to ``.step-NNNNNNNN.partial-*``
first and renamed once complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.errors import BadInput

FORMAT = "planner.Checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
KEEP = 2
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointRefused(BadInput):
    """A checkpoint that cannot be verified as this tool's, for this plan and model: one line."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _files(path: Path) -> dict[str, Path]:
    """Every file under `path` (relative POSIX name -> path) except the manifest; refuses links."""
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames]:
            full = Path(dirpath) / name
            if full.is_symlink():
                raise CheckpointRefused(f"{path}: refused: {full.relative_to(path)} is a symbolic link")
        for name in filenames:
            full = Path(dirpath) / name
            rel = full.relative_to(path).as_posix()
            if rel != MANIFEST:
                out[rel] = full
    return out


def _read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest if `path` holds one of this format (parsed only), else None."""
    m = path / MANIFEST
    if m.is_symlink() or not m.is_file():
        return None
    try:
        data = json.loads(m.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    return data


def verify(path: Path, plan_sha256: str, model_sha256: str) -> int:
    """The checkpoint's step, once every check passed; CheckpointRefused (one line) otherwise."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        raise CheckpointRefused(f"{path}: refused: not a checkpoint directory")
    m = path / MANIFEST
    if not m.is_file():
        raise CheckpointRefused(f"{path}: refused: no {MANIFEST} (incomplete, or not written by plan run)")
    data = _read_manifest(path)
    if data is None:
        raise CheckpointRefused(f"{path}: refused: {MANIFEST} is not a {FORMAT} manifest")
    if data.get("version") != VERSION:
        raise CheckpointRefused(f"{path}: refused: manifest version {data.get('version')!r}, this runtime reads {VERSION}")
    if data.get("plan_sha256") != plan_sha256:
        raise CheckpointRefused(f"{path}: refused: it was made for a different plan (plan sha256 differs)")
    if data.get("model_sha256") != model_sha256:
        raise CheckpointRefused(f"{path}: refused: it was made for a different model file (model sha256 differs)")
    step = data.get("step")
    recorded = data.get("files")
    if not isinstance(step, int) or step < 0 or not isinstance(recorded, dict) or not recorded:
        raise CheckpointRefused(f"{path}: refused: malformed manifest")
    present = _files(path)
    extra = sorted(set(present) - set(recorded))
    missing = sorted(set(recorded) - set(present))
    if missing:
        raise CheckpointRefused(f"{path}: refused: {missing[0]} is missing (listed in the manifest)")
    if extra:
        raise CheckpointRefused(f"{path}: refused: {extra[0]} is not listed in the manifest")
    for rel in sorted(recorded):
        if sha256_file(present[rel]) != recorded[rel]:
            raise CheckpointRefused(f"{path}: refused: {rel} does not match its sha256 in the manifest (changed or corrupt)")
    return step


@dataclass(frozen=True)
class Found:
    path: Path
    step: int
    skipped: tuple[str, ...]
    """One line per newer checkpoint that was refused, with the reason."""


def candidates(root: Path) -> list[tuple[int, Path]]:
    """``step-NNNNNNNN`` directories in `root`, newest first."""
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and not child.is_symlink():
            out.append((int(m.group(1)), child))
    return sorted(out, reverse=True)


def find_latest(root: Path, plan_sha256: str, model_sha256: str) -> Found | None:
    """The newest checkpoint in `root` that verifies; None when `root` has none at all.

    CheckpointRefused when there are checkpoints and every one is refused (all reasons, one line)."""
    found = candidates(Path(root))
    if not found:
        return None
    skipped: list[str] = []
    for _, path in found:
        try:
            step = verify(path, plan_sha256, model_sha256)
        except CheckpointRefused as exc:
            skipped.append(str(exc))
            continue
        return Found(path, step, tuple(skipped))
    raise CheckpointRefused(f"no usable checkpoint in {root}: " + "; ".join(skipped))


def write_manifest(path: Path, step: int, plan_sha256: str, model_sha256: str) -> None:
    """Hash every file of the complete checkpoint `path` and write its manifest last, atomically."""
    files = {rel: sha256_file(full) for rel, full in sorted(_files(path).items())}
    data = {
        "format": FORMAT, "version": VERSION, "step": step, "plan_sha256": plan_sha256,
        "model_sha256": model_sha256, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files,
    }
    tmp = path / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)


def plan_of(path: Path) -> str | None:
    """The plan hash of the checkpoint at `path` (None: not one of this tool's)."""
    data = _read_manifest(path)
    return None if data is None else str(data.get("plan_sha256"))


def prune(root: Path, plan_sha256: str, keep: int = KEEP) -> list[Path]:
    """Delete all but the newest `keep` checkpoints this tool wrote for this plan (a manifest of its
    format naming the plan); nothing else is touched, another plan's checkpoints in the same
    folder included. The deleted paths."""
    ours = [(step, path) for step, path in candidates(root) if plan_of(path) == plan_sha256]
    removed = []
    for _, path in ours[keep:]:
        shutil.rmtree(path)
        removed.append(path)
    return removed


# --- the distributed side (every rank calls these) -------------------------------------------


class StateView(nn.Module):
    """A module whose parameters are the given ones under the given (original) names: what a
    pipeline rank hands to get_state_dict, so its stages' state keeps the model's own names."""

    def __init__(self, params: dict[str, nn.Parameter]):
        super().__init__()
        for name, p in params.items():
            *path, leaf = name.split(".")
            mod: nn.Module = self
            for part in path:
                if part not in mod._modules:
                    mod._modules[part] = nn.Module()
                mod = mod._modules[part]  # type: ignore[assignment]
            mod._parameters[leaf] = p


def _OPTIONS() -> Any:
    """Optimizer state flattened to one key per parameter (``state.<name>.<key>``,
    ``param_groups.<name>.<key>``): pipeline stages' entries stay distinct in one checkpoint (a
    single ``param_groups`` list would be saved once, from one rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


class Checkpointer:
    """Save and load one plan's training state over all ranks."""

    def __init__(self, root: Path, every: int, plan_sha256: str, model_sha256: str,
                 model: nn.Module, optimizer: torch.optim.Optimizer, rank: int):
        self.root, self.every = Path(root), every
        self.plan_sha256, self.model_sha256 = plan_sha256, model_sha256
        from runtime.train import local_optimizer

        # ZeRO-1 (ZeroRedundancyOptimizer): the local optimizer, holding this rank's shard of the
        # parameters and their state; its flattened keys name those parameters, so each dp rank
        # saves and loads its own shard (the partition is deterministic: the same on resume).
        self.model, self.optimizer, self.rank = model, local_optimizer(optimizer), rank

    def _plain_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_OPTIONS())
        return {"model": model_sd, "optim": optim_sd}

    def _state(self) -> dict[str, Any]:
        """What DCP saves and loads: the state dicts with every TP shard DDP holds as a plain local
        tensor (``_st_info``: runtime.data_parallel.localize_tp_for_ddp) seen as its DTensor again,
        a view of the same storage, so each tp rank's shard is saved as that shard (not as one
        replicated tensor) and loaded in place."""
        return _as_dtensors(self._plain_state(), self.model)

    def maybe_save(self, step: int) -> None:
        """After `step` steps: save when it is a multiple of `every`."""
        if self.every > 0 and step % self.every == 0:
            self.save(step)

    def save(self, step: int) -> Path:
        import torch.distributed.checkpoint as dcp

        final = step_dir(self.root, step)
        names: list[Any] = [None]
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            owner = plan_of(final) if final.exists() else self.plan_sha256
            if owner is None:
                names[0] = f"!{final} exists and was not written by plan run: move it away"
            elif owner != self.plan_sha256:
                names[0] = (f"!{final} holds another plan's checkpoint, which this run will not overwrite: "
                            "give each plan its own --checkpoint-dir")
            else:
                names[0] = str(self.root / f".{final.name}.partial-{os.getpid()}-{time.time_ns()}")
        dist.broadcast_object_list(names, src=0)
        if names[0].startswith("!"):
            raise CheckpointRefused(names[0][1:])
        partial = Path(names[0])
        dcp.save(self._state(), checkpoint_id=str(partial))
        dist.barrier()  # every rank's shards and the metadata are written
        if self.rank == 0:
            if final.exists():  # an earlier checkpoint of ours at this step (e.g. resumed before it)
                shutil.rmtree(final)
            os.replace(partial, final)
            write_manifest(final, step, self.plan_sha256, self.model_sha256)
            prune(self.root, self.plan_sha256)
        dist.barrier()
        return final

    def load_latest(self) -> Found | None:
        """Rank 0 finds the newest verified checkpoint; every rank loads it. None: none in DIR."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = find_latest(self.root, self.plan_sha256, self.model_sha256)
            except CheckpointRefused as exc:
                box[0] = str(exc)
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise CheckpointRefused(box[0])
        found: Found | None = box[0]
        if found is None:
            return None
        plain = self._plain_state()
        state = _as_dtensors(plain, self.model)
        dcp.load(state, checkpoint_id=str(found.path))  # tensors in place; other values replaced
        loaded = {
            part: {k: plain[part][k] if v is not plain[part].get(k) and _wrapped(v) else v for k, v in sd.items()}
            for part, sd in state.items()
        }
        set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"],
                       options=_OPTIONS())
        return found


def _wrapped(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _as_dtensors(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """`state` ({"model": ..., "optim": ...}, the optimizer's flattened) with the entries of TP shards
    localised for DDP (a parameter with ``_st_info``, and its optimizer state of the same shape)
    replaced by ``DTensor.from_local`` views of them; the dicts are copies, the tensors shared."""
    from torch.distributed.tensor import DTensor

    specs = {name: (p._st_info, p.shape) for name, p in model.named_parameters() if getattr(p, "_st_info", None) is not None}
    if not specs:
        return state

    def view(t: Any, name: str) -> Any:
        spec, local_shape = specs[name]
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor) or t.shape != local_shape:
            return t
        return DTensor.from_local(t, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)

    model_sd = {k: view(v, k) if k in specs else v for k, v in state["model"].items()}
    optim_sd = {}
    for k, v in state["optim"].items():
        name = k[len("state."):].rpartition(".")[0] if k.startswith("state.") else ""
        optim_sd[k] = view(v, name) if name in specs else v
    return {"model": model_sd, "optim": optim_sd}


def plan_sha256(plan_path: Path) -> str:
    return sha256_file(Path(plan_path))
