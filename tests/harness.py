"""Run ringjax on simulated devices and compare with the float64 reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from reference import attention_reference

# norm-wise relative error ||got - ref|| / ||ref|| allowed per input dtype
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}


def make_inputs(seed, *, batch=2, seq=64, heads=4, kv_heads=2, head_dim=16, dtype="float32",
                segments=None, sinks=False):
    """Fresh random q, k, v and cotangents, exactly representable in `dtype`.

    `segments`: None, a list of segment lengths, or "random" (packed documents with padding).
    """
    rng = np.random.default_rng(seed)
    x = {
        "q": rng.standard_normal((batch, seq, heads, head_dim)),
        "k": rng.standard_normal((batch, seq, kv_heads, head_dim)),
        "v": rng.standard_normal((batch, seq, kv_heads, head_dim)),
        "dout": rng.standard_normal((batch, seq, heads, head_dim)),
        "dlse": rng.standard_normal((batch, heads, seq)),
    }
    x = {name: val.astype(np.float32) for name, val in x.items()}
    for name in ("q", "k", "v", "dout"):
        x[name] = np.asarray(jnp.asarray(x[name], dtype).astype(jnp.float32))  # representable in dtype
    x["dtype"] = dtype
    if segments is not None:
        x["segment_ids"] = random_segments(rng, batch, seq) if segments == "random" else np.broadcast_to(
            np.repeat(np.arange(len(segments)), segments), (batch, seq)).astype(np.int32)
    if sinks:
        x["sinks"] = rng.standard_normal(heads).astype(np.float32)
    return x


def random_segments(rng, batch, seq):
    """Packed documents of random lengths crossing shard boundaries, with padding (-1) at the end
    of some rows: padded rows see no key at all."""
    out = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=min(seq - 1, rng.integers(2, 7)), replace=False))
        out[b] = np.searchsorted(cuts, np.arange(seq), side="right")
        if b % 2 == 0:
            out[b, seq - rng.integers(1, max(1, seq // 4) + 1):] = -1
    return out


def mesh_of(n):
    return jax.make_mesh((n,), ("sp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])


@functools.lru_cache(maxsize=None)
def _compiled(n, layout, mode, kw_items, has_seg, has_sinks):
    kw = dict(kw_items)
    mesh = mesh_of(n)

    def loss_and_out(q, k, v, seg, sinks, dout, dlse):
        def attn(q, k, v, seg, sinks):
            return ringjax.ring_attention(q, k, v, axis_name="sp", layout=layout, segment_ids=seg, sinks=sinks,
                                          return_lse=True, **kw)

        if mode == "shard_map":
            spec = P(None, "sp")
            attn = jax.shard_map(attn, mesh=mesh, in_specs=(spec, spec, spec, None if seg is None else spec,
                                                            None if sinks is None else P()),
                                 out_specs=(spec, P(None, None, "sp")))
        out, lse = attn(q, k, v, seg, sinks)
        val = (out.astype(jnp.float32) * dout).sum() + jnp.where(jnp.isfinite(lse), lse * dlse, 0.0).sum()
        return val, (out, lse)

    grad_args = (0, 1, 2) + ((4,) if has_sinks else ())
    return jax.jit(jax.value_and_grad(loss_and_out, argnums=grad_args, has_aux=True)), mesh


def run_ring(x, n, *, layout="contiguous", mode="shard_map", **kw):
    """Outputs, lse and gradients of ringjax on n devices, in natural token order, as float64 numpy."""
    fn, mesh = _compiled(n, layout, mode, tuple(sorted(kw.items())), "segment_ids" in x, "sinks" in x)
    seq_sharding = NamedSharding(mesh, P(None, "sp"))
    to = functools.partial(ringjax.to_layout, layout=layout, axis_size=n, axis=1)
    dtype = x["dtype"]
    q, k, v = (jax.device_put(to(jnp.asarray(x[name], dtype)), seq_sharding) for name in ("q", "k", "v"))
    seg = None
    if "segment_ids" in x:
        seg = jax.device_put(to(jnp.asarray(x["segment_ids"])), seq_sharding)
    sinks = jax.device_put(jnp.asarray(x["sinks"]), NamedSharding(mesh, P())) if "sinks" in x else None
    dout = jax.device_put(to(jnp.asarray(x["dout"])), seq_sharding)
    dlse = jax.device_put(ringjax.to_layout(jnp.asarray(x["dlse"]), layout, n, axis=2),
                          NamedSharding(mesh, P(None, None, "sp")))
    with jax.set_mesh(mesh):
        (_, (out, lse)), grads = fn(q, k, v, seg, sinks, dout, dlse)
    back = functools.partial(ringjax.from_layout, layout=layout, axis_size=n, axis=1)
    res = {
        "out": np.asarray(back(np.asarray(out.astype(jnp.float32))), np.float64),
        "lse": np.asarray(ringjax.from_layout(np.asarray(lse), layout, n, axis=2), np.float64),
        "dq": np.asarray(back(np.asarray(grads[0].astype(jnp.float32))), np.float64),
        "dk": np.asarray(back(np.asarray(grads[1].astype(jnp.float32))), np.float64),
        "dv": np.asarray(back(np.asarray(grads[2].astype(jnp.float32))), np.float64),
    }
    if "sinks" in x:
        res["dsinks"] = np.asarray(grads[3], np.float64)
    res["out_dtype"] = str(out.dtype)
    return res


def reference_for(x, **kw):
    """The float64 reference for the same inputs and features."""
    ref_kw = {name: kw[name] for name in ("causal", "softmax_scale", "logits_soft_cap") if name in kw}
    if kw.get("sliding_window") is not None:
        ref_kw["window"] = kw["sliding_window"]
    return attention_reference(x["q"], x["k"], x["v"], segment_ids=x.get("segment_ids"), sinks=x.get("sinks"),
                               dout=x["dout"], dlse=x["dlse"], **ref_kw)


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    finite = np.isfinite(ref)
    assert np.array_equal(finite, np.isfinite(got)), "non-finite entries differ from the reference"
    num = np.linalg.norm(np.where(finite, got, 0.0) - np.where(finite, ref, 0.0))
    den = max(np.linalg.norm(np.where(finite, ref, 0.0)), 1e-30)
    return num / den


def check_against_reference(got, ref, dtype, names=("out", "lse", "dq", "dk", "dv", "dsinks")):
    tol = TOLERANCE[dtype]
    for name in names:
        if name not in ref:
            continue
        assert not np.isnan(got[name]).any(), f"{name} has NaN"
        err = rel_err(got[name], ref[name])
        # gradients run through one more matmul chain in low precision
        limit = tol if name in ("out", "lse") or dtype == "float32" else 2 * tol
        assert err < limit, f"{name}: relative error {err:.2e} exceeds {limit:.0e} ({dtype})"
    assert np.array_equal(np.isneginf(got["lse"]), np.isneginf(ref["lse"])), "fully masked rows differ"
