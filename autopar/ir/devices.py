"""Device profiles: what the cost model needs to know about one accelerator.

Figures are the vendors' dense (no sparsity) peaks; the roofline uses them scaled by an
achievable fraction, because no real kernel reaches the datasheet number and the fraction
differs between matmuls and memory-bound ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.ir.errors import MeshError

GiB = 1024**3
RESERVE_FRACTION = 0.075
RESERVE_MIN_BYTES = 2 * GiB
TFLOPS = 1e12
GBps = 1e9


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
    extra: dict[str, float] = field(default_factory=dict)

    def flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s for ``dtype`` (falls back to float32's peak for unknown dtypes)."""
        peak = self.peak_flops.get(dtype) or self.peak_flops["float32"]
        return peak * self.matmul_efficiency

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


def _gpu(name, fp32, tf32, bf16, fp8, bw, cap, nvlink, ib, pcie=50 * GBps) -> DeviceProfile:
    flops = {"float32": tf32, "float32_strict": fp32, "bfloat16": bf16, "float16": bf16}
    if fp8:
        flops["float8_e4m3fn"] = fp8
        flops["float8_e5m2"] = fp8
    return DeviceProfile(name, flops, bw, cap, nvlink, ib, host_link_bandwidth=pcie)


# float32 matmuls are planned at TF32 rate, which is what torch uses with
# ``torch.backends.cuda.matmul.allow_tf32`` / ``set_float32_matmul_precision("high")``.
PROFILES: dict[str, DeviceProfile] = {
    "h100": _gpu("h100", 67 * TFLOPS, 495 * TFLOPS, 989 * TFLOPS, 1979 * TFLOPS,
                 3350 * GBps, 80 * GiB, 450 * GBps, 50 * GBps),
    "h200": _gpu("h200", 67 * TFLOPS, 495 * TFLOPS, 989 * TFLOPS, 1979 * TFLOPS,
                 4800 * GBps, 141 * GiB, 450 * GBps, 50 * GBps),
    "a100": _gpu("a100", 19.5 * TFLOPS, 156 * TFLOPS, 312 * TFLOPS, 0.0,
                 2039 * GBps, 80 * GiB, 300 * GBps, 25 * GBps, pcie=25 * GBps),
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


def get_profile(name: str | DeviceProfile) -> DeviceProfile:
    if isinstance(name, DeviceProfile):
        return name
    key = name.lower().replace("-", "").replace("_", "")
    for alias, real in (("h100sxm", "h100"), ("a10080gb", "a100"), ("h200sxm", "h200")):
        if key == alias:
            key = real
    if key not in PROFILES:
        raise MeshError(
            f"unknown device {name!r}: use one of {', '.join(sorted(PROFILES))}, "
            "or pass an autopar.DeviceProfile"
        )
    return PROFILES[key]
