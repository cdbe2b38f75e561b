"""What the compiled ring does: memory growth, transfers issued, steps skipped."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from ringjax.backends.xla import XlaConfig

from harness import mesh_of


def _compiled(n, seq, fwd_only=False, **kw):
    mesh = mesh_of(n)
    spec = P(None, "sp")
    shapes = [jax.ShapeDtypeStruct((1, seq, 4, 32), jnp.float32, sharding=NamedSharding(mesh, spec))] * 3

    def attn(q, k, v):
        return ringjax.ring_attention(q, k, v, implementation="xla", config=XlaConfig(block_q=64, block_kv=64), **kw)

    f = jax.shard_map(attn, mesh=mesh, in_specs=spec, out_specs=spec)
    if not fwd_only:
        g = f
        f = jax.grad(lambda q, k, v: g(q, k, v).sum(), argnums=(0, 1, 2))
    with jax.set_mesh(mesh):
        return jax.jit(f).lower(*shapes)


@pytest.mark.parametrize("n", [1, 2])
def test_temp_memory_grows_linearly_with_local_sequence(n):
    temps = []
    for local in (512, 1024, 2048):
        mem = _compiled(n, local * n, causal=True).compile().memory_analysis()
        temps.append(mem.temp_size_in_bytes)
    # O(local_seq * block): doubling the shard at most doubles temp memory (plus slack);
    # an O(local_seq^2) score matrix would quadruple it
    assert temps[1] <= 2.3 * temps[0] and temps[2] <= 2.3 * temps[1], temps
    assert temps[2] < 0.5 * (2048 * 2048 * 4 * 4), "temp memory as large as a full score matrix"


def _count(text, op):
    return sum(line.count(op) for line in text.splitlines())


@pytest.mark.parametrize("n", [2, 4, 8])
def test_forward_issues_one_transfer_per_step_and_none_after_the_last(n):
    text = _compiled(n, 32 * n, fwd_only=True).as_text()
    # K, V per step: the full ring is n steps with n - 1 transfers
    assert _count(text, "collective_permute") == 2 * (n - 1)


def test_sliding_window_shortens_the_ring():
    n, local = 8, 16
    # window 20 reaches ceil(20/16) = 2 shards back: 3 steps, 2 transfers of K and V
    text = _compiled(n, local * n, fwd_only=True, causal=True, sliding_window=20).as_text()
    assert _count(text, "collective_permute") == 2 * 2
    # a two-sided window also needs the shard ahead: one first shift plus 3 ring transfers
    text = _compiled(n, local * n, fwd_only=True, sliding_window=(20, 5)).as_text()
    assert _count(text, "collective_permute") == 2 * (1 + 3)
    # zigzag spreads each shard over the sequence: the full ring stays
    text = _compiled(n, local * n, fwd_only=True, causal=True, sliding_window=20, layout="zigzag").as_text()
    assert _count(text, "collective_permute") == 2 * (n - 1)


def test_backward_transfers():
    n = 4
    text = _compiled(n, 32 * n, causal=True, sliding_window=40).as_text()
    # window reaches 2 shards back: 3 steps. Forward: K, V twice (4). Backward: K, V twice (4),
    # dK, dV after each non-final step (4), and dK, dV once more back to their owner (2).
    assert _count(text, "collective_permute") == 14


def test_empty_steps_and_blocks_are_skipped_by_conditionals():
    def cases(**kw):
        return _count(_compiled(4, 128, fwd_only=True, **kw).as_text(), "stablehlo.case")

    assert cases(causal=False) == 0  # nothing can be empty: no branches at all
    # zigzag: every step is half full, so only the per-block test inside each of the 4 steps
    assert cases(causal=True, layout="zigzag") == 4
    # contiguous: a whole-step test per step on top of the per-block test
    assert cases(causal=True) == 8
