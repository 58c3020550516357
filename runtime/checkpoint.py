"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), and the signed manifest that makes them
safe to load.

Layout: ``DIR/step-00000004-<plan>/`` (``<plan>``: the first 12 hex digits of the plan file's
sha256, so several plans share a folder without touching each other's steps) holds one DCP
checkpoint (every rank's ``__<rank>_<n>.distcp`` shards and the coordinator's ``.metadata``) and
``manifest.json``::

    {"format": "planner.Checkpoint", "version": 2, "step": 4, "plan_sha256": ..., "model_sha256": ...,
     "written": ..., "files": {"__0_0.distcp": "<sha256>", ".metadata": "<sha256>", ...},
     "hmac": "<HMAC-SHA256 of the rest, with this account's key>"}

A save: DCP writes into ``DIR/.step-00000004-<plan>.partial-*``; every rank hashes the files it
wrote; rank 0 hashes the rest, signs the manifest, writes it into the partial folder (temp file,
fsync, rename) and renames the folder to its final name. A crash at any point leaves at most a
partial folder (never read, removed by this plan's next save or resume) and every earlier
checkpoint as it was.

DCP's ``load`` unpickles ``.metadata``, so a checkpoint is loaded only after ``verify``: the
manifest is signed with this account's key (``signing_key``: kept outside the checkpoint folder,
created on first use, readable by its owner only), made for the same plan and model file, and the
files in the folder are exactly the manifest's (no symbolic links), each with the recorded sha256
(in a run, every rank hashes a share). Anything else is refused with a one-line
``CheckpointRefused`` naming the reason.

The state: the model and optimizer state from ``get_state_dict`` (DDP, FSDP2 and DTensor TP shards
each saved as what they are), under ``model`` and ``optim`` (the optimizer's flattened to one key
per parameter name); the step is the manifest's. The data of step s comes from
``torch.manual_seed(DATA_SEED + s)``, so the step number is the whole data position and RNG state.
Pipeline ranks save the parameters their stages use, under their original names (distinct across
stages), so one checkpoint holds the whole model. With expert parallelism it holds every expert
once, whichever rank holds it: a list block's experts under their own indices
(``layers.0.mlp.experts.4.w1.weight``), a stacked block's parameters as the whole ``[E, ...]``
tensor of which each EP rank's slice (FSDP2's shard of it under ZeRO-2/3) is a DTensor shard, with
their optimizer state (the experts' own optimizer included); the expert replicas' copies are
written once (DCP's de-duplication).

Only this plan's signed ``step-*`` folders are ever deleted (the older ones, keeping the newest
``KEEP``), and this plan's partial folders.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import json
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from planner.errors import BadInput

FORMAT = "planner.Checkpoint"
VERSION = 2
MANIFEST = "manifest.json"
KEEP = 2
TAG_HEX = 12
_STEP_DIR = re.compile(r"^step-(\d{8})-([0-9a-f]{%d})$" % TAG_HEX)
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's FileSystemWriter: __<rank>_<n>.distcp
KEY_ENV = "PLAN_CHECKPOINT_KEY"
"""The signing key's path, when not the default (``signing_key``)."""
FAULT_ENV = "PLAN_RUNTIME_FAULT"
"""Fault injection for the tests: ``save:<step>:<rank>`` kills that rank in the middle of that save
(its shards written, the checkpoint not complete)."""


class CheckpointRefused(BadInput):
    """A checkpoint that cannot be verified as this tool's, for this plan and model: one line."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_files(paths: dict[str, Path]) -> dict[str, str]:
    """sha256 of each file, several at a time (hashlib releases the GIL on large reads)."""
    if len(paths) <= 1:
        return {rel: sha256_file(p) for rel, p in paths.items()}
    with concurrent.futures.ThreadPoolExecutor(min(len(paths), os.cpu_count() or 1)) as pool:
        return dict(zip(paths, pool.map(sha256_file, paths.values())))


# --- signing ----------------------------------------------------------------------------------


def key_path() -> Path:
    """``$PLAN_CHECKPOINT_KEY``, else ``$XDG_CONFIG_HOME/parallel-planner/checkpoint.key`` (default
    ``~/.config``): one key per account, outside every checkpoint folder. On several nodes it must be
    the same file (a shared home) or a copy."""
    env = os.environ.get(KEY_ENV)
    if env:
        return Path(env).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "parallel-planner" / "checkpoint.key"


def signing_key(create: bool) -> bytes:
    """This account's key (32 random bytes), made on first use with `create` (mode 0600); refused
    if another user could read or replace it."""
    path = key_path()
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first
            pass
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(os.urandom(32))
                f.flush()
                os.fsync(f.fileno())
    try:
        st = path.stat()
        key = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointRefused(f"refused: no signing key at {path}, so no checkpoint here was signed on this account "
                                f"(set {KEY_ENV} to the key the checkpoints were written with)") from None
    except OSError as exc:
        raise CheckpointRefused(f"refused: cannot read the signing key {path}: {exc.strerror}") from None
    if st.st_mode & 0o077:
        raise CheckpointRefused(f"refused: the signing key {path} is open to other users (mode {st.st_mode & 0o777:o}): chmod 600 {path}")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise CheckpointRefused(f"refused: the signing key {path} belongs to another user")
    if len(key) < 16:
        raise CheckpointRefused(f"refused: the signing key {path} is too short ({len(key)} bytes)")
    return key


def _signature(data: dict[str, Any], key: bytes) -> str:
    body = {k: v for k, v in data.items() if k != "hmac"}
    return hmac.new(key, json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), hashlib.sha256).hexdigest()


# --- folders ----------------------------------------------------------------------------------


def plan_tag(plan_sha256: str) -> str:
    return plan_sha256[:TAG_HEX]


def step_dir(root: Path, step: int, plan_sha256: str) -> Path:
    return root / f"step-{step:08d}-{plan_tag(plan_sha256)}"


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
    """The manifest if `path` holds one of this format (parsed only, not verified), else None."""
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


def check_manifest(path: Path, plan_sha256: str, model_sha256: str) -> tuple[int, dict[str, str]]:
    """Everything but the files' hashes: (step, the manifest's files), or CheckpointRefused."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        raise CheckpointRefused(f"{path}: refused: not a checkpoint directory")
    if not (path / MANIFEST).is_file():
        raise CheckpointRefused(f"{path}: refused: no {MANIFEST} (incomplete, or not written by plan run)")
    data = _read_manifest(path)
    if data is None:
        raise CheckpointRefused(f"{path}: refused: {MANIFEST} is not a {FORMAT} manifest")
    if data.get("version") != VERSION:
        raise CheckpointRefused(f"{path}: refused: manifest version {data.get('version')!r}, this runtime reads {VERSION}")
    signature = data.get("hmac")
    if not isinstance(signature, str):
        raise CheckpointRefused(f"{path}: refused: {MANIFEST} is not signed, so it was not written by plan run")
    try:
        key = signing_key(create=False)
    except CheckpointRefused as exc:
        raise CheckpointRefused(f"{path}: {exc}") from None
    if not hmac.compare_digest(signature, _signature(data, key)):
        raise CheckpointRefused(f"{path}: refused: {MANIFEST}'s signature does not match this account's key "
                                f"{key_path()} (signed elsewhere, or changed since)")
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
    return step, recorded


def check_hashes(path: Path, recorded: dict[str, str], names: list[str]) -> str | None:
    """The first of `names` whose sha256 differs from the manifest's, as a refusal line; None if all match."""
    got = sha256_files({rel: Path(path) / rel for rel in names})
    for rel in sorted(names):
        if got[rel] != recorded[rel]:
            return f"{path}: refused: {rel} does not match its sha256 in the manifest (changed or corrupt)"
    return None


def verify(path: Path, plan_sha256: str, model_sha256: str) -> int:
    """The checkpoint's step, once every check passed; CheckpointRefused (one line) otherwise."""
    step, recorded = check_manifest(path, plan_sha256, model_sha256)
    bad = check_hashes(path, recorded, list(recorded))
    if bad:
        raise CheckpointRefused(bad)
    return step


@dataclass(frozen=True)
class Found:
    path: Path
    step: int
    skipped: tuple[str, ...]
    """One line per newer checkpoint that was refused, with the reason."""


def candidates(root: Path) -> list[tuple[int, str, Path]]:
    """``step-NNNNNNNN-<plan>`` directories in `root`: (step, plan tag, path), newest first."""
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and not child.is_symlink():
            out.append((int(m.group(1)), m.group(2), child))
    return sorted(out, reverse=True)


def ours(root: Path, plan_sha256: str) -> list[tuple[int, Path]]:
    """This plan's checkpoint folders in `root` (by name), newest first; CheckpointRefused when
    `root` holds other plans' checkpoints only (a resume of an edited plan must not silently start
    over)."""
    found = candidates(Path(root))
    mine = [(step, path) for step, tag, path in found if tag == plan_tag(plan_sha256)]
    if found and not mine:
        raise CheckpointRefused(f"no usable checkpoint in {root}: {found[0][2].name} and any others were made for a "
                                "different plan (plan sha256 differs)")
    return mine


def find_latest(root: Path, plan_sha256: str, model_sha256: str) -> Found | None:
    """The newest checkpoint of this plan in `root` that verifies; None when `root` has none at all.

    CheckpointRefused when there are checkpoints and every one is refused (all reasons, one line)."""
    mine = ours(Path(root), plan_sha256)
    if not mine:
        return None
    skipped: list[str] = []
    for _, path in mine:
        try:
            step = verify(path, plan_sha256, model_sha256)
        except CheckpointRefused as exc:
            skipped.append(str(exc))
            continue
        return Found(path, step, tuple(skipped))
    raise CheckpointRefused(f"no usable checkpoint in {root}: " + "; ".join(skipped))


def write_manifest(path: Path, step: int, plan_sha256: str, model_sha256: str, hashed: dict[str, str] | None = None) -> None:
    """Sign and write the manifest of the complete checkpoint `path`, atomically (temp file, fsync,
    rename). `hashed`: sha256 already taken of some files (by the ranks that wrote them); the rest
    are hashed here."""
    present = _files(path)
    hashed = {rel: h for rel, h in (hashed or {}).items() if rel in present}
    files = {**hashed, **sha256_files({rel: p for rel, p in present.items() if rel not in hashed})}
    data: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "step": step, "plan_sha256": plan_sha256,
        "model_sha256": model_sha256, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": dict(sorted(files.items())),
    }
    data["hmac"] = _signature(data, signing_key(create=True))
    tmp = path / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_ours(path: Path, plan_sha256: str) -> bool:
    """`path` holds a manifest signed with this account's key for this plan."""
    data = _read_manifest(path)
    if data is None or data.get("plan_sha256") != plan_sha256 or not isinstance(data.get("hmac"), str):
        return False
    try:
        return hmac.compare_digest(data["hmac"], _signature(data, signing_key(create=False)))
    except CheckpointRefused:
        return False


def prune(root: Path, plan_sha256: str, keep: int = KEEP) -> list[Path]:
    """Delete all but the newest `keep` checkpoints this tool signed for this plan, and this plan's
    leftover partial folders; nothing else is touched (another plan's checkpoints included). The
    deleted paths."""
    removed = clean_partials(root, plan_sha256)
    mine = [path for step, tag, path in candidates(root) if tag == plan_tag(plan_sha256) and is_ours(path, plan_sha256)]
    for path in mine[keep:]:
        shutil.rmtree(path)
        removed.append(path)
    return removed


def clean_partials(root: Path, plan_sha256: str) -> list[Path]:
    """Remove this plan's partial folders (``.step-*-<plan>.partial-*``, ``.step-*-<plan>.old-*``:
    what a crashed save left)."""
    if not root.is_dir():
        return []
    pattern = re.compile(r"^\.step-\d{8}-%s\.(partial|old)-" % re.escape(plan_tag(plan_sha256)))
    removed = []
    for child in root.iterdir():
        if pattern.match(child.name) and child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def _fault(step: int, rank: int) -> None:
    """FAULT_ENV: kill this rank now when it names this save and rank."""
    want = os.environ.get(FAULT_ENV, "")
    if want == f"save:{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)


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
        from runtime.train import Optimizers, local_optimizer

        # ZeRO-1 (ZeroRedundancyOptimizer): the local optimizer, holding this rank's shard of the
        # parameters and their state; its flattened keys name those parameters, so each dp rank
        # saves and loads its own shard (the partition is deterministic: the same on resume).
        # With expert parallelism, the dense parameters' and the experts' (``Optimizers``): both,
        # their flattened keys merged (disjoint parameters).
        several = optimizer.optimizers if isinstance(optimizer, Optimizers) else (optimizer,)
        self.model, self.rank = model, rank
        self.optimizer: Any = tuple(local_optimizer(o) for o in several)

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
        """Every rank: write this step's checkpoint (see the module's docstring for the order)."""
        import torch.distributed.checkpoint as dcp

        final = step_dir(self.root, step, self.plan_sha256)
        names: list[Any] = [None]
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if final.exists() and not is_ours(final, self.plan_sha256):
                names[0] = f"!{final} exists and was not written by plan run for this plan: move it away"
            else:
                names[0] = str(self.root / f".{final.name}.partial-{os.getpid()}-{time.time_ns()}")
        dist.broadcast_object_list(names, src=0)
        if names[0].startswith("!"):
            raise CheckpointRefused(names[0][1:])
        partial = Path(names[0])
        dcp.save(self._state(), checkpoint_id=str(partial))
        _fault(step, self.rank)
        dist.barrier()  # every rank's shards and the metadata are written
        # each rank hashes the shards it wrote; rank 0 the rest (the metadata) with the manifest
        mine = {rel: p for rel, p in _files(partial).items()
                if (m := _RANK_FILE.match(rel)) is not None and int(m.group(1)) == self.rank}
        hashed: list[Any] = [None] * dist.get_world_size() if self.rank == 0 else []
        dist.gather_object(sha256_files(mine), hashed if self.rank == 0 else None, dst=0)
        if self.rank == 0:
            write_manifest(partial, step, self.plan_sha256, self.model_sha256,
                           {k: v for part in hashed for k, v in part.items()})
            old = None
            if final.exists():  # our own earlier checkpoint at this step (a resumed run reaching it again)
                old = self.root / f".{final.name}.old-{os.getpid()}-{time.time_ns()}"
                os.replace(final, old)
            os.replace(partial, final)
            _fsync_dir(self.root)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            prune(self.root, self.plan_sha256)
        dist.barrier()
        return final

    def load_latest(self) -> Found | None:
        """The newest checkpoint that verifies, loaded on every rank (None: none in DIR). Rank 0
        checks each one's manifest and signature, every rank hashes a share of its files."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        world = dist.get_world_size()
        skipped: list[str] = []
        found: Found | None = None
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ours(self.root, self.plan_sha256)
                clean_partials(self.root, self.plan_sha256)
            except CheckpointRefused as exc:
                box[0] = str(exc)
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise CheckpointRefused(box[0])
        for _, path in box[0]:
            checked: list[Any] = [None]
            if self.rank == 0:
                try:
                    checked[0] = check_manifest(path, self.plan_sha256, self.model_sha256)
                except CheckpointRefused as exc:
                    checked[0] = str(exc)
            dist.broadcast_object_list(checked, src=0)
            if isinstance(checked[0], str):
                skipped.append(checked[0])
                continue
            step, recorded = checked[0]
            share = sorted(recorded)[self.rank :: world]
            bad: list[Any] = [None] * world
            dist.all_gather_object(bad, check_hashes(path, recorded, share))
            refusal = next((b for b in bad if b), None)
            if refusal:
                skipped.append(refusal)
                continue
            found = Found(path, step, tuple(skipped))
            break
        if found is None:
            if skipped:
                raise CheckpointRefused(f"no usable checkpoint in {self.root}: " + "; ".join(skipped))
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
    """`state` ({"model": ..., "optim": ...}, the optimizer's flattened) with the entries of
    parameters held in part replaced by ``DTensor.from_local`` views of them (and of their optimizer
    state of the same shape), so DCP saves each part as its shard of the whole tensor, once, and
    loads it in place; the dicts are copies, the tensors shared:

    - TP shards localised for DDP (a parameter with ``_st_info``): their DTensor again;
    - stacked expert parameters (expert parallelism: this rank's ``[E/ep, ...]`` slice, or FSDP2's
      shard of it): their rows of the whole ``[E, ...]`` (``runtime.expert_parallel.stacked_shards``),
      whichever rank holds them; their expert replicas hold the same rows, saved once. (A list
      block's experts need nothing: each is saved under its own index in the model.)"""
    from torch.distributed.tensor import DTensor

    from runtime.expert_parallel import stacked_shards

    specs = {name: (p._st_info, p.shape) for name, p in model.named_parameters() if getattr(p, "_st_info", None) is not None}
    stacked = stacked_shards(model)
    if not specs and not stacked:
        return state

    def view(t: Any, name: str) -> Any:
        if name in stacked:
            shard = stacked[name]
            if not isinstance(t, torch.Tensor) or t.shape != shard.held_shape:
                return t  # a scalar (AdamW's step): the same on every rank
            local = t.to_local() if isinstance(t, DTensor) else t
            return DTensor.from_local(local, shard.mesh, shard.placements, run_check=False, shape=shard.shape,
                                      stride=_contiguous_strides(shard.shape))
        spec, local_shape = specs[name]
        if not isinstance(t, torch.Tensor) or isinstance(t, DTensor) or t.shape != local_shape:
            return t
        return DTensor.from_local(t, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)

    held = specs.keys() | stacked.keys()
    model_sd = {k: view(v, k) if k in held else v for k, v in state["model"].items()}
    optim_sd = {}
    for k, v in state["optim"].items():
        name = k[len("state."):].rpartition(".")[0] if k.startswith("state.") else ""
        optim_sd[k] = view(v, name) if name in held else v
    return {"model": model_sd, "optim": optim_sd}


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


def plan_sha256(plan_path: Path) -> str:
    return sha256_file(Path(plan_path))
