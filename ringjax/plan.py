"""A cost model for ring attention: per-step compute against per-step K/V transfer, per chip.

`plan(chip, ...)` predicts, for one ring step, the attention compute time on one
device and the time to send its K/V shard to the ring neighbour, says whether the
transfer hides under the compute, and recommends a layout and block sizes. It is
napkin math from published peak figures (sources beside each chip), scaled by an
assumed kernel efficiency; it is not a measurement.

Model (per device, local shard t = seq_len / ring_size, G = heads / kv_heads):
- a full step is 4 * batch * heads * t^2 * head_dim FLOPs forward (QK^T and PV);
  backward costs `backward_flop_factor` times that (2.5 for FlashAttention-2's five
  matmuls; ringjax's TPU kernels recompute QK^T in their dK/dV and dQ kernels: 3.5);
- causal work per step: zigzag and striped give every device half a step at every
  step; contiguous leaves some devices idle but the slowest one does a full step at
  every step but the first, so the ring takes as long as without the mask;
- compute time is max(FLOPs / (peak * efficiency), HBM bytes / HBM bandwidth), where
  a flash kernel re-reads K/V once per query tile of block_q rows;
- a step sends K and V (2 * batch * t * kv_heads * head_dim * itemsize bytes) over one
  link in one direction; backward also sends dK and dV, which ringjax accumulates in
  float32.
"""

from __future__ import annotations

import dataclasses
import math

from ringjax.options import LAYOUTS, sequence_chunks, shards_per_device


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published per-chip figures: dense bf16 FLOP/s, HBM bytes/s, one-way bytes/s to one ring neighbour."""

    name: str
    kind: str  # "tpu" or "gpu"
    peak_flops: float
    hbm_bandwidth: float
    link_bandwidth: float
    vmem_budget: int | None = None  # bytes of VMEM a kernel may use by default (TPU)


CHIPS = {
    # TPU v4: 275 TFLOP/s bf16, 1200 GB/s HBM (cloud.google.com/tpu/docs/v4). ICI: 6 links of
    # 50 GB/s per direction (Jouppi et al., "TPU v4: An Optically Reconfigurable Supercomputer
    # for Machine Learning...", ISCA 2023); the scaling book lists 45 GB/s one-way per link.
    "tpu_v4": Chip("TPU v4", "tpu", 275e12, 1200e9, 45e9, vmem_budget=16 << 20),
    # TPU v5e: 197 TFLOP/s bf16, 819 GB/s HBM, 400 GB/s bidirectional ICI per chip over 4 ports
    # (cloud.google.com/tpu/docs/v5e): 50 GB/s one-way per link.
    "tpu_v5e": Chip("TPU v5e", "tpu", 197e12, 819e9, 50e9, vmem_budget=16 << 20),
    # TPU v5p: 459 TFLOP/s bf16, 2765 GB/s HBM, 1200 GB/s bidirectional ICI per chip over 6 ports
    # of a 3D torus (cloud.google.com/tpu/docs/v5p): 100 GB/s one-way per link.
    "tpu_v5p": Chip("TPU v5p", "tpu", 459e12, 2765e9, 100e9, vmem_budget=16 << 20),
    # TPU v6e (Trillium): 918 TFLOP/s bf16, 1638 GB/s HBM, 800 GB/s bidirectional ICI per chip over
    # 4 ports (cloud.google.com/tpu/docs/v6e): 100 GB/s one-way per link.
    "tpu_v6e": Chip("TPU v6e", "tpu", 918e12, 1638e9, 100e9, vmem_budget=32 << 20),
    # H100 SXM: 989 TFLOP/s dense bf16 (the datasheet's 1979 is with sparsity), 3.35 TB/s HBM3,
    # NVLink 4 at 900 GB/s bidirectional (NVIDIA H100 datasheet): through NVSwitch a peer gets
    # all 18 links, 450 GB/s one way.
    "h100": Chip("H100 SXM", "gpu", 989e12, 3350e9, 450e9),
    # H200 SXM: same compute and NVLink as H100, 4.8 TB/s HBM3e (NVIDIA H200 datasheet).
    "h200": Chip("H200 SXM", "gpu", 989e12, 4800e9, 450e9),
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
            f"batch {self.batch}, heads {self.heads}/{self.kv_heads} kv, head_dim {self.head_dim}, {self.dtype}, "
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


def _vmem_bytes(rows: int, block_kv: int, head_dim: int, itemsize: int) -> int:
    """VMEM of the forward kernel: double-buffered q, k, v and out tiles, f32 state and scores."""
    tiles = 2 * (rows * head_dim * itemsize + 2 * block_kv * head_dim * itemsize + rows * head_dim * 4)
    state = rows * head_dim * 4 + 2 * rows * 128 * 4  # acc, and m, l padded to 128 lanes
    scores = 3 * rows * block_kv * 4  # s, p and a temporary
    return tiles + state + scores


def _divisors(n: int, candidates) -> list[int]:
    return [c for c in candidates if c <= n and n % c == 0]


def _blocks(chip: Chip, local_seq: int, groups: int, head_dim: int, itemsize: int, layout: str):
    """Largest tiles that fit the chip's VMEM budget (TPU) or the usual Hopper tiles (GPU)."""
    unit = local_seq // shards_per_device(layout)
    if chip.kind == "gpu":
        bq = max(_divisors(unit, (64, 128)) or [unit])
        return bq, max(_divisors(unit, (64, 128)) or [unit])
    best = None
    # the query tile holds all G heads of a KV head: many heads per KV head need short tiles
    for bq in _divisors(unit, (16, 32, 64, 128, 256, 512, 1024, 2048)) or [unit]:
        for bk in _divisors(unit, (128, 256, 512, 1024, 2048)) or [unit]:
            if _vmem_bytes(groups * bq, bk, head_dim, itemsize) > chip.vmem_budget:
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
) -> Plan:
    """Predict one ring attention call on `ring_size` chips; `layout=None` uses the recommended one.

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
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype must be one of {sorted(_ITEMSIZE)} (the model uses bf16 peak rates), got {dtype!r}")
    if dtype == "float16" and chip.kind == "tpu":
        raise ValueError("TPUs have no float16 matmul rate to model; use bfloat16")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not (0 < efficiency <= 1):
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
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
    block_q, block_kv = _blocks(chip, t, groups, head_dim, itemsize, layout)
    full_step = 4.0 * batch * heads * t * t * head_dim
    rate = chip.peak_flops * efficiency
    kv_bytes = 2.0 * batch * t * kv_heads * head_dim * itemsize
    q_bytes = batch * t * heads * head_dim * itemsize

    def compute_s(fraction, factor, reads):
        flops = full_step * fraction * factor
        hbm = (reads * kv_bytes * math.ceil(t / block_q) + 2 * q_bytes) * fraction
        return max(flops / rate, hbm / chip.hbm_bandwidth)

    # the slowest device's step (a non-first step); the first step is cheaper under contiguous causal
    fraction = _step_fraction(causal, layout, 1)
    fwd_compute = compute_s(fraction, 1.0, 1)
    bwd_compute = compute_s(fraction, backward_flop_factor, 2)
    fwd_transfer = kv_bytes / chip.link_bandwidth
    bwd_transfer = (kv_bytes + kv_bytes * 4 / itemsize) / chip.link_bandwidth  # K, V and f32 dK, dV

    def ring_total(transfer, factor, reads):
        total = 0.0
        for step in range(ring_size):
            step_compute = compute_s(_step_fraction(causal, layout, step), factor, reads)
            # a transfer runs beside each step but the last; it shows only where it outlasts compute
            total += max(step_compute, transfer) if step + 1 < ring_size else step_compute
        return total

    fwd_total = ring_total(fwd_transfer, 1.0, 1)
    # backward ends with one more dK/dV transfer home, with nothing to hide under
    home = kv_bytes * 4 / itemsize / chip.link_bandwidth if ring_size > 1 else 0.0
    bwd_total = ring_total(bwd_transfer, backward_flop_factor, 2) + home

    # forward hides when 4*B*H*t^2*D*f/rate >= 2*B*t*KVH*D*s/link, i.e. t >= KVH*s*rate / (2*H*f*link)
    min_t = kv_heads * itemsize * rate / (2.0 * heads * fraction * chip.link_bandwidth)

    notes = []
    if causal and layout == "contiguous":
        notes.append("contiguous causal: the slowest device does a full step every step, about 2x the "
                     "zigzag time; use zigzag or striped")
    if ring_size > 1 and fwd_transfer > fwd_compute:
        notes.append(f"K/V transfer outlasts compute: lengthen the shard to at least {math.ceil(min_t)} tokens, "
                     "or shorten the ring")
    if chip.kind == "gpu":
        notes.append("GPU link figure is NVLink through NVSwitch; jax.lax.ppermute measured far below it "
                     "(52-65 GB/s on 4 H200, shared/anchors.md)")
    return Plan(
        chip=chip, ring_size=ring_size, seq_len=seq_len, local_seq=t, batch=batch, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, causal=causal, layout=layout,
        efficiency=efficiency, block_q=block_q, block_kv=block_kv, step_flops=full_step * fraction,
        fwd_compute_s=fwd_compute, fwd_transfer_s=fwd_transfer, bwd_compute_s=bwd_compute,
        bwd_transfer_s=bwd_transfer, fwd_total_s=fwd_total, bwd_total_s=bwd_total,
        min_local_seq_to_hide=math.ceil(min_t), recommended_layout=recommended, notes=tuple(notes),
    )
