"""Device profiles: what the cost model needs to know about one accelerator.

Figures are the vendors' dense (no sparsity) peaks; the roofline uses them scaled by an
achievable fraction, because no real kernel reaches the datasheet number and the fraction
differs between matmuls and memory-bound ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from autopar.ir.errors import MeshError

GiB = 1024**3
RESERVE_FRACTION = 0.075
RESERVE_MIN_BYTES = 2 * GiB
TFLOPS = 1e12
GBps = 1e9


@dataclass(frozen=True, slots=True)
class NcclProtocol:
    """One of NCCL's three wire protocols as NCCL's own tuning model prices it
    (NVIDIA/nccl ``src/graph/tuning.cc``, ``ncclTopoTuneModel``; the same figures for Ampere
    and Hopper): a fixed latency, a latency per ring step within a node (NVLink) and across
    nodes (the network; with one GPU per node the tree's network latency, as NCCL takes it),
    and the share of the link's bus bandwidth it reaches. LL (8-byte stores with a flag)
    reaches half the bandwidth, LL128 92%, Simple all of it at the highest latency: NCCL picks
    the fastest per message size, which is why small messages reach a fraction of the peak
    bus bandwidth. ``tree_*``: the same for the tree all-reduce NCCL runs across nodes, its
    latency logarithmic in the nodes, its bandwidth 0.92 of the link (``/3.8`` for LL)."""

    name: str
    base_s: float
    nvlink_step_s: float
    net_step_s: float
    net_step_one_per_node_s: float
    bw_fraction: float
    tree_base_s: float
    tree_nvlink_step_s: float
    tree_net_step_s: float
    tree_bw_fraction: float


# NVIDIA/nccl src/graph/tuning.cc (v2.21-2.27): baseLat (Ring, Tree), hwLat NVLINK and NET
# rows (Ring, Tree), and the bandwidth refinements (Ring LL x0.5, LL128 x0.92; Tree x0.92,
# LL /3.8, LL128 x120/128), in seconds
NCCL_PROTOCOLS = (
    NcclProtocol("LL", 6.6e-6, 0.6e-6, 2.7e-6, 5.0e-6, 0.5, 6.8e-6, 0.6e-6, 5.0e-6, 0.92 / 3.8),
    NcclProtocol("LL128", 14.0e-6, 1.9e-6, 4.0e-6, 8.5e-6, 0.92, 14.0e-6, 1.25e-6, 8.5e-6,
                 0.92 * 120 / 128),
    NcclProtocol("Simple", 8.4e-6, 3.4e-6, 14.0e-6, 14.0e-6, 1.0, 8.4e-6, 4.0e-6, 14.0e-6, 0.92),
)
# a ring crossing nodes posts each step to the network: at least 1 us a step (3 for Simple)
NCCL_NET_OVERHEAD_S = 1e-6


@dataclass(frozen=True, slots=True)
class NcclModel:
    """How NCCL prices a collective by message size (:func:`autopar.passes.cost.cost_model.
    collective_time`): its protocols, and the cap on LL's bus bandwidth (NCCL's ``llMaxBws``:
    within one node by GPU generation, across nodes by the host CPU, Intel's figures taken)."""

    protocols: tuple[NcclProtocol, ...] = NCCL_PROTOCOLS
    ll_max_busbw_node: float = 141.0 * 1e9  # Hopper; Ampere 87.7
    ll_max_busbw_two_nodes: float = 39.0 * 1e9
    ll_max_busbw_nodes: float = 20.4 * 1e9
    net_overhead_s: float = NCCL_NET_OVERHEAD_S


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    peak_flops: dict[str, float]  # per dtype name ("float32", "bfloat16", ...), FLOP/s
    mem_bandwidth: float  # bytes/s of device memory
    mem_capacity: float  # bytes
    intra_node_bandwidth: float  # bytes/s per device across the node's fabric (NVLink)
    inter_node_bandwidth: float  # bytes/s per device across nodes (InfiniBand / Ethernet)
    intra_node_latency: float = 5e-6
    inter_node_latency: float = 10e-6
    devices_per_node: int = 8
    # fixed price of issuing one collective, whatever its size and steps (launch, sync)
    collective_overhead: float = 10e-6
    matmul_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    # whether communication runs beside compute (NCCL on its own stream) rather than taking
    # the compute's own cores (gloo on a CPU machine): it decides whether a small first
    # gradient bucket, issued early to overlap the rest of the backward, pays for itself
    comm_overlaps_compute: bool = True
    # the precision a plan gets when none is asked for (passes.mixed_precision): GPUs train in
    # bf16; a CPU's bf16 matmuls are slower than its fp32 ones
    default_precision: str = "bf16"
    # the link to host memory (PCIe) per device, each way, and the host memory bandwidth one
    # device's share of the host CPUs reach: what offloading optimizer state pays
    # (passes.zero.offload_time). A DGX H100: PCIe 5 x16 (about 50 GB/s achieved) and two
    # sockets of 8-channel DDR5 shared by 8 GPUs (about 40 GB/s each for an optimizer step)
    host_link_bandwidth: float = 50 * GBps
    host_memory_bandwidth: float = 40 * GBps
    # What torch's pipeline runtime costs the host beside the stages' work (passes.
    # pipeline_cost.Overheads): per action it runs, per send or receive it posts to another
    # rank, and per autograd node a split backward (zero-bubble schedules) walks again. Where
    # the host queues work ahead of the device (a GPU) they hide behind the device's work, so
    # the GPU profiles leave them 0; on a CPU the host is the device and they add up.
    pipeline_action_s: float = 0.0
    p2p_post_s: float = 0.0
    split_backward_node_s: float = 0.0
    # cores the devices of a node share when each device is a process of one CPU machine
    # (0: every device computes on its own); the rates above are then per device with all of
    # them computing, and a device computes faster while others wait (pipeline bubbles)
    shared_cores: int = 0
    # GEMMs by shape (:meth:`gemm_efficiency`): the streaming multiprocessors a GEMM's output
    # tiles are spread over and the output tile of the library's large-GEMM kernels; 0 SMs:
    # every GEMM at ``matmul_efficiency`` (the CPU)
    sms: int = 0
    gemm_tile: tuple[int, int] = (128, 128)
    # fused (flash) attention, forward and backward, as a fraction of the dense peak, FLOPs
    # counted as the kernel does them (autopar.capture.flops.attention_flops); 0: as a GEMM
    attention_efficiency: float = 0.0
    # collectives priced by NCCL's protocol model (message size picks LL, LL128 or Simple,
    # ring or tree), with the mesh axis's bandwidth as the link; None: the plain ring formula
    # with the axis's latency per step and ``collective_overhead`` (gloo on the CPU)
    nccl: NcclModel | None = None
    # the share of the in-line all-gathers and reduce-scatters over a mesh axis inside one
    # node (sequence-parallel tensor parallelism's) hidden behind the matmuls they feed or
    # are fed by: torch's micro-pipelined async TP (0: vanilla TP, in line). Set by the
    # ``+async-tp`` suffix of a device name (:func:`get_profile`), as
    # :data:`ASYNC_TP_HIDDEN`
    async_tp: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s for ``dtype`` of a large GEMM (falls back to float32's peak for
        unknown dtypes)."""
        return self.peak(dtype) * self.matmul_efficiency

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype) or self.peak_flops["float32"]

    def gemm_efficiency(self, m: int, n: int, k: int) -> float:
        """The fraction of the peak a GEMM ``[m, k] x [k, n]`` reaches: the large-GEMM
        efficiency (``matmul_efficiency``) times the two losses NVIDIA's GEMM guide names for
        small and odd shapes ("Matrix Multiplication Background User's Guide",
        docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication): tile
        quantization (the output is cut into tiles; one hanging over the edge computes in
        full) and wave quantization (tiles run in waves of one per SM, the last wave part
        empty). The library picks its tile per shape: ``gemm_tile`` for large GEMMs, or a
        half or quarter of it, which fills more SMs but reuses each loaded element less (its
        rate taken in proportion to the tile's arithmetic intensity, ``tm*tn/(tm+tn)``); the
        best of them is taken. A skinny GEMM (the few tokens of a small microbatch) falls
        well below the peak; a large one keeps ``matmul_efficiency``. ``k`` only lengthens a
        tile's work; where it is small the GEMM is memory-bound, which the roofline prices."""
        if self.sms <= 0 or m <= 0 or n <= 0 or k <= 0:
            return self.matmul_efficiency
        if m < n:  # the library lays the longer side along the tile's longer edge
            m, n = n, m
        big_m, big_n = self.gemm_tile
        best = 0.0
        for tm, tn in ((big_m, big_n), (big_m // 2, big_n), (big_m // 2, big_n // 2),
                       (big_m // 4, big_n // 2)):
            rows, cols = math.ceil(m / tm), math.ceil(n / tn)
            tile_use = (m * n) / (rows * tm * cols * tn)
            tiles = rows * cols
            wave_use = tiles / (math.ceil(tiles / self.sms) * self.sms)
            intensity = (tm * tn / (tm + tn)) / (big_m * big_n / (big_m + big_n))
            best = max(best, tile_use * wave_use * intensity)
        return self.matmul_efficiency * best

    def attention_flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s of a fused attention kernel (``attention_efficiency`` of the
        peak; a profile without one prices attention as a large GEMM)."""
        return self.peak(dtype) * (self.attention_efficiency or self.matmul_efficiency)

    def bytes_per_s(self) -> float:
        return self.mem_bandwidth * self.memory_efficiency

    @property
    def memory_reserve(self) -> float:
        """Bytes of the device's memory a plan leaves free: the framework's own (CUDA context,
        NCCL's buffers, kernels' workspaces) and the caching allocator's fragmentation, which
        no tensor of the step accounts for. 7.5% of the capacity, at least 2 GiB: 6 GiB of an
        H100's 80 (torchtitan's and Megatron's runs of a full H100 leave about as much)."""
        return max(RESERVE_MIN_BYTES, RESERVE_FRACTION * self.mem_capacity)

    @property
    def memory_limit(self) -> float:
        """The default per-device memory limit of a plan: capacity less the reserve."""
        return self.mem_capacity - self.memory_reserve


def _gpu(name, fp32, tf32, bf16, fp8, bw, cap, nvlink, ib, pcie=50 * GBps,
         **figures) -> DeviceProfile:
    flops = {"float32": tf32, "float32_strict": fp32, "bfloat16": bf16, "float16": bf16}
    if fp8:
        flops["float8_e4m3fn"] = fp8
        flops["float8_e5m2"] = fp8
    return DeviceProfile(name, flops, bw, cap, nvlink, ib, host_link_bandwidth=pcie, **figures)


# Where each figure comes from (docs/device_profiles.md says how the cost model reads them):
#
# - peaks: the vendors' dense tensor-core datasheet figures (A100: NVIDIA A100 datasheet,
#   312 TFLOP/s bf16/fp16, 156 TF32; H100 SXM: H100 datasheet, 989 bf16, 495 TF32, 1979
#   fp8); memory bandwidth and capacity from the same sheets.
# - ``matmul_efficiency``: the maximum achievable matmul FLOP/s (MAMF) measured with
#   bf16 torch.matmul over a search of large shapes, over the peak: A100 SXM 267.9 of 312
#   (85.9%), H100 SXM 792.1 of 989 (80.1%) (S. Bekman, ml-engineering,
#   compute/accelerator/README.md "Maximum Achievable Matmul FLOPS comparison table").
# - ``sms`` and ``gemm_tile``: 108 SMs (A100), 132 (H100 SXM) (NVIDIA A100 and Hopper
#   architecture whitepapers); cuBLAS's large-GEMM tiles 256x128 on both (the tile sizes
#   NVIDIA's GEMM guide lists for Ampere and later: 256x128 the most efficient).
# - ``attention_efficiency``: FlashAttention-2 (what torch's SDPA runs on these GPUs), forward
#   and backward: 50-73% of an A100's peak (Dao, FlashAttention-2, arXiv 2307.08691, §4.1;
#   0.6 taken for head dims 64-128 at sequences of 2k-8k); on H100, which FA2 does not use
#   the Hopper-specific instructions of, torch's SDPA measured 287-304 TFLOP/s forward at
#   head dim 128, sequences 1k-16k (pytorch/benchmark PR #2296), FA2 up to 335 forward and
#   backward (the paper, §4.1): 0.3 of 989.
# - ``intra_node_bandwidth``: NCCL bus bandwidth (nccl-tests ``busbw``, which the ring
#   formulas of passes/cost/cost_model.py take as the per-device link) of large all-reduce,
#   all-gather and reduce-scatter on 8 GPUs of one NVSwitch node: A100 NVLink3 230-250 GB/s,
#   H100 NVLink4 460-480 GB/s for all-reduce with NVLink SHARP (docs.alayanew.com, "NCCL-tests
#   in practice", reference numbers), about 370 GB/s for the ring collectives without it:
#   230 and 370 taken, one figure for every collective kind.
# - ``inter_node_bandwidth``: one NIC per GPU, at the rate the NCCL ring reaches over it:
#   HDR InfiniBand 200 Gb/s = 25 GB/s (DGX A100), NDR/RoCE 400 Gb/s = 50 GB/s (DGX H100,
#   Grand Teton), each at 90% (nccl-tests busbw across nodes reaches 90-95% of the NICs'
#   line rate). A collective over an axis with k members in each node runs k rings side
#   by side over k NICs (ir/mesh.py).
# - collectives by message size (``nccl``): NCCL's own cost model (NVIDIA/nccl
#   src/graph/tuning.cc; :class:`NcclProtocol`), its latencies and per-protocol bandwidth
#   shares, with the bus bandwidths above as the link. Held against nccl-tests all-reduce on
#   8 NVLink-4 GPUs (kvcache-ai/Mooncake PR #3484: 1 MiB 27.8 us, 16 MiB 121 us, 128 MiB
#   700 us, 1 GiB 5.25 ms; the model 28, 127, 691, 5,135 us) and across 4 HGX H100 nodes of
#   8 NICs (NVIDIA/nccl-tests #309: busbw 366 GB/s; the model 360).
#   ``tests/passes/cost/test_nccl_curve.py`` holds these. LL's cap (``llMaxBws``): 141 GB/s
#   on one Hopper node, 87.7 on Ampere, 39 / 20.4 across 2 / more nodes.
# - latencies, ``collective_overhead``: the plain ring formula's (a small NCCL collective
#   costs 10-30 us; per ring step 5 / 10 us plus 10 us issue overhead); with ``nccl`` set
#   they only decide which sums merge into one ring (cost_model.merged_sums) and price the
#   pipeline's tied-weight all-reduce.
# - ``memory_efficiency``: STREAM-like copies reach about 80-90% of HBM's peak (the
#   default 0.8 kept).
A100_MAMF = 267.9 / 312
H100_MAMF = 792.1 / 989
NCCL_IB = 0.9  # of a NIC's line rate that NCCL's rings reach across nodes
_A100 = dict(sms=108, gemm_tile=(256, 128), attention_efficiency=0.6,
             matmul_efficiency=A100_MAMF, inter_node_latency=10e-6,
             nccl=NcclModel(ll_max_busbw_node=87.7 * GBps))
_H100 = dict(sms=132, gemm_tile=(256, 128), attention_efficiency=0.3,
             matmul_efficiency=H100_MAMF, inter_node_latency=10e-6,
             nccl=NcclModel(ll_max_busbw_node=141.0 * GBps))

# float32 matmuls are planned at TF32 rate, which is what torch uses with
# ``torch.backends.cuda.matmul.allow_tf32`` / ``set_float32_matmul_precision("high")``.
PROFILES: dict[str, DeviceProfile] = {
    "h100": _gpu("h100", 67 * TFLOPS, 495 * TFLOPS, 989 * TFLOPS, 1979 * TFLOPS,
                 3350 * GBps, 80 * GiB, 370 * GBps, NCCL_IB * 50 * GBps, **_H100),
    # H100 SXM with 96 GB of HBM2e (Meta's Grand Teton, torchtitan's benchmarks), capped at
    # 500 W: its clock under load, so its peak, lies between the SXM's 989 (700 W) and the
    # H100 NVL's 835 TFLOP/s bf16 (H100 NVL datasheet, 350-400 W, the same 132 SMs), and its
    # owners do not know it exactly (torchtitan's benchmark notes): the midpoint, 912, is
    # taken. Its memory is HBM2e at 2.4 TB/s, not the 80 GB part's HBM3 at 3.35: "Each H100
    # GPU is equipped with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth" (torchtitan,
    # benchmarks/llama3_h100_202412_torchtitan.md, Hardware; the H100 NVL's HBM3 is 3.9).
    # One 400 Gb/s NIC per GPU.
    "h100-96gb": _gpu("h100-96gb", 62 * TFLOPS, 456 * TFLOPS, 912 * TFLOPS, 1824 * TFLOPS,
                      2400 * GBps, 96 * GiB, 370 * GBps, NCCL_IB * 50 * GBps, **_H100),
    "h200": _gpu("h200", 67 * TFLOPS, 495 * TFLOPS, 989 * TFLOPS, 1979 * TFLOPS,
                 4800 * GBps, 141 * GiB, 370 * GBps, NCCL_IB * 50 * GBps, **_H100),
    "a100": _gpu("a100", 19.5 * TFLOPS, 156 * TFLOPS, 312 * TFLOPS, 0.0,
                 2039 * GBps, 80 * GiB, 230 * GBps, NCCL_IB * 25 * GBps, pcie=25 * GBps,
                 **_A100),
    # the 40 GB A100 SXM: the same compute and links, HBM2 at 1,555 GB/s (A100 datasheet)
    "a100-40gb": _gpu("a100-40gb", 19.5 * TFLOPS, 156 * TFLOPS, 312 * TFLOPS, 0.0,
                      1555 * GBps, 40 * GiB, 230 * GBps, NCCL_IB * 25 * GBps, pcie=25 * GBps,
                      **_A100),
    # A CPU process talking gloo over loopback, as `autopar train` runs, measured with 4 ranks
    # on a 2-core machine: a synchronous collective costs 2.5-4 ms whatever its size up to
    # 64 KiB (16 B all-reduce 3.4 ms, 64 KiB all-gather 3.9 ms; 7 ms right after compute, when
    # the ranks are out of step), and about 1 GB/s beyond (1 MiB all-reduce 5.3 ms, 1 MiB
    # all-gather into 4 MiB 6.3 ms, 4 MiB all-reduce 7-8 ms). So each collective is charged
    # 2.5 ms, each ring step 200 us and the link 1.2 GB/s (mean error over those 10 cases
    # 0.2, where the earlier 1 ms and 0.5 GB/s were off by half). Gloo reduces on the CPU
    # cores the model computes on (a 1 MiB all-reduce over 4 ranks measured about 2 ms of CPU
    # per process, a 3 MiB one about 2.5 ms), so communication does not overlap compute for
    # free: gradients go out in as few buckets as the bucket size allows.
    "cpu": DeviceProfile(
        "cpu",
        {"float32": 50e9, "bfloat16": 10e9, "float16": 5e9},
        mem_bandwidth=10 * GBps,
        mem_capacity=16 * GiB,
        intra_node_bandwidth=1.2 * GBps,
        inter_node_bandwidth=0.5 * GBps,
        intra_node_latency=200e-6,
        inter_node_latency=400e-6,
        devices_per_node=64,
        collective_overhead=2.5e-3,
        matmul_efficiency=0.5,
        memory_efficiency=0.5,
        comm_overlaps_compute=False,
        default_precision="fp32",
        # the host is the device: "offloading" copies within the same memory
        host_link_bandwidth=10 * GBps,
        host_memory_bandwidth=10 * GBps,
        # torch's pipeline runtime on gloo, measured here (benchmarks/pipeline_calibration.py,
        # stages of one tiny Linear, so the step is the runtime's own cost): 34 us per action
        # with every stage on one process; 290 us per send or receive posted between 2
        # processes (the schedule replay's best fit to all 7 schedules' steps at m=8 and 32;
        # it errs by -45% to +140% per schedule, so this is an average); a split backward
        # 9.1 us per autograd node beyond the whole one (a GPT-2 block's 42 nodes)
        pipeline_action_s=34e-6,
        p2p_post_s=290e-6,
        split_backward_node_s=9.1e-6,
        # the machine these figures were measured on: 2 cores, 4 processes
        shared_cores=2,
    ),
}


# What torch's async TP (micro-pipelined all-gather-matmul and matmul-reduce-scatter, on by
# torchtitan's ``enable_async_tensor_parallel``) hides of the collectives it fuses. Nothing
# public measures it per collective; this is fitted to the two published async/vanilla pairs
# that differ in nothing else (torchtitan's June 2025 H100 runs: Llama 3 8B on 64 GPUs, 70B
# on 256), with the leave-one-out error reported (benchmarks/async_tp.py, docs/
# device_profiles.md): 0.34 from the 8B pair, 0.41 from the 70B, their mean taken. Hiding all
# of it would predict two to three times the measured gains: the decomposed matmuls run
# smaller GEMMs, and the copies share memory bandwidth with them.
ASYNC_TP_HIDDEN = 0.37
ASYNC_TP_SUFFIX = "+async-tp"


def get_profile(name: str | DeviceProfile) -> DeviceProfile:
    """The profile of a device's name (aliases taken); ``NAME+async-tp``: that profile with
    sequence-parallel TP's collectives run as torch's async TP runs them
    (:data:`ASYNC_TP_HIDDEN`)."""
    if isinstance(name, DeviceProfile):
        return name
    if name.lower().endswith(ASYNC_TP_SUFFIX):
        base = get_profile(name[: -len(ASYNC_TP_SUFFIX)])
        if not base.comm_overlaps_compute:
            raise MeshError(f"device {name!r}: async TP overlaps collectives with compute, "
                            f"which {base.name!r} does not run beside each other; drop "
                            f"{ASYNC_TP_SUFFIX!r}")
        return replace(base, name=base.name + ASYNC_TP_SUFFIX, async_tp=ASYNC_TP_HIDDEN)
    key = name.lower().replace("-", "").replace("_", "")
    for alias, real in (("h100sxm", "h100"), ("a10080gb", "a100"), ("h200sxm", "h200"),
                        ("h10096gb", "h100-96gb"), ("a10040gb", "a100-40gb")):
        if key == alias:
            key = real
    if key not in PROFILES:
        raise MeshError(
            f"unknown device {name!r}: use one of {', '.join(sorted(PROFILES))} (a GPU's "
            f"with {ASYNC_TP_SUFFIX!r} for async TP), or pass an autopar.DeviceProfile"
        )
    return PROFILES[key]
