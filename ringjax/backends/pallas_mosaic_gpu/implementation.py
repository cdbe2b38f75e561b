"""The Mosaic GPU backend's implementation: jax/device checks, shared memory, configs, the ring."""

from __future__ import annotations

import dataclasses
import functools

from ringjax.backends.pallas_mosaic_gpu import SUPPORT
from ringjax.backends.pallas_mosaic_gpu.config import ROWS, SMEM_LIMIT, MosaicGpuConfig, sinks_apart, supports_fused_bwd
from ringjax.core.masks import may_skip
from ringjax.core.problem import Problem, fused_backward_note
from ringjax.core.ring import BlockKernel, ring_attention_shard, ring_sources
from ringjax.core.schedule import ring_plan
from ringjax.core.tiles import block_stride

# epilogue chunks (kernels._write_rows) are 32 columns: split in halves, a head_dim must be a multiple of 64
_SPLIT_MULTIPLE = 64

_MIN_JAX = (0, 11)
# what the kernels call; a jax without one of them cannot build them
_PLGPU_API = ("kernel", "SMEM", "Barrier", "ACC", "wgmma", "copy_gmem_to_smem", "copy_smem_to_gmem",
              "wait_smem_to_gmem", "barrier_wait", "barrier_arrive", "commit_smem", "layout_cast", "Layout",
              "broadcasted_iota", "set_max_registers", "load", "TilingTransform", "SwizzleTransform",
              "CompilerParams", "LoweringSemantics")


def _fwd(q, k, v, q_info, k_info, extras, opts, config, **out):
    from ringjax.backends.pallas_mosaic_gpu.kernels import block_fwd

    return block_fwd(q, k, v, q_info, k_info, extras, opts, config, **out)


def _bwd(q, k, v, dout, lse, delta, q_info, k_info, extras, opts, config, **out):
    from ringjax.backends.pallas_mosaic_gpu.kernels import block_bwd

    return block_bwd(q, k, v, dout, lse, delta, q_info, k_info, extras, opts, config, **out)


def _ring_fwd(q, k, v, q_seg, kv_seg, extras, opts, config, signal: bool = True, **out):
    from ringjax.backends.pallas_mosaic_gpu.kernels import fused_ring_fwd

    step_opts, q_info, k_infos, local = ring_sources(opts, q, q_seg, kv_seg)
    return fused_ring_fwd(q, k, v, q_info, k_infos, opts.axis_name, opts.axis_size, local, extras, step_opts,
                          config, signal=signal, **out)


def _ring_bwd(q, k, v, dout, lse, delta, q_seg, kv_seg, extras, opts, config, signal: bool = True, **out):
    from ringjax.backends.pallas_mosaic_gpu.kernels import fused_ring_bwd

    step_opts, q_info, k_infos, local = ring_sources(opts, q, q_seg, kv_seg)
    return fused_ring_bwd(q, k, v, dout, lse, delta, q_info, k_infos, opts.axis_name, opts.axis_size, local, extras,
                          step_opts, config, signal=signal, **out)


# rows independent: 64-row tiles of the rows, blocks of the streamed side sized by its length alone (`kernels._fit`);
# deterministic runs the split backward, whose dQ and dK/dV kernels sum nothing across rows. But for the sink
# tokens a window hides (`sinks_apart`): their dK/dV are one dense product over every query in the call
KERNEL = BlockKernel(name="pallas_mosaic_gpu", fwd=_fwd, bwd=_bwd, skips_empty_steps=True, final_dtype=True,
                     rows_independent=lambda opts, config: not sinks_apart(opts))
# `MosaicGpuConfig(fused=True)`: the forward ring, and the backward's dK/dV, as one kernel each that copies K/V
# (and the dK/dV partials) between devices itself. Above head_dim 128 the backward is the ring of step kernels
FUSED_KERNEL = dataclasses.replace(KERNEL, name="pallas_mosaic_gpu_fused", ring_fwd=_ring_fwd, ring_bwd=_ring_bwd)
FUSED_FWD_KERNEL = dataclasses.replace(KERNEL, name="pallas_mosaic_gpu_fused_fwd", ring_fwd=_ring_fwd)


@functools.cache
def _jax_refusal() -> str | None:
    import jax

    version = tuple(int(p) for p in jax.__version__.split(".")[:2])
    if version < _MIN_JAX:
        return f"needs jax >= {'.'.join(map(str, _MIN_JAX))} for its Pallas Mosaic GPU API, found {jax.__version__}"
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as e:
        return f"jax.experimental.pallas.mosaic_gpu cannot be imported: {e}"
    missing = [name for name in _PLGPU_API if not hasattr(plgpu, name)]
    if missing:
        return f"this jax's Pallas Mosaic GPU lacks {', '.join(missing)}"
    return None


@functools.cache
def _device_refusal(platform: str) -> str | None:
    import jax

    try:
        device = jax.devices(platform)[0]
    except RuntimeError as e:
        return f"no {platform} device visible ({e})"
    return device_refusal(device)


def device_refusal(device) -> str | None:
    """Why the Mosaic GPU kernels cannot run on `device` (a jax Device), or None."""
    cc = getattr(device, "compute_capability", None)
    if cc is None:
        return f"{device.device_kind} is not a CUDA GPU (Mosaic GPU needs NVIDIA sm90 or newer)"
    major = int(str(cc).split(".")[0])
    if major < 9:
        return f"{device.device_kind} has compute capability {cc}: Mosaic GPU kernels need 9.0 (Hopper) or newer"
    return None


@functools.cache
def interpreter_refusal() -> str | None:
    """Why `MosaicGpuConfig(interpret=True)` cannot run here (jax's GPU interpreter), or None."""
    why = _jax_refusal()
    if why:
        return why
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not hasattr(plgpu, "InterpretGPUParams"):
        import jax

        return f"jax {jax.__version__} has no Pallas Mosaic GPU interpreter (InterpretGPUParams)"
    return None


def _refusal(problem: Problem, config: MosaicGpuConfig | None = None) -> str | None:
    opts = problem.opts
    why = SUPPORT.refusal("pallas_mosaic_gpu", problem)
    if why:
        return why
    if opts.num_sink_tokens and opts.has_segments and opts.chunk_size is not None:
        # the kernels read a key's offset in its document only as "one of the first s" (kernels._segment_tables)
        return ("sink tokens of packed documents with per-document chunks (`num_sink_tokens`, `segment_ids` and "
                "`chunk_size` together) is not implemented in pallas_mosaic_gpu: the chunks need every token's "
                "offset in its document")
    config = config or default_config(problem)
    # a block's positions are start + step * i: every 64-token block of the layout must be evenly spaced
    if block_stride(opts, problem.seq, ROWS) is None:
        return (f"layout {opts.layout!r} with {opts.subshards} subshard(s) of {problem.seq} tokens has 64-token "
                f"blocks whose positions are not evenly spaced")
    # the two consumers of a forward or dQ block take two heads of one group, else two row tiles
    if problem.seq % (2 * ROWS) and (problem.gqa_ratio % 2 or not config.pair_heads):
        return (f"the per-device sequence {problem.seq} must be a multiple of {2 * ROWS} when the two consumers "
                f"of a block take two row tiles (query heads per KV head: {problem.gqa_ratio})")
    d, dv = problem.head_dims
    if max(d, dv) > 128 and (d % _SPLIT_MULTIPLE or dv % _SPLIT_MULTIPLE):
        return (f"head_dim {d} with v head_dim {dv}: above 128 the backward splits both in halves, which must be "
                f"multiples of 32 (head_dims multiples of {_SPLIT_MULTIPLE})")
    for kernel, size in config.smem_bytes(d, problem.itemsize, opts.has_segments, dv, opts.has_alibi).items():
        if size > SMEM_LIMIT - 1024:
            return (f"config {config} needs {size} bytes of shared memory in its {kernel} kernel, over the "
                    f"{SMEM_LIMIT} a Hopper block may use")
    if config.fused:
        why = _fused_refusal(problem.as_ring())
        if why:
            return why
    return _jax_refusal() or _device_refusal(problem.platform)


def _fused_refusal(problem: Problem, host: tuple[int, int] | None = None) -> str | None:
    """Why the fused ring (`MosaicGpuConfig(fused=True)`) cannot run this call, or None. `host`: (devices,
    processes) of a machine this one describes (`explain`), whose jax is assumed to have the API; None: here."""
    import jax

    opts = problem.opts
    if opts.axis_name is None or opts.axis_size == 1:
        return None  # no ring: the plain step runs
    if ring_plan(opts, problem.seq).sink_step:
        return "fused=True: sink tokens beyond a window-shortened ring take a step of their own; use fused=False"
    if host is None:
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu

        if not (hasattr(plgpu, "remote_ref") and hasattr(pl, "get_global")):
            return f"fused=True needs Pallas Mosaic GPU's remote_ref and pl.get_global, absent in jax {jax.__version__}"
    # Mosaic GPU addresses peers over all devices: one ring axis over every device
    devices, processes = host or (jax.device_count(), jax.process_count())
    if opts.axis_size != devices:
        return (f"fused=True needs the ring axis to span every device: axis {opts.axis_name!r} has "
                f"{opts.axis_size} of {devices}")
    if processes > 1:
        # measured: with one process per GPU the kernels' first peer access failed in NCCL
        # (ncclGetPeerDevicePointer, 2 H100, jax 0.11.2, 2026-11-26)
        return (f"fused=True runs with one process for all GPUs; {processes} processes here (one per GPU, NCCL "
                f"could not map a peer GPU's memory for the kernels): use fused=False")
    return None


# the most of a GPU's memory the fused ring's receive slots may take before the heuristic keeps the step ring:
# the model's weights and activations need the rest
FUSED_MEMORY_FRACTION = 0.125


def fused_ring_bytes(problem: Problem) -> int:
    """Memory the fused ring holds beyond the step ring's at its peak, the backward: the other sources' K/V and
    their float32 dK/dV partials (receive slots of every source but this device's own)."""
    others = ring_plan(problem.opts, problem.seq).num_steps - 1
    row = problem.batch * problem.seq * problem.kv_heads * (problem.head_dim + problem.v_head_dim)
    return others * row * (problem.itemsize + 4)


@functools.cache
def _gpu_memory_bytes() -> int | None:
    """What XLA may allocate on this host's first GPU (its `bytes_limit`), or None where it does not say."""
    import jax

    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # CPU devices and some plugins have no allocator statistics
        return None
    return stats.get("bytes_limit")


def fuses_ring(problem: Problem) -> bool:
    """Whether the heuristic config runs the fused ring: there is a ring, `_fused_refusal` finds nothing, and
    its receive slots fit `FUSED_MEMORY_FRACTION` of the GPU's memory. Measured faster than the step ring in
    every case on 2 and 4 GPUs (docs/pallas_mosaic_gpu.md). The all-gather strategy runs it too
    (`Problem.as_ring`: its copies are the gather, its partials' trip home the reduce-scatter), whatever its
    slots take: the gather holds as much, and the collectives around one kernel call cost its forward 14% at 8K
    tokens per GPU (docs/strategies.md)."""
    opts = problem.opts
    if opts.axis_name is None or opts.axis_size == 1 or problem.platform != "gpu":  # no ring
        return False
    from ringjax.dispatch import registry

    # a GPU this host lacks (`explain --device-kind`): judged for one process holding all of the ring's GPUs, the
    # single-host case, its jax and GPUs assumed to run the kernels as `registry.refusal` assumes
    if registry.described(problem):
        host, memory = (opts.axis_size, 1), _described_memory_bytes(problem.device_kind)
    else:
        if _jax_refusal() or _device_refusal(problem.platform):
            return False
        host, memory = None, _gpu_memory_bytes()
    if _fused_refusal(problem.as_ring(), host) is not None:
        return False
    if opts.gather_kv:
        return True
    return memory is not None and fused_ring_bytes(problem) <= FUSED_MEMORY_FRACTION * memory


# the share of a GPU's memory XLA allocates by default (XLA_PYTHON_CLIENT_MEM_FRACTION)
_XLA_MEMORY_FRACTION = 0.75


def _described_memory_bytes(device_kind: str) -> float | None:
    """What XLA would allocate on a GPU of `device_kind` this host does not have, from its calibration's HBM;
    None (so the step ring) where no calibration says."""
    from ringjax.dispatch import costs

    calibration = costs.load(device_kind)
    hbm = calibration.hbm_bytes if calibration else 0.0
    return _XLA_MEMORY_FRACTION * hbm if hbm else None


def default_config(problem: Problem) -> MosaicGpuConfig:
    widest = max(problem.head_dims)
    if widest <= 64:
        # the fused backward (dQ by TMA reduce-add; the op's deterministic=True runs it split): fwd+bwd 5-6%
        # faster than the two kernels at 32K, 2% at 8K (1 H100, causal, 32/8 heads: checks/..._head_dim_64_ab).
        # Forward, against cuDNN (1 H200, jax 0.11.2, 2026-11-29, checks/..._forward_head_dims): 3 stages of 128
        # keys 0.92-1.04, 2 stages 0.96-1.03; 256 keys where no block is skipped 1.00-1.01 (8K causal: 0.995)
        keys = 128 if may_skip(problem.opts) else 256
        config = MosaicGpuConfig(block_kv=keys, num_stages=2, dq_block_kv=128, dkv_num_stages=2,
                                 bwd_fused=not problem.opts.has_alibi)  # ALiBi's: see `_fuses_backward`
    elif widest > 128:  # 64-row streamed blocks, two stages: what fits 227 KiB of shared memory
        # a CTA per row tile where every block is visited: 8K not causal 2.5-4% faster forward, the rest within
        # 1% (1 H200, 2026-11-29, checks/..._forward_head_dims)
        config = MosaicGpuConfig(block_kv=64, num_stages=2, dq_block_kv=64, dq_num_stages=2, dkv_num_stages=2,
                                 persistent=may_skip(problem.opts))
    else:
        config = MosaicGpuConfig()
        # dQ first under a causal mask since its write became one commit a visit: 32K causal backward 528.8
        # against 520.1 TFLOP/s, 8K within 1% (1 H100, jax 0.11.2, 2026-12-06, checks/..._step_causal_dq_order).
        # Not causal, after dV: the tuner's pick at 8K and 32K (6.81 / 6.98 and 107.5 / 108.6 ms fwd+bwd over 3
        # interleaved rounds), backward alone at 32K 560.5-562.6 against 549.1-553.3 TFLOP/s in three pairs of
        # runs (1 H100, jax 0.11.2, 2026-12-06, checks/..._step_tuned_h100_{shipped,heuristic}*)
        fused_bwd = dataclasses.replace(config, dkv_num_stages=2, bwd_fused=True, bwd_dq_first=problem.opts.causal)
        if _fuses_backward(problem) and fused_bwd.split_bwd_reason(problem.opts, *problem.head_dims,
                                                                   problem.itemsize) is None:
            config = fused_bwd
    if problem.opts.causal and _skips_causal_only(problem.opts):
        if problem.seq <= TILE_MAJOR_SEQ and widest <= 128:
            config = dataclasses.replace(config, bwd_tile_major=True)
        # longer ones walk the dK/dV kernel's query blocks last first (`MosaicGpuConfig.bwd_reverse`), so that
        # the CTAs running at once share their Q/dO blocks in L2. Reversed over forward, fwd+bwd, causal, 32 q /
        # 8 kv heads (1 H200, jax 0.11.2, 2026-12-03, checks/nvidia-h200_2026-12-03_step_bwd_reverse): head_dim
        # 128 32K 1.007-1.009x in 3 of 3 rounds (0.974 -> 0.983 of cuDNN), 16K and 8K within 0.3%; 256 32K
        # 1.004-1.005x, 16K 1.006-1.008x; 64 0.98x at both, so not there
        elif problem.seq > TILE_MAJOR_SEQ and widest > 64:
            config = dataclasses.replace(config, bwd_reverse=True)
    return dataclasses.replace(config, fused=True) if fuses_ring(problem) else config


# causal shards up to this long start the backward's CTAs longest first (`MosaicGpuConfig.bwd_tile_major`): head by
# head, the last head's heaviest tiles start last. Tile-major over head-major fwd+bwd at 8K causal (1 H200, jax
# 0.11.2, 2026-12-02, checks/nvidia-h200_2026-12-02_step_tile_major): head_dim 64 1.11x, 128 1.05-1.07x (4K
# 1.20-1.24x; 16K 0.99x), 256 0.99x
TILE_MAJOR_SEQ = 8192

# shorter head_dim-128 shards without a mask keep the split backward: the fused one has a CTA per KV head and
# 128-key tile, 64 at 1K with 8 KV heads for 132 SMs, where the split dQ kernel spreads over the query heads.
# fwd+bwd ms at 1K not causal, 5 calls back to back, with cuDNN in the same process as the control (1 H200, jax
# 0.11.2): split 0.245 (2026-11-29, cuDNN 0.214-0.225), fused 0.297 (2026-12-02, cuDNN 0.219); at 2K fused 0.523
# against split 0.558, cuDNN 0.590 both days (checks/nvidia-h200_2026-11-29_step_short_back_to_back,
# results/nvidia-h200_2026-11-29_step, checks/nvidia-h200_2026-12-02_step_1k_to_32k)
FUSED_MIN_SEQ = 2048


def _fuses_backward(problem: Problem) -> bool:
    """Whether a head_dim-128 call's heuristic backward is the fused one: where its mask skips no block but the
    causal ones and no sink tokens are visited, unless it is a causal shard shorter than `TILE_MAJOR_SEQ`, where the
    split kernels in tile-major order were as fast, or shorter than `FUSED_MIN_SEQ`. At 8K causal, since the
    fused dQ write is one commit a visit, fused over split backward 460.4 / 445.7 TFLOP/s (1 H100, jax 0.11.2,
    2026-12-06, checks/..._step_causal_dq_order). Before it, fwd+bwd ms split / fused (1 H200, jax 0.11.2, 2026-12-02,
    checks/nvidia-h200_2026-12-02_step_tile_major and _step_fused_not_causal): causal 4K 1.03-1.07 / 1.06-1.08,
    8K 3.95-4.03 / 3.99-4.00, 16K (head by head) 15.65-15.69 / 14.95-14.97; not causal (dQ first) 4K 1.82-1.96 /
    1.83-1.84, 16K 30.8-30.9 / 28.4-28.5. Dropout's hash and the soft cap's tanh fuse at every length: the split
    backward computes P twice, once per kernel (fused over split fwd+bwd at 8K / 32K causal: dropout 1.05 / 1.12,
    soft cap 1.01 / 1.08; checks/nvidia-h200_2026-12-01_coverage_*_fused_bwd). Masks that skip blocks ran the fused
    backward at 0.68-0.95 of the split one there."""
    opts = problem.opts
    # ALiBi's fused backward (its slope gradient summed per key) is exact on the GPU but slower: backward alone
    # 286 / 349 TFLOP/s against the split kernels' 410 / 440 at 8K / 32K causal (1 H100, jax 0.11.2, 2026-12-06,
    # checks/..._coverage_alibi_fused_bwd); under ncu its consumers spill 3x as much as plain's (the queries'
    # offsets and the slope sums beside 240 registers). Summed by the tensor cores instead (a [64, 16] wgmma of dS^T
    # a visit, as two 16-bit parts) it was slower still, 255 / 269, and was removed (same GPU and day,
    # checks/..._coverage_alibi_fused_bwd_tensor_core_sums). The heuristic keeps the split kernels
    if problem.head_dims != (128, 128) or not _skips_causal_only(opts) or opts.has_alibi:
        return False
    heavy = opts.dropout_rate > 0 or opts.logits_soft_cap is not None
    return heavy or (problem.seq >= FUSED_MIN_SEQ and (not opts.causal or problem.seq >= TILE_MAJOR_SEQ))


def _skips_causal_only(opts) -> bool:
    """Whether no block pair but causal ones can be empty, and no sink tokens are visited (their rows' work is
    the causal triangle's)."""
    return not may_skip(dataclasses.replace(opts, causal=False)) and not opts.num_sink_tokens


@dataclasses.dataclass(frozen=True)
class PallasMosaicGpuImplementation:
    name: str = "pallas_mosaic_gpu"
    config_type: type = MosaicGpuConfig

    def supports(self, problem: Problem) -> str | None:
        return _refusal(problem)

    def default_config(self, problem: Problem) -> MosaicGpuConfig:
        return default_config(problem)

    def priced_as(self, problem: Problem) -> tuple[Problem, int | None]:
        """The all-gather strategy's call where the heuristic runs it by the fused ring's kernel: that ring, one
        launch (priced as the step gather, `auto` ran Triton there at 32K tokens per GPU: 1.33x slower, 2 H100,
        2026-11-28)."""
        if problem.opts.gather_kv and fuses_ring(problem):
            return problem.as_ring(), 1
        return problem, None

    def candidate_configs(self, problem: Problem) -> list[MosaicGpuConfig]:
        """The heuristic's config first, so that tuning never keeps a slower one, then its neighbours: one field
        (or the pair that goes together) changed at a time, among the choices measured to matter
        (docs/performance.md), where it fits shared memory and runs. 7-11 at head_dim 128 where the grid of every
        block size and order was 23-28, each a forward and backward to compile: a shape tunes in minutes, not
        quarter hours, on the GPU machine. On a ring that fuses (`fuses_ring`) every candidate keeps its kernels."""
        base, opts = default_config(problem), problem.opts
        out = [base]

        def add(cfg: MosaicGpuConfig) -> MosaicGpuConfig:
            sizes = cfg.smem_bytes(problem.head_dim, problem.itemsize, opts.has_segments, problem.v_head_dim,
                                   opts.has_alibi).values()
            if (max(sizes) <= SMEM_LIMIT - 1024 and (cfg.pair_heads or problem.seq % (2 * ROWS) == 0)
                    and cfg not in out):
                out.append(cfg)
            return cfg

        # the forward's blocks: 128 keys in 2 stages led at head_dim 128 (64 in 3 or 4 stages lost 10-15%, 1 H200;
        # 64 in 2, 0.86-1.00x on sparse masks), 64 are all that fit above it, 256 led at 64 without a mask
        for block_kv, stages in ((128, 2), (64, 3), (256, 2)):
            add(dataclasses.replace(base, block_kv=block_kv, num_stages=stages))
        add(dataclasses.replace(base, pair_heads=not base.pair_heads))
        # the backward: split kernels (their stages and dQ blocks) or fused (both orders of its dQ product)
        split = dataclasses.replace(base, bwd_fused=False, bwd_dq_first=False)
        for dq_kv, dkv_stages in ((64, 3), (128, 3), (64, 2)):
            add(dataclasses.replace(split, dq_block_kv=dq_kv, dkv_num_stages=dkv_stages))
        fused = dataclasses.replace(base, bwd_fused=True, dq_block_kv=64, dkv_num_stages=2)
        fused_runs = fused.split_bwd_reason(opts, problem.head_dim, problem.v_head_dim, problem.itemsize) is None
        # causal ALiBi's fused backward ran at 0.6-0.8x the split kernels' in both forms measured (`_fuses_backward`):
        # the tuner spends no compile on it; an explicit config still runs it
        fused_runs = fused_runs and not (opts.has_alibi and opts.causal)
        if fused_runs:
            for dq_first in (False, True):
                add(dataclasses.replace(fused, bwd_dq_first=dq_first))
        # a causal mask gives the first row tiles the most work: the backward's CTAs in both orders (head by head,
        # or longest first: `bwd_tile_major`) and the dK/dV walk both ways (`bwd_reverse`), for the heuristic's
        # backward and the other one
        if opts.causal:
            other = [c for c in out[1:] if c.bwd_fused != base.bwd_fused][:1]
            for cfg in [base, *other]:
                add(dataclasses.replace(cfg, bwd_tile_major=not cfg.bwd_tile_major))
                add(dataclasses.replace(cfg, bwd_reverse=not cfg.bwd_reverse))
        return out

    def config_note(self, problem: Problem, config: MosaicGpuConfig) -> str:
        """Which backward runs where `config` asks for the fused one (it falls back to the dQ and dK/dV kernels
        where it cannot run: `MosaicGpuConfig.split_bwd_reason`); "" where it does not ask."""
        if not config.bwd_fused:
            return ""
        if _fused_ring_backward(problem, config):
            return "bwd_fused: the fused ring's backward runs its own dQ and dK/dV kernels"
        why = config.split_bwd_reason(problem.opts, problem.head_dim, problem.v_head_dim, problem.itemsize)
        return fused_backward_note("dQ added by TMA reduce-add", why)

    def run(self, problem: Problem, config: MosaicGpuConfig, q, k, v, q_seg, kv_seg, sinks, extras):
        why = _refusal(problem, config)
        if why is not None:  # an explicit config= can ask for more than supports() checked
            raise ValueError(f"pallas_mosaic_gpu cannot run this call: {why}")
        kernel, opts = KERNEL, problem.opts
        if config.fused and opts.axis_name is not None and opts.axis_size > 1:  # else no ring
            kernel = FUSED_KERNEL if _fused_ring_backward(problem, config) else FUSED_FWD_KERNEL
            opts = problem.as_ring().opts  # the all-gather strategy: the gather inside the kernel
        return ring_attention_shard(opts, kernel, config, q, k, v, q_seg, kv_seg, sinks, extras)


def _fused_ring_backward(problem: Problem, config: MosaicGpuConfig) -> bool:
    """Whether the backward is the fused ring's (else each step's `block_bwd`)."""
    opts = problem.opts
    return (config.fused and opts.axis_name is not None and opts.axis_size > 1
            and supports_fused_bwd(*problem.head_dims))


IMPLEMENTATION = PallasMosaicGpuImplementation()


__all__ = ["FUSED_FWD_KERNEL", "FUSED_KERNEL", "IMPLEMENTATION", "KERNEL", "MosaicGpuConfig"]
