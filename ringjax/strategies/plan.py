"""A cost model for ring attention: per-step compute against per-step K/V transfer, per chip.

`plan(chip, ...)` predicts, for one ring step, the attention compute time on one
device and the time to send its K/V shard to the ring neighbour, says whether the
transfer hides under the compute, and recommends a layout and block sizes. It is
napkin math from published peak figures (sources beside each chip), scaled by an
assumed kernel efficiency; collectives and the ring's per-step cost are measured
figures where a chip has them (H100, H200), else the link's nominal rate and nothing.

Model (per device, local shard t = seq_len / ring_size, G = heads / kv_heads):
- a full step is 2 * batch * heads * t^2 * (head_dim + v_head_dim) FLOPs forward (QK^T over q/k's
  head_dim, PV over v's; v_head_dim defaults to head_dim);
  backward costs `backward_flop_factor` times that (2.5 for FlashAttention-2's five
  matmuls; ringjax's TPU kernels recompute QK^T in their dK/dV and dQ kernels: 3.5);
- causal work per step: zigzag and striped give every device half a step at every
  step; contiguous leaves some devices idle but the slowest one does a full step at
  every step but the first, so the ring takes as long as without the mask;
- compute time is max(FLOPs / (peak * efficiency), HBM bytes / HBM bandwidth), where
  a flash kernel re-reads K/V once per query tile of block_q rows;
- a step sends K and V (batch * t * kv_heads * (head_dim + v_head_dim) * itemsize bytes) over one
  link in one direction; backward also sends dK and dV, which ringjax accumulates in
  float32;
- every step after the first also pays the chip's `ring_step_s` (launches, merges, latency).
"""

from __future__ import annotations

import dataclasses
import math

from ringjax.dispatch.costs import Collective, visible_pairs, visited_pairs
from ringjax.layouts import sorted_shards
from ringjax.options import LAYOUTS, AttentionOptions, chunks_per_shard, keywords_of, sequence_chunks


def check_fraction(name, value):
    """A share in (0, 1] (not nan); `python -m ringjax strategy` checks its flags with it too."""
    if not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value}")


def check_rate(name, value):
    """A positive finite rate (FLOP/s, bytes/s); `python -m ringjax strategy` checks --link-gbps with it too."""
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value}")


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-chip figures: published dense bf16 FLOP/s, HBM bytes/s, one-way bytes/s to one ring neighbour;
    measured collective and ring-step costs where there are some."""

    name: str
    kind: str  # "tpu" or "gpu"
    peak_flops: float
    hbm_bandwidth: float
    link_bandwidth: float
    vmem_budget: int | None = None  # bytes of VMEM a kernel may use by default (TPU)
    hbm_bytes: float = 0.0  # HBM capacity; 0: unknown (no memory limit is applied)
    # measured (kind, latency + bytes / rate) of "ppermute", "all_gather", "reduce_scatter", "all_to_all", as
    # bytes each device receives; a kind not listed moves at link_bandwidth with no latency
    collectives: tuple[tuple[str, Collective], ...] = ()
    # (forward, backward) seconds the ring pays at each step after the first beyond its kernels and the
    # transfers they do not hide: launches, the lse merge and gradient sums in HBM, the ppermute's latency
    ring_step_s: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self):
        for name in ("peak_flops", "hbm_bandwidth", "link_bandwidth"):  # divisors of every time the model gives
            check_rate(name, getattr(self, name))

    def collective(self, kind: str) -> Collective | None:
        """The measured figure of `kind`, or None."""
        return dict(self.collectives).get(kind)


# Measured on 2 H100 SXM (NVLink 4 through NVSwitch), jax 0.11.2, 2026-11-25: fitted to
# benchmarks/results/nvidia-h100-80gb-hbm3_x2_2026-11-25_strategies.jsonl and _ring.jsonl (causal zigzag, bf16,
# 32 heads, 8 and 32 KV heads, 4K-32K tokens per GPU) as each strategy's time less its kernels' calibrated
# time (ringjax/configs/calibration/NVIDIA_H100_80GB_HBM3.json), least squares weighted by 1 / the time.
# all_gather rows (forward one gather, backward a gather and a float32 reduce-scatter): 0.09 ms + bytes at
# 274 GB/s. A 2-device all-to-all is also one transfer each way: the sorted Ulysses rows (whose kernel walks
# only visible pairs; five all-to-alls each way) fit the same rate with no fixed cost per collective, within
# 6%. (An earlier fit to unsorted Ulysses, 117 GB/s, had absorbed that kernel's walk over hidden blocks; those
# rows are now predicted 7-9% low.)
_H100_NVLINK = Collective(0.09e-3, 274e9)
_H100_ALL_TO_ALL = Collective(0.0, 274e9)
# ring rows, after the dK/dV trip home at the figure above: 0.09 ms forward, 0.65 ms backward per step as
# first fitted; refitted 2026-11-26 when the kernel lines gained a per-query term from 1K-4K measurements
# (dispatch/costs.py), whose per-call costs now hold the forward's share: nothing left forward, 0.5 ms
# backward (the 15 step-ring rows of 2026-11-25 within 11% fwd+bwd; 0.35 ms put them within 6% but priced the
# step ring at 8K tokens per GPU with 8 KV heads close enough to all_gather that auto kept it, 10% slower)
_H100_RING_STEP = (0.0, 0.5e-3)

# Measured on 2 H200 SXM (NVLink 4 through NVSwitch), jax 0.11.2, 2026-11-26: fitted to
# benchmarks/results/nvidia-h200_x2_2026-11-26_strategies.jsonl (causal zigzag, bf16, 32 heads, 8 and 32 KV
# heads, 8K and 32K tokens per GPU, synced per call) the same way, against
# ringjax/configs/calibration/NVIDIA_H200.json. The H100's figures put every row within 7%, but the ring 4-5%
# low, sorted Ulysses up to 6% high and all_gather up to 5% low, which kept the ring (or all_gather) at 8K
# where Ulysses measured 6-10% faster: all three are refitted. all_gather rows: 0.27 ms + bytes at 379 GB/s
# (the marginal NVLink rate of docs/performance.md). Sorted Ulysses rows: all-to-all at 387 GB/s with no fixed
# cost (a free latency fits below zero, as on H100). The calibrated model prices the ring's shifts by the
# calibration's measured ppermute (chained shifts); the chip-table model by the all_gather figure, as on H100.
# Predicted / measured fwd+bwd ms (ring, all_gather, ulysses): 8K, 8 KV heads 9.41 / 9.36, 8.93 / 8.99,
# 8.83 / 8.47 (+4.2%); 8K, 32: 10.16 / 10.16, 10.00 / 9.93, 9.18 / 9.35; 32K, 8: 126.7 / 131.3 (-3.5%),
# 126.5 / 128.9, 126.7 / 128.4; 32K, 32: 129.7 / 134.2, 130.8 / 133.1, 128.1 / 131.9. auto picks ulysses at
# 8K (the fastest measured; with 8 KV heads predicted 1% ahead of all_gather, a thin margin) and the ring at
# 32K (2% behind ulysses there).
_H200_NVLINK = Collective(0.27e-3, 379e9)
_H200_ALL_TO_ALL = Collective(0.0, 387e9)
# ring rows, after the dK/dV trip home at the calibration's ppermute: 0.14 ms forward, 1.07 ms backward per step
_H200_RING_STEP = (0.14e-3, 1.07e-3)

CHIPS = {
    # TPU v4: 275 TFLOP/s bf16, 1200 GB/s HBM (cloud.google.com/tpu/docs/v4). ICI: 6 links of
    # 50 GB/s per direction (Jouppi et al., "TPU v4: An Optically Reconfigurable Supercomputer
    # for Machine Learning...", ISCA 2023); the scaling book lists 45 GB/s one-way per link.
    "tpu_v4": Chip("TPU v4", "tpu", 275e12, 1200e9, 45e9, vmem_budget=16 << 20, hbm_bytes=32 * 2**30),
    # TPU v5e: 197 TFLOP/s bf16, 819 GB/s HBM, 400 GB/s bidirectional ICI per chip over 4 ports
    # (cloud.google.com/tpu/docs/v5e): 50 GB/s one-way per link.
    # HBM capacities: 32 GiB (v4), 16 GiB (v5e), 95 GiB (v5p), 32 GiB (v6e), from the same pages
    "tpu_v5e": Chip("TPU v5e", "tpu", 197e12, 819e9, 50e9, vmem_budget=16 << 20, hbm_bytes=16 * 2**30),
    # TPU v5p: 459 TFLOP/s bf16, 2765 GB/s HBM, 1200 GB/s bidirectional ICI per chip over 6 ports
    # of a 3D torus (cloud.google.com/tpu/docs/v5p): 100 GB/s one-way per link.
    "tpu_v5p": Chip("TPU v5p", "tpu", 459e12, 2765e9, 100e9, vmem_budget=16 << 20, hbm_bytes=95 * 2**30),
    # TPU v6e (Trillium): 918 TFLOP/s bf16, 1638 GB/s HBM, 800 GB/s bidirectional ICI per chip over
    # 4 ports (cloud.google.com/tpu/docs/v6e): 100 GB/s one-way per link.
    "tpu_v6e": Chip("TPU v6e", "tpu", 918e12, 1638e9, 100e9, vmem_budget=32 << 20, hbm_bytes=32 * 2**30),
    # H100 SXM: 989 TFLOP/s dense bf16 (the datasheet's 1979 is with sparsity), 3.35 TB/s HBM3,
    # NVLink 4 at 900 GB/s bidirectional (NVIDIA H100 datasheet): through NVSwitch a peer gets
    # all 18 links, 450 GB/s one way. 80 GB HBM3.
    "h100": Chip("H100 SXM", "gpu", 989e12, 3350e9, 450e9, hbm_bytes=80e9, collectives=(
        ("ppermute", _H100_NVLINK), ("all_gather", _H100_NVLINK), ("reduce_scatter", _H100_NVLINK),
        ("all_to_all", _H100_ALL_TO_ALL)), ring_step_s=_H100_RING_STEP),
    # H200 SXM: same compute and NVLink as H100, 4.8 TB/s and 141 GB of HBM3e (NVIDIA H200 datasheet).
    "h200": Chip("H200 SXM", "gpu", 989e12, 4800e9, 450e9, hbm_bytes=141e9, collectives=(
        ("ppermute", _H200_NVLINK), ("all_gather", _H200_NVLINK), ("reduce_scatter", _H200_NVLINK),
        ("all_to_all", _H200_ALL_TO_ALL)), ring_step_s=_H200_RING_STEP),
}

_ITEMSIZE = {"bfloat16": 2, "float16": 2}
# fraction of peak a good attention kernel reaches: cuDNN reached 570-600 TFLOP/s of 989 on an
# H200 at 32K tokens (shared/anchors.md, 2026-11-21); nothing is measured on TPU yet
DEFAULT_EFFICIENCY = 0.6


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `plan` predicts; times in seconds, per device and per ring step unless named otherwise."""

    chip: Chip
    ring_size: int
    seq_len: int
    local_seq: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str
    causal: bool
    layout: str
    efficiency: float
    block_q: int
    block_kv: int
    step_flops: float  # forward FLOPs of the slowest device in a (non-first) step
    fwd_compute_s: float
    fwd_transfer_s: float
    bwd_compute_s: float
    bwd_transfer_s: float
    fwd_total_s: float  # whole ring, transfers not hidden counted
    bwd_total_s: float
    min_local_seq_to_hide: int  # smallest shard for which the forward transfer hides
    recommended_layout: str
    notes: tuple[str, ...]

    @property
    def fwd_hidden(self) -> bool:
        return self.fwd_transfer_s <= self.fwd_compute_s

    @property
    def bwd_hidden(self) -> bool:
        return self.bwd_transfer_s <= self.bwd_compute_s

    def __str__(self) -> str:
        ms = lambda s: f"{s * 1e3:.3f} ms"  # noqa: E731
        hide = lambda ok: "hidden" if ok else "NOT hidden"  # noqa: E731
        lines = [
            f"ring attention on {self.ring_size} x {self.chip.name}: seq {self.seq_len} ({self.local_seq} per device), "
            f"batch {self.batch}, heads {self.heads}/{self.kv_heads} kv, head_dim {self.head_dim}"
            + ("" if self.v_head_dim == self.head_dim else f" (v {self.v_head_dim})") + f", {self.dtype}, "
            f"{'causal' if self.causal else 'full'}, layout {self.layout}",
            f"  per step forward:  compute {ms(self.fwd_compute_s)}, K/V transfer {ms(self.fwd_transfer_s)} "
            f"({hide(self.fwd_hidden)})",
            f"  per step backward: compute {ms(self.bwd_compute_s)}, K/V+dK/dV transfer {ms(self.bwd_transfer_s)} "
            f"({hide(self.bwd_hidden)})",
            f"  whole ring: forward {ms(self.fwd_total_s)}, backward {ms(self.bwd_total_s)} "
            f"(at {self.efficiency:.0%} of peak)",
            f"  transfers hide from {self.min_local_seq_to_hide} tokens per device (forward)",
            f"  recommend: layout {self.recommended_layout}, block_q {self.block_q}, block_kv {self.block_kv}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _check_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _step_fraction(causal: bool, layout: str, step: int) -> float:
    """Work of the slowest device in `step`, as a fraction of a full step."""
    if not causal:
        return 1.0
    if layout == "contiguous":
        return 0.5 if step == 0 else 1.0  # the diagonal step, then whole shards for some device
    return 0.5  # zigzag and striped balance every step


def _vmem_bytes(rows: int, block_kv: int, head_dim: int, itemsize: int, v_head_dim: int | None = None) -> int:
    """VMEM of the forward kernel: double-buffered q, k, v and out tiles, f32 state and scores (v_head_dim
    None: head_dim)."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    tiles = 2 * (rows * head_dim * itemsize + block_kv * (head_dim + v_head_dim) * itemsize + rows * v_head_dim * 4)
    state = rows * v_head_dim * 4 + 2 * rows * 128 * 4  # acc, and m, l padded to 128 lanes
    scores = 3 * rows * block_kv * 4  # s, p and a temporary
    return tiles + state + scores


def _divisors(n: int, candidates) -> list[int]:
    return [c for c in candidates if c <= n and n % c == 0]


def _blocks(chip: Chip, local_seq: int, groups: int, head_dim: int, v_head_dim: int, itemsize: int, layout: str):
    """Largest tiles that fit the chip's VMEM budget (TPU) or the usual Hopper tiles (GPU)."""
    unit = local_seq // chunks_per_shard(layout)
    if chip.kind == "gpu":
        bq = max(_divisors(unit, (64, 128)) or [unit])
        return bq, max(_divisors(unit, (64, 128)) or [unit])
    best = None
    # the query tile holds all G heads of a KV head: many heads per KV head need short tiles
    for bq in _divisors(unit, (16, 32, 64, 128, 256, 512, 1024, 2048)) or [unit]:
        for bk in _divisors(unit, (128, 256, 512, 1024, 2048)) or [unit]:
            if _vmem_bytes(groups * bq, bk, head_dim, itemsize, v_head_dim) > chip.vmem_budget:
                continue
            key = (min(groups * bq, 2048) * bk, bq)  # large tiles, then more query rows
            if best is None or key > best[0]:
                best = (key, bq, bk)
    if best is None:
        return min(unit, 128), min(unit, 128)
    return best[1], best[2]


def plan(
    chip: str | Chip,
    *,
    ring_size: int,
    seq_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: str = "bfloat16",
    causal: bool = True,
    layout: str | None = None,
    batch: int = 1,
    efficiency: float = DEFAULT_EFFICIENCY,
    backward_flop_factor: float = 2.5,
    v_head_dim: int | None = None,
) -> Plan:
    """Predict one ring attention call on `ring_size` chips; `layout=None` uses the recommended one;
    `v_head_dim` is v's head_dim (None: head_dim).

    `chip` is a key of CHIPS ("tpu_v4", "tpu_v5e", "tpu_v5p", "tpu_v6e", "h100", "h200") or a Chip.
    """
    if isinstance(chip, str):
        if chip not in CHIPS:
            raise ValueError(f"chip must be one of {sorted(CHIPS)} or a Chip, got {chip!r}")
        chip = CHIPS[chip]
    elif not isinstance(chip, Chip):
        raise TypeError(f"chip must be a str or Chip, got {type(chip).__name__}")
    for name, value in (("ring_size", ring_size), ("seq_len", seq_len), ("heads", heads), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("batch", batch)):
        _check_int(name, value)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    _check_int("v_head_dim", v_head_dim)
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype must be one of {sorted(_ITEMSIZE)} (the model uses bf16 peak rates), got {dtype!r}")
    if dtype == "float16" and chip.kind == "tpu":
        raise ValueError("TPUs have no float16 matmul rate to model; use bfloat16")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_fraction("efficiency", efficiency)
    if not backward_flop_factor > 0:
        raise ValueError(f"backward_flop_factor must be positive, got {backward_flop_factor}")
    recommended = "zigzag" if causal else "contiguous"
    layout = recommended if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} or None, got {layout!r}")
    chunks = sequence_chunks(layout, ring_size)
    if seq_len % chunks:
        raise ValueError(f"seq_len {seq_len} must be divisible by {chunks} for layout {layout!r}")

    t = seq_len // ring_size
    itemsize = _ITEMSIZE[dtype]
    groups = heads // kv_heads
    block_q, block_kv = _blocks(chip, t, groups, head_dim, v_head_dim, itemsize, layout)
    width = head_dim + v_head_dim
    full_step = 2.0 * batch * heads * t * t * width
    rate = chip.peak_flops * efficiency
    kv_bytes = 1.0 * batch * t * kv_heads * width * itemsize
    qo_bytes = batch * t * heads * width * itemsize  # q in, out back

    def compute_s(fraction, factor, reads):
        flops = full_step * fraction * factor
        hbm = (reads * kv_bytes * math.ceil(t / block_q) + qo_bytes) * fraction
        return max(flops / rate, hbm / chip.hbm_bandwidth)

    # the slowest device's step (a non-first step); the first step is cheaper under contiguous causal
    fraction = _step_fraction(causal, layout, 1)
    fwd_compute = compute_s(fraction, 1.0, 1)
    bwd_compute = compute_s(fraction, backward_flop_factor, 2)
    fwd_transfer = _shift_s(chip, kv_bytes)
    bwd_transfer = _shift_s(chip, kv_bytes + kv_bytes * 4 / itemsize)  # K, V and f32 dK, dV

    def ring_total(transfer, factor, reads):
        total = 0.0
        for step in range(ring_size):
            step_compute = compute_s(_step_fraction(causal, layout, step), factor, reads)
            # a transfer runs beside each step but the last; it shows only where it outlasts compute
            total += max(step_compute, transfer) if step + 1 < ring_size else step_compute
        return total

    paid_fwd, paid_bwd = ((ring_size - 1) * paid for paid in chip.ring_step_s)
    fwd_total = ring_total(fwd_transfer, 1.0, 1) + paid_fwd
    # backward ends with one more dK/dV transfer home, with nothing to hide under
    home = _shift_s(chip, kv_bytes * 4 / itemsize) if ring_size > 1 else 0.0
    bwd_total = ring_total(bwd_transfer, backward_flop_factor, 2) + home + paid_bwd

    # forward hides when 2*B*H*t^2*W*f/rate >= B*t*KVH*W*s/link (W = head_dim + v_head_dim),
    # i.e. t >= KVH*s*rate / (2*H*f*link)
    link = chip.collective("ppermute").bytes_per_s if chip.collective("ppermute") else chip.link_bandwidth
    min_t = kv_heads * itemsize * rate / (2.0 * heads * fraction * link)

    notes = []
    if causal and layout == "contiguous":
        notes.append("contiguous causal: the slowest device does a full step every step, about 2x the "
                     "zigzag time; use zigzag or striped")
    if ring_size > 1 and fwd_transfer > fwd_compute:
        notes.append(f"K/V transfer outlasts compute: lengthen the shard to at least {math.ceil(min_t)} tokens, "
                     "or shorten the ring")
    if chip.kind == "gpu" and chip.collective("ppermute") is None:
        notes.append("GPU link figure is NVLink through NVSwitch; jax.lax.ppermute measured far below it "
                     "(52-65 GB/s on 4 H200, shared/anchors.md)")
    return Plan(
        chip=chip, ring_size=ring_size, seq_len=seq_len, local_seq=t, batch=batch, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype, causal=causal, layout=layout,
        efficiency=efficiency, block_q=block_q, block_kv=block_kv, step_flops=full_step * fraction,
        fwd_compute_s=fwd_compute, fwd_transfer_s=fwd_transfer, bwd_compute_s=bwd_compute,
        bwd_transfer_s=bwd_transfer, fwd_total_s=fwd_total, bwd_total_s=bwd_total,
        min_local_seq_to_hide=math.ceil(min_t), recommended_layout=recommended, notes=tuple(notes),
    )


# ---------------------------------------------------------------------------- strategies

# share of HBM that a strategy's own buffers may take before "auto" rules it out: the rest
# holds parameters, optimizer state and activations
DEFAULT_MEMORY_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class StrategyCost:
    """Predicted cost of one context-parallel strategy on one device (seconds, bytes)."""

    strategy: str
    fwd_s: float
    bwd_s: float  # the backward alone
    comm_s: float  # forward + backward collective time not hidden under compute, and the ring's per-step cost
    memory_bytes: float  # buffers beyond the local q, k, v, out and their gradients (backward peak)
    fits: bool  # memory_bytes within memory_fraction of HBM
    note: str = ""  # why it cannot run, or what dominates
    fused: bool = False  # K/V move inside the kernels (a fused ring's pass, or an all-gather by its kernel)

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


def _shift_s(chip: Chip, nbytes: float) -> float:
    """One ring shift of `nbytes`: the chip's measured ppermute, else its link rate."""
    measured = chip.collective("ppermute")
    return measured.seconds(nbytes) if measured is not None else nbytes / chip.link_bandwidth


def _collective_s(chip: Chip, kind: str, bytes_in: float, n: int) -> float:
    """Time for every device to receive `bytes_in` in an "all_gather", "reduce_scatter" or "all_to_all" over
    n devices: the chip's measured figure, else from its link rate."""
    if n == 1 or bytes_in == 0:
        return 0.0
    if chip.collective(kind) is not None:
        return chip.collective(kind).seconds(bytes_in)
    if chip.kind == "gpu":
        return bytes_in / chip.link_bandwidth  # NVSwitch: every peer at the full link rate
    # TPU: the axis is a bidirectional ring of ICI links. A gather streams both ways; in an
    # all-to-all the average message travels n/4 hops, so each of the 2n links carries n/8 of a shard
    if kind != "all_to_all":
        return bytes_in / (2 * chip.link_bandwidth)
    return max(bytes_in / (2 * chip.link_bandwidth), bytes_in * n / (n - 1) * n / (8 * chip.link_bandwidth))


def _flash_s(chip: Chip, rate: float, flops: float, qo_bytes: float, kv_bytes: float, q_tokens: int, block_q: int,
             reads: int, fraction: float) -> float:
    """One flash-attention call: FLOPs at `rate` or HBM traffic (K/V re-read per query tile, q read and out
    written once: `qo_bytes`), whichever is slower."""
    hbm = (reads * kv_bytes * math.ceil(q_tokens / block_q) + qo_bytes) * fraction
    return max(flops / rate, hbm / chip.hbm_bandwidth)


@keywords_of(plan, omit=("ring_size",))
def strategy_costs(
    chip: str | Chip,
    *,
    devices: int,
    layout: str = "contiguous",
    hybrid: tuple[int, int] | None = None,
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
    sort_tokens: bool = True,
    **workload,
) -> tuple[StrategyCost, ...]:
    """Predict ring, all_gather and ulysses over `devices` chips (and hybrid, given (head, ring) sizes).

    The other keywords (seq_len, heads, kv_heads, head_dim, dtype, causal, batch, efficiency,
    backward_flop_factor, v_head_dim) are `plan`'s, with its defaults; `plan` checks them.
    `sort_tokens=False` prices ulysses as it ran before it sorted its tokens (`spread.Strategy.sort_tokens`).

    Per device, t = seq_len / devices tokens, s bytes per element, r = the sustained FLOP rate:
    - ring: `plan` (per-step compute against the K/V transfer it hides, the chip's per-step cost), plus
      the lse merge of each step's float32 output (backward: the dQ accumulation) in HBM;
    - all_gather: gather (devices - 1) K/V shards, then t queries against all keys; backward gathers
      again and reduce-scatters float32 dK/dV. Causal work is the slowest device's: (N - 1/2) / N
      of the keys on the contiguous layout, half on zigzag and striped;
    - ulysses: all-to-all of q, k, v in and out (dout in, dq, dk, dv out backward), each device
      attending its heads / N heads over the whole sequence (causal work always balanced) after sorting
      its tokens where the layout leaves them out of order (`token_sort_s`; unsorted, the kernel walks the
      subshards' hidden pairs: `dispatch.costs.visited_pairs`); K/V heads repeated up to
      lcm(kv_heads, N); needs heads divisible by N;
    - hybrid (h, r): ulysses over h devices, then the ring over r with heads / h heads (tokens sorted
      on the striped layout, where that leaves a striped shard).
    Collectives are not overlapped with compute; they take the chip's measured figures where it has
    them (`Chip.collectives`), else its link rate. Memory counts gathered or all-to-all copies and
    the float32 gradient buffers; a strategy fits if that is within `memory_fraction` of HBM.
    """
    _check_int("devices", devices)
    check_fraction("memory_fraction", memory_fraction)
    if hybrid is not None:
        if (not isinstance(hybrid, tuple) or len(hybrid) != 2 or any(isinstance(x, bool) or not isinstance(x, int)
                                                                    or x < 1 for x in hybrid)
                or hybrid[0] * hybrid[1] != devices):
            raise ValueError(f"hybrid must be (head_devices, ring_devices) with product devices={devices}, "
                             f"got {hybrid!r}")
    ring = plan(chip, ring_size=devices, layout=layout, **workload)  # checks the workload
    chip = ring.chip
    seq_len, heads, kv_heads, head_dim, dtype, causal, batch, efficiency, backward_flop_factor = (
        workload[name] for name in ("seq_len", "heads", "kv_heads", "head_dim", "dtype", "causal", "batch",
                                    "efficiency", "backward_flop_factor"))
    v_head_dim = ring.v_head_dim
    width = head_dim + v_head_dim
    n, t, s = devices, seq_len // devices, _ITEMSIZE[dtype]
    rate = chip.peak_flops * efficiency
    budget = memory_fraction * chip.hbm_bytes if chip.hbm_bytes else math.inf
    q_loc = batch * t * heads * head_dim * s
    o_loc = batch * t * heads * v_head_dim * s  # out, dout
    kv_loc = 1.0 * batch * t * kv_heads * width * s
    half = 0.5 if causal else 1.0
    f32 = 4.0 / s
    costs = []

    # ring: plan's steps, plus merging each later step's float32 partial output (read two, write one)
    merges = (n - 1) * 3 * batch * t * heads * v_head_dim * 4 / chip.hbm_bandwidth
    costs.append(_cost("ring", ring.fwd_total_s + merges, ring.bwd_total_s + merges, _ring_exposed(ring, kv_loc * f32),
                       2 * kv_loc * (1 + f32), budget, ""))

    # all_gather: t queries against the whole sequence; causal balance as the layout gives it
    if not causal:
        frac = 1.0
    elif layout == "contiguous":
        frac = (n - 0.5) / n
    else:
        frac = 0.5
    flops = 2.0 * batch * heads * t * seq_len * width * frac
    compute = _flash_s(chip, rate, flops, q_loc + o_loc, n * kv_loc, t, ring.block_q, 1, frac)
    compute_bwd = _flash_s(chip, rate, flops * backward_flop_factor, q_loc + o_loc, n * kv_loc, t, ring.block_q, 2,
                           frac)
    gather = _collective_s(chip, "all_gather", (n - 1) * kv_loc, n)
    scatter = _collective_s(chip, "reduce_scatter", (n - 1) * kv_loc * f32, n)
    costs.append(_cost("all_gather", gather + compute, gather + compute_bwd + scatter, 2 * gather + scatter,
                       n * kv_loc * (1 + f32), budget, "K/V of the whole sequence on every device"))

    def ulysses(name, h, inner):
        """Costs of an all-to-all over h devices around `inner`: (fwd, bwd, comm, memory) of the attention."""
        if heads % h:
            return StrategyCost(name, math.inf, math.inf, math.inf, math.inf, False,
                                f"heads ({heads}) not divisible by {h} devices")
        kv_rep = kv_loc * math.lcm(kv_heads, h) / kv_heads
        share = (h - 1) / h
        sort = token_sort_s(chip, q_loc + kv_rep + o_loc + batch * heads * t * 4) if sorts(h) else 0.0
        a2a_in = _collective_s(chip, "all_to_all", share * (q_loc + kv_rep), h)
        a2a_out = _collective_s(chip, "all_to_all", share * (o_loc + batch * heads * t * 4), h)
        a2a_dout = _collective_s(chip, "all_to_all", share * o_loc, h)
        a2a_grads = _collective_s(chip, "all_to_all", share * (q_loc + kv_rep), h)
        fwd, bwd, comm, memory = inner(heads // h, math.lcm(kv_heads, h) // h, kv_rep)
        copies = q_loc + 2 * o_loc + kv_rep + (q_loc + kv_rep) * f32  # q, out, dout, k, v; f32 dq, dk, dv
        note = f"K/V heads repeated {math.lcm(kv_heads, h) // kv_heads}x" if kv_heads % h else ""
        return _cost(name, a2a_in + sort + fwd + a2a_out, a2a_dout + sort + bwd + a2a_grads,
                     a2a_in + a2a_out + a2a_dout + a2a_grads + comm, copies + memory, budget, note)

    def sorts(h):
        """Whether an all-to-all over h devices leaves tokens that the strategy moves to sort them."""
        found = sorted_shards(layout, n // h, seq_len * h // n, h) if sort_tokens else None
        return found is not None and found[1] is not None

    def whole_sequence(h_loc, kvh_loc, kv_rep):
        flops = 2.0 * batch * h_loc * seq_len * seq_len * width * half
        qo_bytes = batch * seq_len * h_loc * width * s
        walk_fwd, walk_bwd = (1.0, 1.0) if sort_tokens else _subshard_walk(causal, layout, n, seq_len)
        fwd = _flash_s(chip, rate, flops * walk_fwd, qo_bytes, kv_rep, seq_len, ring.block_q, 1, half)
        bwd = _flash_s(chip, rate, flops * walk_bwd * backward_flop_factor, qo_bytes, kv_rep, seq_len, ring.block_q,
                       2, half)
        return fwd, bwd, 0.0, 0.0

    costs.append(ulysses("ulysses", n, whole_sequence))

    if hybrid is not None:
        h, r = hybrid

        def inner_ring(h_loc, kvh_loc, kv_rep):
            # the head-major split leaves each ring device h blocks spread over the sequence: causal
            # work is close to balanced, as with striped
            p = plan(chip, ring_size=r, seq_len=seq_len, heads=h_loc, kv_heads=kvh_loc, head_dim=head_dim,
                     v_head_dim=v_head_dim, dtype=dtype, causal=causal, layout=layout if h == 1 else "striped",
                     batch=batch, efficiency=efficiency, backward_flop_factor=backward_flop_factor)
            merge = (r - 1) * 3 * batch * seq_len // r * h_loc * v_head_dim * 4 / chip.hbm_bandwidth
            return p.fwd_total_s + merge, p.bwd_total_s + merge, _ring_exposed(p, kv_rep * f32), 2 * kv_rep * (1 + f32)

        costs.append(ulysses("hybrid", h, inner_ring))
    return tuple(costs)


def _ring_exposed(p: Plan, dkv_bytes: float) -> float:
    """Transfer time of a ring that compute does not hide, forward and backward (with dK/dV's trip home), and
    the chip's cost of each step."""
    if p.ring_size == 1:
        return 0.0
    steps = p.ring_size - 1
    return (max(0.0, p.fwd_transfer_s - p.fwd_compute_s) + max(0.0, p.bwd_transfer_s - p.bwd_compute_s)
            + sum(p.chip.ring_step_s)) * steps + _shift_s(p.chip, dkv_bytes)


def token_sort_s(chip: Chip, nbytes: float) -> float:
    """One direction's sort of a device's tokens after a Ulysses all-to-all (`spread.Strategy.placement`):
    forward q, k, v in and out, lse back, backward their cotangents; a gather copy of `nbytes`, each byte read
    and written at HBM bandwidth."""
    return 2 * nbytes / chip.hbm_bandwidth


def _subshard_walk(causal: bool, layout: str, n: int, seq_len: int) -> tuple[float, float]:
    """Pairs a Ulysses kernel over n devices' subshards visits per visible pair (forward, backward):
    `dispatch.costs.visited_pairs`."""
    opts = AttentionOptions(causal=causal, layout=layout, axis_size=1, subshards=n)
    visible = visible_pairs(opts, seq_len)
    rows, cols = visited_pairs(opts, seq_len), visited_pairs(opts, seq_len, True)
    return rows / visible, (rows + cols) / 2 / visible


def _cost(name, fwd, bwd, comm, memory, budget, note, fused: bool = False) -> StrategyCost:
    fits = memory <= budget
    if not fits:
        note = f"needs {memory / 2**30:.1f} GiB, over the memory budget of {budget / 2**30:.1f} GiB"
    return StrategyCost(name, fwd, bwd, comm, memory, fits, note, fused)


# the model cannot tell strategies apart by less than this: the ring (least memory, no
# collective outside the overlap) is kept unless another is predicted faster by more
TIE_TOLERANCE = 0.05


def best_strategy(costs, tolerance: float = TIE_TOLERANCE) -> StrategyCost:
    """The fastest (forward + backward) strategy that fits, the ring unless another is faster by more
    than `tolerance`; the ring if none fits."""
    ring = next(c for c in costs if c.strategy == "ring")
    ok = [c for c in costs if c.fits and math.isfinite(c.total_s)]
    if not ok:
        return ring
    best = min(ok, key=lambda c: c.total_s)
    return ring if ring in ok and ring.total_s <= best.total_s * (1 + tolerance) else best


def chip_for(device_kind: str) -> Chip | None:
    """The CHIPS entry for a jax `device_kind` string (e.g. "NVIDIA H200"), or None if unknown."""
    kind = device_kind.lower()
    for needle, key in (("h100", "h100"), ("h200", "h200"), ("tpu v4", "tpu_v4"), ("tpu v5 lite", "tpu_v5e"),
                        ("tpu v5e", "tpu_v5e"), ("tpu v5p", "tpu_v5p"), ("tpu v5", "tpu_v5p"),
                        ("tpu v6 lite", "tpu_v6e"), ("tpu v6e", "tpu_v6e")):
        if needle in kind:
            return CHIPS[key]
    return None


def strategy_table(costs) -> str:
    """Costs as a fixed-width table (milliseconds, GiB)."""
    lines = [f"{'strategy':<11} {'fwd ms':>9} {'bwd ms':>9} {'total ms':>9} {'comm ms':>8} {'mem GiB':>8}  note"]
    for c in costs:
        if not math.isfinite(c.total_s):
            lines.append(f"{c.strategy:<11} {'-':>9} {'-':>9} {'-':>9} {'-':>8} {'-':>8}  {c.note}")
            continue
        lines.append(f"{c.strategy:<11} {c.fwd_s * 1e3:9.3f} {c.bwd_s * 1e3:9.3f} {c.total_s * 1e3:9.3f} "
                     f"{c.comm_s * 1e3:8.3f} {c.memory_bytes / 2**30:8.2f}  {c.note}")
    return "\n".join(lines)
