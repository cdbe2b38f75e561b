"""core/visits: tables built in numpy at trace time (`on_device`) equal those XLA builds from traced positions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ringjax.core import ring, shards
from ringjax.core.masks import StepOptions, TokenInfo, visible_pairs
from ringjax.core.schedule import ring_plan
from ringjax.core.visits import block_starts, half_flags, on_device, range_table, sink_range_table
from ringjax.layouts import local_positions
from ringjax.options import MAX_STATIC_INT, AttentionOptions

from harness import need_devices
from reference import document_offsets, mask_reference

T = 512  # tokens per device: 8 query blocks of 64, 4 key blocks of 128

MASKS = [
    dict(causal=True),
    dict(causal=True, window=(100, 0)),
    dict(window=(64, 64)),
    dict(causal=True, chunk_size=96),
    dict(causal=True, window=(200, 0), num_sink_tokens=5),
    dict(num_sink_tokens=3, chunk_size=160),
]


def _tables(opts):
    def build(q_info, k_info):
        fwd = sink_range_table(opts, q_info, k_info, 64, 128) if opts.num_sink_tokens else \
            range_table(opts, q_info, k_info, 64, 128)
        return fwd, range_table(opts, k_info, q_info, 128, 64, transpose=True), block_starts(k_info, 128)

    return build


def _per_step(opts, q, static: bool):
    """Every ring step's tables on this device, as the kernels get them: statically or from traced positions."""
    plan = ring_plan(opts, T)
    q_info = shards.query_info(opts, q, None)
    out = []
    for step in range(plan.num_steps):
        k_info = shards.shard_info(opts, ring._source_at(plan, step, opts), T)
        if q_info.segpos is not None:  # the offsets travel with K/V in the ring; without segments they are positions
            k_info = k_info._replace(segpos=k_info.pos[None])
        if not static:
            q_info, k_info = q_info._replace(static_pos=None), k_info._replace(static_pos=None)
        out += [jnp.asarray(x)[None] for x in jax.tree.leaves(on_device(_tables(opts), opts, q_info, k_info))]
    return out


@pytest.mark.parametrize("causal, window", [(True, (MAX_STATIC_INT, 0)), (True, (5, 0)), (False, (3, 9)),
                                            (False, (MAX_STATIC_INT, MAX_STATIC_INT)), (False, (0, MAX_STATIC_INT))])
def test_window_rule_at_extreme_positions(causal, window):
    """masks' window rule on pairs (one unsigned compare of the positions' difference) against the two compares
    in int64, at positions from 0 to 2**31 - 1 and extents up to 2**30, in numpy (tables) and in jax (kernels)."""
    rng = np.random.default_rng(7)
    edges = np.array([0, 1, 2**30 - 1, 2**30, 2**30 + 1, 2**31 - 2, 2**31 - 1], np.int64)
    pos = np.concatenate([edges, rng.integers(0, 2**31, 40), rng.integers(2**31 - 40, 2**31, 10)])
    qp, kp = pos[:, None], pos[None, :]
    left, right = window
    want = (kp >= qp - left) & (kp <= qp + right) & ((kp <= qp) if causal else True)
    assert want.any() and not want.all()
    opts = AttentionOptions(causal=causal, window=window)
    for xp in (np, jnp):
        got = visible_pairs(opts, xp.asarray(qp.astype(np.int32)), xp.asarray(kp.astype(np.int32)))
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_static_tables_match_traced(n, layout):
    need_devices(n)
    mesh = Mesh(np.array(jax.devices()[:n]), ("sp",))
    q = jax.random.normal(jax.random.key(n), (1, T * n, 1, 8))
    for kw in MASKS:
        opts = AttentionOptions(layout=layout, axis_name="sp", axis_size=n, **kw)

        def both(q, opts=opts):
            return _per_step(opts, q, True), _per_step(opts, q, False)

        static, traced = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P(None, "sp"), out_specs=P("sp")))(q)
        assert len(static) == len(traced) > 0
        for a, b in zip(static, traced):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{kw}, {n} devices, {layout}")


def test_static_tables_leave_no_work_to_xla():
    """One device: the tables are constants (no equation computes them); a ring: one gather per table."""
    opts = AttentionOptions(causal=True, window=(100, 0), num_sink_tokens=4)
    info = shards.shard_info(opts, shards.own, T)
    info = info._replace(segpos=info.pos[None])
    assert not jax.make_jaxpr(lambda: on_device(_tables(opts), opts, info, info))().eqns
    traced = info._replace(static_pos=None)
    assert jax.make_jaxpr(lambda: on_device(_tables(opts), opts, traced, traced))().eqns


def test_sink_step_keys_and_segments():
    """The sink step's keys are the same on every device; segment ids send the tables back to XLA."""
    first = TokenInfo.first(64)
    assert first.is_static and first.on_device(5).pos.tolist() == list(range(64))
    opts = StepOptions.sink_step(AttentionOptions(causal=True, num_sink_tokens=4))
    info = shards.shard_info(opts, shards.own, T)
    got = on_device(lambda q, k: range_table(opts, q, k, 64, 64), opts, info._replace(segpos=info.pos[None]), first)
    assert isinstance(got, np.ndarray) and got[:, :, 3].min() == 1  # every query tile sees the sinks' block
    with_ids = info._replace(seg=jnp.zeros((1, T), jnp.int32))
    assert not with_ids.is_static


def test_long_operands_stay_in_xla(monkeypatch):
    """Past `STATIC_TOKENS` the quadratic block tables are left to XLA: numpy would cost trace time and memory."""
    from ringjax.core import visits

    opts = AttentionOptions(causal=True)
    info = shards.shard_info(opts, shards.own, T)
    assert isinstance(on_device(_tables(opts), opts, info, info)[0], np.ndarray)
    monkeypatch.setattr(visits, "STATIC_TOKENS", T - 1)
    assert jax.make_jaxpr(lambda: on_device(_tables(opts), opts, info, info))().eqns


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("kw", MASKS + [dict(causal=True, segments=True), dict(causal=True, window=(70, 0),
                                                                              num_sink_tokens=3, segments=True)])
def test_half_flags_mark_only_hidden_halves(layout, kw):
    """A flagged half block (`half_flags`) shows the tile no pair under the float64 reference's mask, on every
    step of a ring of 2; and the causal diagonals and window edges do get flagged, so the forward's half-wide
    scores run."""
    kw = dict(kw)
    n, total = 2, 2 * T
    seg = None
    if kw.pop("segments", False):
        rng = np.random.default_rng(3)
        seg = np.searchsorted(np.sort(rng.choice(np.arange(1, total), 5, replace=False)), np.arange(total),
                              side="right")[None].astype(np.int32)
    opts = AttentionOptions(layout=layout, axis_size=n, has_segments=seg is not None, **kw)
    mask = mask_reference(total, causal=opts.causal, window=opts.window, segment_ids=seg,
                          chunk_size=opts.chunk_size, num_sink_tokens=opts.num_sink_tokens)[0]
    flagged = prefixed = 0
    for shard in range(n):
        for src in range(n):
            qpos, kpos = (local_positions(layout, r, n, T, xp=np) for r in (shard, src))

            def info(pos):
                return TokenInfo(pos, None if seg is None else seg[:, pos],
                                 (pos[None] if seg is None else document_offsets(seg)[:, pos]) if opts.num_sink_tokens
                                 else None)

            table = (sink_range_table if opts.num_sink_tokens else range_table)(opts, info(qpos), info(kpos), 64, 128)
            if table is None:
                continue
            flags = half_flags(opts, info(qpos), info(kpos), 64, 128, table)
            for tile in range(T // 64):
                lo, hi = table[0, tile, -4], table[0, tile, -1]
                rows = mask[qpos[tile * 64:(tile + 1) * 64]]
                halves = [(flags[0, tile, 0], 2 * lo, hi > lo), (flags[0, tile, 1], 2 * hi - 1, hi > lo)]
                if table.shape[-1] == 6:  # the sink tokens' prefix
                    plo, phi = table[0, tile, 0], table[0, tile, 1]
                    halves.append((flags[0, tile, 2], 2 * phi - 1, phi > plo))
                    prefixed += int(flags[0, tile, 2])
                for flag, half, some in halves:
                    if flag:
                        assert some and not rows[:, kpos[half * 64:(half + 1) * 64]].any(), (shard, src, tile)
                        flagged += 1
                assert not (flags[0, tile].all() and hi - lo == 1), "one block flagged twice"
    if opts.causal:
        assert flagged, "no half flagged where a diagonal leaves one"
    if opts.num_sink_tokens and opts.window is not None and seg is None:
        assert prefixed, "no half flagged in the sink tokens' block"
