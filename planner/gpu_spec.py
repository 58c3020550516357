"""The GPUSpec type (one accelerator's peaks, memory and links) and the dtype names it knows.

A leaf module: ``planner.hardware`` (the catalogue) and ``planner.local_device`` (the measured
local CPU) both build GPUSpecs, so the type lives here and neither imports the other for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from planner.cost.constants import SDPA_CUDNN_ARCHS, TRITON_FLASH_SLOWDOWN
from planner.errors import BadInput

DTYPES = ("bf16", "fp16", "fp8", "fp4", "tf32", "fp32")
_DTYPE_ALIASES = {
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
    "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "nvfp4": "fp4", "mxfp4": "fp4", "float4": "fp4",
}


def _loglog(points: list[tuple[int, float]], x: float) -> float:
    """y at x from sorted (x, y) points: log-log interpolation inside, y proportional to x outside."""
    if x <= points[0][0]:
        return points[0][1] * x / points[0][0]
    if x >= points[-1][0]:
        return points[-1][1] * x / points[-1][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            t = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
    return float(x)


COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
"""What `plan calibrate` measures between processes, in its tables' order (comm.py costs each)."""


def _nearest(counts: set[int], processes: int) -> int:
    """The measured process count nearest `processes` in ratio (the smaller on a tie)."""
    return min(counts, key=lambda n: (abs(math.log(n / processes)), n))


def _at_nearest(steps: tuple[tuple[int, str, float], ...], processes: int, name: str) -> float | None:
    """Of (processes, name, seconds) figures, `name`'s at the measured count nearest `processes`;
    None if `name` was not measured."""
    counts = {n for n, k, _ in steps if k == name}
    if not counts:
        return None
    nearest = _nearest(counts, processes)
    return next(s for n, k, s in steps if n == nearest and k == name)


def low_precision_share(ceilings: tuple[tuple[float, float], tuple[float, float]], peak: float) -> float:
    """The share of `peak` (a lower precision's dense peak) that its best matmul reaches, from the
    (dense peak, measured share) of two higher precisions (16-bit and FP8). A matmul's time per
    FLOP is a part that runs at the tensor cores' rate, a / peak (a: clocks under the power limit,
    partial waves), and a part that does not speed up with the precision, c (its loads and epilogue):
    1 / ceiling = a / peak + c, two equations for a and c. A part whose FP8 matmuls reach the same
    share as its 16-bit ones has no such fixed part (c = 0): the lower precision reaches that share
    too. The B200 (bf16 1,745 of 2,250 and FP8 3,432.5 of 4,500 TFLOP/s, the MAMF table) gives 6,646
    TFLOP/s in NVFP4 against the 6,624 S. Bekman measured (ml-engineering, training/dtype.md, "FP4
    formats": NVFP4 MAMF on a B200 with torch 2.14); the B300 and GB300, whose FP8 matmuls reach 4
    points less of their peak than their bf16 ones, about 62% of their NVFP4 peak."""
    (p1, s1), (p2, s2) = ceilings
    if p1 == p2:  # one rate for both (a catalogue file's choice): nothing to tell the parts apart
        return s2
    a = (1 / (s1 * p1) - 1 / (s2 * p2)) / (1 / p1 - 1 / p2)
    c = 1 / (s1 * p1) - a / p1
    if c <= 0:
        return s2
    return 1 / (a + c * peak)


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: peaks, memory and links, all in SI units (FLOP/s, bytes, B/s, s)."""

    name: str
    """Catalogue key, the ``--gpu`` name: ``h100-sxm-80gb``."""
    display_name: str
    vendor: str
    peak_flops: dict[str, float]
    """Dense FLOP/s (not TFLOP/s) per dtype: bf16, fp16, fp8, tf32, fp32 (fp32 = no tensor cores)."""
    memory_bytes: int
    hbm_bandwidth_Bps: float
    intra_node_bandwidth_Bps: float
    """Per GPU, per direction, to the other GPUs of its node together."""
    intra_node_latency_s: float
    inter_node_bandwidth_Bps: float
    """Per GPU, per direction: its share of the node's network."""
    inter_node_latency_s: float
    gpus_per_node: int
    """GPUs that reach each other over the intra-node link (NVLink, xGMI or PCIe): a server, or
    a rack-scale NVLink domain (GB200 NVL72: 72)."""
    tdp_w: float | None
    sources: dict[str, str]
    """Field (``peak_flops.tf32`` for one dtype) -> where the number comes from."""
    origin: str
    """``packaged``, the path of a user file, or ``measured`` (the local CPU)."""
    intra_node_peer_bandwidth_Bps: float | None = None
    """Direct link between two GPUs where GPUs are meshed (MI300X xGMI); None behind a switch."""
    uncertain: tuple[str, ...] = ()
    """Fields whose value is an estimate (rule of thumb, assumption, not re-read)."""
    matmul_efficiency: float = 1.0
    """The largest share of the dense peak that 16-bit matmuls reach on this GPU, measured
    (maximum achievable matmul FLOPS over the best shapes / peak: A100 SXM 86%, H100 SXM 80%,
    MI300X 60%); 1.0 for the local CPU, whose peak is itself a measured matmul."""
    fp8_matmul_efficiency: float | None = None
    """The same for FP8 matmuls, against the FP8 dense peak, where measured (H100 SXM 71% against
    80% in bf16: FP8 GEMMs reach a smaller share); None: the 16-bit share."""
    gpus_per_host: int | None = None
    """Where the NVLink domain spans hosts (an NVL72 rack of 4-GPU trays), the GPUs of one host: a
    cluster that does not fill whole domains fills them host by host (256 GPUs: 4 racks of 64);
    None: the domain is one host."""
    attention_efficiency: float | None = None
    """The share of the 16-bit dense peak that the fused attention kernels PyTorch's SDPA runs
    (FlashAttention-2) reach in training, forward and backward, published per GPU generation (A100
    ~60%, H100 35%: FlashAttention-2 was written for Ampere); None: unknown, attention at the
    matmul rate."""
    matmul_shapes: str | None = None
    """The architecture whose measured matmul-by-shape table (planner.cost.gemm_shapes.TABLES)
    says how much of `matmul_efficiency` smaller GEMMs reach ("sm_90": Hopper); None: every GEMM
    at the full share."""
    compute_capability: str | None = None
    """NVIDIA's compute capability ("9.0": Hopper, "10.0": the B200 and GB200, "10.3": Blackwell
    Ultra), which decides the kernels torch's SDPA picks (attention_share); None: not an NVIDIA
    part, or not known."""
    cudnn_attention_efficiency: float | None = None
    """The same for cuDNN's fused attention, which Transformer Engine runs (Megatron-LM, NeMo:
    Training.attention_kernel "te"), where published: it uses Hopper's asynchronous tensor
    cores, FlashAttention-2 does not (H100: 54% against 35%); None: `attention_efficiency`."""
    tp_forward_overhead_s: float = 0.0
    """Host seconds DTensor adds to one tensor-parallel Linear's forward (sharding propagation,
    redistribution, wrapping), measured by `plan calibrate` on this stack (a column-wise then
    row-wise pair with sequence parallelism, against the plain pair); 0: not measured."""
    tp_backward_overhead_s: float = 0.0
    """The same for its backward."""
    optimizer_steps: tuple[tuple[int, str, float], ...] = ()
    """`plan calibrate`'s (processes, optimizer, seconds per parameter) of one optimizer step over
    fp32 parameters ("adamw", "sgd"), every process stepping at once; empty: the step is costed as
    memory-bound traffic."""
    loss_parallel_steps: tuple[tuple[int, str, float], ...] = ()
    """`plan calibrate`'s (processes, "forward" | "backward", seconds per fp32 logit element) that
    torch's loss_parallel (the runtime's loss on a vocabulary-split head) adds to a fused
    cross-entropy, every process at once (backward may be below 0: the runtime takes the loss's
    gradient in forward); empty: not measured (counted as the fused loss)."""
    process_slowdown: tuple[tuple[int, float], ...] = ()
    """The local CPU after `plan calibrate --gpu cpu`: (processes, how much longer one training step
    of a fixed model takes in each of that many processes sharing the cores, each with its share of
    the threads, than in one process with all of them), measured; empty: assumed proportional."""
    collectives: tuple[tuple[int, str, float, float], ...] = ()
    """The local CPU after `plan calibrate --gpu cpu`: (processes, kind, latency s, bus bandwidth
    B/s) of gloo's collectives (COLLECTIVE_KINDS) among that many local processes, fitted over
    message sizes; empty: the intra/inter-node figures for every group."""

    phase_factors: tuple[tuple[str, float], ...] = ()
    """Refit from run reports (`plan calibrate --from-run`): (phase, measured / predicted) for
    "compute" (forward, backward, recompute), "comm" (TP, CP, EP, pipeline and data-parallel
    traffic), "optimizer", and "tp_compute" (compute again, in plans with tensor parallelism: what
    the sharded layers lose or gain on this stack: smaller GEMMs, DTensor's per-op work); each
    multiplies the cost model's seconds for that phase; and "zero_comm" and "tp_comm", in place of
    "comm" for ZeRO-2/3's traffic every micro-batch (FSDP's gathers and reduce-scatters, layer by
    layer, with their copies) and for tensor parallelism's: many collectives between and beside
    computations, where DDP runs a few after the backward (on gloo a rank's collectives and its
    compute share its cores). Empty: 1; "zero_comm" or "tp_comm" unset: "comm"."""

    def matmul_share(self, dtype: str) -> float:
        """The measured ceiling of `dtype`'s matmuls, a share of that dtype's dense peak. FP4's,
        measured on few parts, follows from the 16-bit and FP8 ones (`low_precision_share`)."""
        fp8 = self.fp8_matmul_efficiency or self.matmul_efficiency
        if dtype == "fp4" and all(k in self.peak_flops for k in ("bf16", "fp8", "fp4")):
            rates = (self.peak_flops["bf16"], self.matmul_efficiency), (self.peak_flops["fp8"], fp8)
            return low_precision_share(rates, self.peak_flops["fp4"])
        return fp8 if dtype in ("fp8", "fp4") else self.matmul_efficiency

    def sdpa_runs_cudnn(self, sdpa_cudnn: bool) -> bool:
        """Whether torch's SDPA runs cuDNN's attention here, for a torch that prefers it
        (`sdpa_cudnn`: Training.sdpa_cudnn) on this GPU's compute capability (SDPA_CUDNN_ARCHS)."""
        return sdpa_cudnn and self.compute_capability in SDPA_CUDNN_ARCHS

    def attention_share(self, kernel: str, sdpa_cudnn: bool = False) -> float | None:
        """The share of the 16-bit peak fused attention reaches with `kernel` (Training.attention_kernel):
        "sdpa" FlashAttention-2's, or cuDNN's where the trainer's torch puts cuDNN first on this GPU
        (`sdpa_cudnn`, Training.sdpa_cudnn, on the compute capabilities of SDPA_CUDNN_ARCHS); "te"
        cuDNN's where published; "triton" FlashAttention in Triton's (FlashAttention-2's over
        constants.TRITON_FLASH_SLOWDOWN)."""
        if (kernel == "te" or kernel == "sdpa" and self.sdpa_runs_cudnn(sdpa_cudnn)) and self.cudnn_attention_efficiency is not None:
            return self.cudnn_attention_efficiency
        if kernel == "triton" and self.attention_efficiency is not None:
            return self.attention_efficiency / TRITON_FLASH_SLOWDOWN
        return self.attention_efficiency

    def factor(self, phase: str) -> float:
        default = self.factor("comm") if phase in ("zero_comm", "tp_comm") else 1.0
        return next((f for name, f in self.phase_factors if name == phase), default)

    def slowdown(self, processes: float) -> float:
        """`process_slowdown` at `processes`: interpolated in log-log between the measured counts,
        proportional to the count beyond them; the count itself when none was measured."""
        points = sorted(self.process_slowdown)
        if not points:
            return float(processes)
        return _loglog(points, processes)

    def collective(self, group_size: int) -> tuple[tuple[str, float, float], ...]:
        """(kind, latency s, bus bandwidth B/s) measured for the nearest process count; () if none."""
        if not self.collectives:
            return ()
        nearest = _nearest({c[0] for c in self.collectives}, group_size)
        return tuple((kind, latency, busbw) for n, kind, latency, busbw in self.collectives if n == nearest)

    def optimizer_s_per_param(self, processes: int, optimizer: str) -> float | None:
        """`optimizer_steps` at the measured process count nearest `processes`; None if not measured."""
        return _at_nearest(self.optimizer_steps, processes, optimizer)

    def loss_parallel_s_per_element(self, processes: int) -> tuple[float, float]:
        """(forward, backward) of `loss_parallel_steps` at the measured process count nearest
        `processes`; (0, 0) if not measured."""
        fwd, bwd = (_at_nearest(self.loss_parallel_steps, processes, phase) for phase in ("forward", "backward"))
        return fwd or 0.0, bwd or 0.0

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` (``bf16``, ``torch.bfloat16``, ``float32`` ...)."""
        key = str(dtype).lower().removeprefix("torch.")
        key = _DTYPE_ALIASES.get(key, key)
        if key not in self.peak_flops:
            have = ", ".join(sorted(self.peak_flops))
            raise BadInput(f"{self.name} ({self.display_name}) has no {key} peak; it has: {have}")
        return self.peak_flops[key]

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / 1e9

    def power_capped(self, watts: float) -> "GPUSpec":
        """This part run under a power limit below its TDP (nvidia-smi -pl, or a board built for
        less): its sustained clocks, and so its compute peaks, scale as the cube root of the power
        (dynamic power ~ f V^2, the voltage rising with the clock). Checked against a part sold at
        less power: the H100 NVL, the same 132-SM die at 350-400 W, is rated 835 dense bf16 TFLOP/s
        against the 700 W SXM's 989 (0.84; the law gives 0.79-0.83, a few percent low). Memory bandwidth is left as
        is (its clock is not the one capped). Unchanged without a TDP or at or above it."""
        if not self.tdp_w or watts >= self.tdp_w:
            return self
        scale = (watts / self.tdp_w) ** (1 / 3)
        return replace(self, peak_flops={k: v * scale for k, v in self.peak_flops.items()}, tdp_w=watts,
                       sources={**self.sources, "peak_flops": f"{self.sources.get('peak_flops', 'catalogue')}; "
                                f"x{scale:.3f} under a {watts:g} W power limit (cube root of {watts:g} / {self.tdp_w:g} W)"})

