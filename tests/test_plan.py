"""The ring attention cost model: its arithmetic on hand-computed cases, recommendations, errors."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ringjax.strategies import plan as planmod
from ringjax.strategies.plan import CHIPS, Chip, plan


def test_tpu_v5p_zigzag_causal_by_hand():
    p = plan("tpu_v5p", ring_size=8, seq_len=131072, heads=32, kv_heads=8, head_dim=128, efficiency=1.0)
    t = 16384
    # half of a full step (4 * H * t^2 * D FLOPs) on every device, at 459 TFLOP/s
    assert p.local_seq == t and p.layout == "zigzag" and p.recommended_layout == "zigzag"
    assert p.fwd_compute_s == pytest.approx(4 * 32 * t * t * 128 * 0.5 / 459e12)  # 4.791 ms
    assert p.fwd_compute_s == pytest.approx(4.791e-3, rel=1e-3)
    # K and V: 2 * t * 8 heads * 128 * 2 bytes = 64 MiB over one 100 GB/s link
    assert p.fwd_transfer_s == pytest.approx(2 * t * 8 * 128 * 2 / 100e9)  # 0.671 ms
    assert p.fwd_hidden and p.bwd_hidden
    # backward: 2.5x the FLOPs; K, V (bf16) plus dK, dV (f32) travel
    assert p.bwd_compute_s == pytest.approx(2.5 * p.fwd_compute_s)
    assert p.bwd_transfer_s == pytest.approx(3 * p.fwd_transfer_s)
    # all 8 steps are compute-bound half steps
    assert p.fwd_total_s == pytest.approx(8 * p.fwd_compute_s)
    # hides from t = KVH * 2 bytes * rate / (2 * H * 0.5 * link) = 8 * 2 * 459e12 / (32 * 100e9) = 2295
    assert p.min_local_seq_to_hide == math.ceil(8 * 2 * 459e12 / (32 * 100e9)) == 2295


def test_contiguous_causal_costs_a_full_step_per_step():
    p = plan("h200", ring_size=4, seq_len=32768, heads=32, kv_heads=8, head_dim=128, layout="contiguous")
    full = 4 * 32 * 8192**2 * 128 / (989e12 * 0.6)  # 1.853 ms at the default 60% of peak
    assert p.fwd_compute_s == pytest.approx(full)
    # the diagonal step is half, the three others are full for the slowest device; each of those three also
    # pays the chip's measured per-step cost (its transfers hide)
    paid = 3 * CHIPS["h200"].ring_step_s[0]
    assert p.fwd_hidden and paid > 0
    assert p.fwd_total_s == pytest.approx(0.5 * full + 3 * full + paid)
    zigzag = plan("h200", ring_size=4, seq_len=32768, heads=32, kv_heads=8, head_dim=128)
    assert zigzag.fwd_total_s == pytest.approx(4 * 0.5 * full + paid)
    assert p.recommended_layout == "zigzag" and any("zigzag" in n for n in p.notes)


def test_transfer_that_does_not_hide():
    p = plan("tpu_v5e", ring_size=16, seq_len=32768, heads=8, kv_heads=8, head_dim=128, causal=False)
    compute = 4 * 8 * 2048**2 * 128 / (197e12 * 0.6)  # 0.145 ms
    transfer = 2 * 2048 * 8 * 128 * 2 / 50e9  # 0.168 ms
    assert p.fwd_compute_s == pytest.approx(compute) and p.fwd_transfer_s == pytest.approx(transfer)
    assert not p.fwd_hidden
    # 15 steps wait for their transfer, the last one does not transfer
    assert p.fwd_total_s == pytest.approx(15 * transfer + compute)
    assert p.layout == "contiguous" and p.min_local_seq_to_hide > 2048
    assert any("outlasts compute" in n for n in p.notes)
    assert "NOT hidden" in str(p)


def test_memory_bound_step():
    slow = Chip("slow HBM", "gpu", peak_flops=1e15, hbm_bandwidth=1e9, link_bandwidth=1e12)
    p = plan(slow, ring_size=2, seq_len=2048, heads=1, kv_heads=1, head_dim=128, causal=False)
    assert p.block_q == 128
    kv = 2 * 1024 * 128 * 2  # K and V of the shard
    q = 1024 * 128 * 2
    # K/V re-read once per query tile (1024 / 128 = 8), Q read and O written once
    assert p.fwd_compute_s == pytest.approx((8 * kv + 2 * q) / 1e9)


def test_tpu_blocks_fit_vmem_and_divide_the_shard():
    for name in ("tpu_v4", "tpu_v5e", "tpu_v5p", "tpu_v6e"):
        for heads, kv_heads in ((32, 8), (8, 8), (64, 1)):
            p = plan(name, ring_size=8, seq_len=8 * 8192, heads=heads, kv_heads=kv_heads, head_dim=128)
            unit = p.local_seq // 2  # zigzag chunk
            assert unit % p.block_q == 0 and unit % p.block_kv == 0
            rows = heads // kv_heads * p.block_q
            assert planmod._vmem_bytes(rows, p.block_kv, 128, 2) <= CHIPS[name].vmem_budget


def test_every_chip_has_positive_figures_and_prints():
    for name, chip in CHIPS.items():
        assert chip.peak_flops > 1e14 and chip.hbm_bandwidth > 1e11 and chip.link_bandwidth > 1e10, name
        text = str(plan(name, ring_size=4, seq_len=4 * 4096, heads=16, kv_heads=4, head_dim=128))
        assert chip.name in text and "recommend: layout zigzag" in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan("h100", ring_size=2, seq_len=1024, heads=2, kv_heads=1, head_dim=64).ring_size = 3


@pytest.mark.parametrize(
    "kw, error",
    [
        (dict(chip="tpu_v9"), "chip must be one of"),
        (dict(heads=6, kv_heads=4), "multiple of kv_heads"),
        (dict(dtype="float16"), "no float16"),
        (dict(dtype="float32"), "dtype must be one of"),
        (dict(seq_len=1004), "divisible by 8"),
        (dict(layout="diagonal"), "layout must be one of"),
        (dict(efficiency=1.5), "efficiency"),
        (dict(ring_size=0), "ring_size"),
    ],
)
def test_bad_arguments_raise(kw, error):
    args = dict(chip="tpu_v5p", ring_size=4, seq_len=4096, heads=8, kv_heads=2, head_dim=128)
    args.update(kw)
    with pytest.raises(ValueError, match=error):
        plan(args.pop("chip"), **args)


def test_strategy_costs_by_hand():
    """2 x H200, 8192 tokens per device, GQA 32/8, causal zigzag, at 100% of peak, with the chip's measured
    collectives and ring-step cost."""
    from ringjax.strategies.plan import best_strategy, strategy_costs

    costs = {c.strategy: c for c in strategy_costs("h200", devices=2, seq_len=16384, heads=32, kv_heads=8,
                                                   head_dim=128, layout="zigzag", efficiency=1.0)}
    chip = CHIPS["h200"]
    nvlink, all_to_all, (step_fwd, _) = chip.collective("all_gather"), chip.collective("all_to_all"), chip.ring_step_s
    assert chip.collective("ppermute") == chip.collective("reduce_scatter") == nvlink and step_fwd > 0
    t, hbm = 8192, 4800e9
    half_step = 4 * 32 * t * t * 128 * 0.5 / 989e12  # one ring step of balanced causal work
    kv = 2 * t * 8 * 128 * 2  # K and V of one shard, bf16
    q = t * 32 * 128 * 2
    merge = 3 * t * 32 * 128 * 4 / hbm  # one lse merge of the float32 output
    ring = costs["ring"]
    # the K/V shift hides under the first step; the second pays the measured per-step cost
    assert nvlink.seconds(kv) < half_step
    assert ring.fwd_s == pytest.approx(2 * half_step + merge + step_fwd)
    assert ring.memory_bytes == pytest.approx(2 * kv * 3)  # two K/V buffers and two float32 dK/dV buffers
    # all_gather: one shard gathered, then t queries against 2t keys, half of them causal
    gather = costs["all_gather"]
    assert gather.fwd_s == pytest.approx(nvlink.seconds(kv) + 2 * half_step)
    assert gather.bwd_s == pytest.approx(nvlink.seconds(kv) + 2.5 * 2 * half_step + nvlink.seconds(2 * kv))
    assert gather.memory_bytes == pytest.approx(2 * kv * 3)
    # ulysses: half of q, k, v out and half of q (and the f32 lse) back; 16 heads over 16384 tokens
    uly = costs["ulysses"]
    a2a = all_to_all.seconds(0.5 * (q + kv)) + all_to_all.seconds(0.5 * (q + 32 * t * 4))
    whole = 4 * 16 * 16384**2 * 128 * 0.5 / 989e12  # balanced causal work of the whole sequence
    # the all-to-all leaves zigzag chunks 0, 3, 1, 2: sorting them copies q, k, v, out and lse (read, written)
    sort = 2 * (2 * q + kv + 32 * t * 4) / hbm
    assert uly.fwd_s == pytest.approx(a2a + sort + whole)
    # ulysses ahead, as measured at 8K on 2 H200 (docs/strategies.md); the ring is kept unless another is faster
    # by more than the tolerance
    assert best_strategy(costs.values()).strategy == "ulysses"
    assert ring.total_s < 1.3 * uly.total_s and best_strategy(costs.values(), tolerance=0.3).strategy == "ring"
    # unsorted (as measured before the sort) the kernel walks the chunks as stored: a causal walk also
    # crosses the hidden pairs of chunk 3 of c = 4096 tokens (from chunk 3's queries: c(c-1)/2; from
    # chunks 1 and 2: c^2 each), about 1.31x, and nothing is copied
    old = {c.strategy: c for c in strategy_costs("h200", devices=2, seq_len=16384, heads=32, kv_heads=8,
                                                 head_dim=128, layout="zigzag", efficiency=1.0, sort_tokens=False)}
    c, visible = 4096, 16384 * 16385 / 2
    walk = (visible + c * (c - 1) / 2 + 2 * c * c) / visible
    assert old["ulysses"].fwd_s == pytest.approx(a2a + whole * walk)
    assert old["ring"] == ring and old["all_gather"] == gather
    # contiguous: the all-to-all leaves natural order, nothing to sort
    for layout_costs in (strategy_costs("h200", devices=2, seq_len=16384, heads=32, kv_heads=8, head_dim=128,
                                        efficiency=1.0, sort_tokens=flag) for flag in (True, False)):
        assert next(c for c in layout_costs if c.strategy == "ulysses").fwd_s == pytest.approx(a2a + whole)


def test_strategy_costs_rule_out_and_prefer():
    from ringjax.strategies.plan import best_strategy, chip_for, strategy_costs

    # contiguous causal: the ring's and all-gather's slowest device does most of the work; ulysses does not
    costs = strategy_costs("h100", devices=4, seq_len=4 * 8192, heads=32, kv_heads=8, head_dim=128)
    assert best_strategy(costs).strategy == "ulysses"
    # 6 heads do not split over 4 devices; with little HBM the gathered K/V do not fit
    small = dataclasses.replace(CHIPS["h100"], hbm_bytes=1e9)
    costs = {c.strategy: c for c in strategy_costs(small, devices=4, seq_len=4 * 65536, heads=6, kv_heads=6,
                                                   head_dim=128, layout="zigzag")}
    assert not costs["ulysses"].fits and "not divisible" in costs["ulysses"].note
    assert not costs["all_gather"].fits and "over the memory budget" in costs["all_gather"].note
    # hybrid: the K/V heads are repeated to divide over the head axis
    costs = {c.strategy: c for c in strategy_costs("h200", devices=8, seq_len=8 * 4096, heads=32, kv_heads=2,
                                                   head_dim=128, layout="zigzag", hybrid=(4, 2))}
    assert "repeated 2x" in costs["hybrid"].note and math.isfinite(costs["hybrid"].total_s)
    assert chip_for("NVIDIA H200") is CHIPS["h200"] and chip_for("TPU v5 lite") is CHIPS["tpu_v5e"]
    assert chip_for("cpu") is None
    with pytest.raises(ValueError, match="hybrid must be"):
        strategy_costs("h200", devices=8, seq_len=8192, heads=8, kv_heads=8, head_dim=64, hybrid=(3, 2))


def test_strategy_cli(capsys):
    from ringjax.__main__ import main

    assert main(["strategy", "--chip", "h200", "--devices", "2", "--seq", "16384", "--heads", "32", "--kv-heads", "8",
                 "--head-dim", "128", "--causal"]) == 0
    text = capsys.readouterr().out
    assert "ring " in text and "all_gather " in text and "ulysses " in text
    assert "strategy='auto' picks ulysses" in text  # contiguous causal


_STRATEGY = ["strategy", "--chip", "h100", "--devices", "4", "--seq", "1024", "--heads", "8", "--head-dim", "64"]


@pytest.mark.parametrize("flag, value, says", [
    ("--link-gbps", "0", "link_gbps must be a positive finite number, got 0.0"),  # was a ZeroDivisionError
    ("--link-gbps", "-5", "link_gbps must be a positive finite number, got -5.0"),  # was negative times
    ("--link-gbps", "nan", "link_gbps must be a positive finite number, got nan"),
    ("--link-gbps", "inf", "link_gbps must be a positive finite number, got inf"),
    ("--efficiency", "0", "efficiency must be in (0, 1], got 0.0"),
    ("--efficiency", "nan", "efficiency must be in (0, 1], got nan"),
    ("--memory-fraction", "1.5", "memory_fraction must be in (0, 1], got 1.5"),
    ("--seq", "abc", "invalid int value: 'abc'"),
    ("--devices", "0", "must be a positive integer, got 0"),
])
def test_strategy_cli_refuses_bad_numbers_naming_the_flag(capsys, flag, value, says):
    from ringjax.__main__ import main

    with pytest.raises(SystemExit) as exit:
        main(_STRATEGY + [flag, value])
    assert exit.value.code == 2
    assert f"strategy: error: argument {flag}: {says}" in capsys.readouterr().err


def test_strategy_cli_link_rate_and_the_chips_own_check(capsys):
    from ringjax.__main__ import main

    assert main(_STRATEGY + ["--link-gbps", "0.5"]) == 0
    assert "(link 0.5 GB/s)" in capsys.readouterr().out
    # the library refuses what the flags refuse, in the same words
    with pytest.raises(ValueError, match="link_bandwidth must be a positive finite number, got 0"):
        dataclasses.replace(CHIPS["h100"], link_bandwidth=0)
    with pytest.raises(ValueError, match=r"efficiency must be in \(0, 1\], got nan"):
        planmod.strategy_costs("h100", devices=4, seq_len=1024, heads=8, kv_heads=8, head_dim=64, efficiency=math.nan)
