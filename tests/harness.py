"""Run ringjax on simulated devices and compare with the float64 reference."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from ringjax.core import precision

from reference import attention_reference


def _hopper() -> bool:
    """Whether the first device is an sm90+ GPU (the Mosaic GPU kernels run for real)."""
    if jax.default_backend() != "gpu":
        return False
    cc = getattr(jax.devices()[0], "compute_capability", "0")
    return int(str(cc).split(".")[0]) >= 9


ON_HOPPER = _hopper()


def child_env(devices: int | None = 8, **extra: str) -> dict[str, str]:
    """The environment for a child process running jax on the CPU: this run's XLA flags (conftest's among
    them) with `devices` simulated devices in place of its count (None: no count, the child sets its own)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", **extra)

# norm-wise relative error ||got - ref|| / ||ref|| allowed per input dtype; "tf32": float32 on a GPU at jax's
# default matmul precision (inputs rounded to 10 mantissa bits, as float16's)
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3, "tf32": 5e-3}


def make_inputs(seed, *, batch=2, seq=64, heads=4, kv_heads=2, head_dim=16, dtype="float32",
                segments=None, sinks=False, alibi=False, dropout_key=None, v_head_dim=None):
    """Fresh random q, k, v and cotangents, exactly representable in `dtype`.

    `segments`: None, a list of segment lengths, or "random" (packed documents with padding).
    `v_head_dim`: v's (and the output's) head_dim, None: head_dim.
    """
    rng = np.random.default_rng(seed)
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    x = {
        "q": rng.standard_normal((batch, seq, heads, head_dim)),
        "k": rng.standard_normal((batch, seq, kv_heads, head_dim)),
        "v": rng.standard_normal((batch, seq, kv_heads, v_head_dim)),
        "dout": rng.standard_normal((batch, seq, heads, v_head_dim)),
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
    if alibi:
        x["alibi_slopes"] = rng.uniform(0.05, 1.0, heads).astype(np.float32)
    if dropout_key is not None:
        x["dropout_rng"] = np.asarray(jax.random.key_data(jax.random.key(dropout_key)))
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


def need_devices(n):
    """Skips the test where the machine has fewer than `n` devices (a GPU host has one or two)."""
    if n > len(jax.devices()):
        import pytest

        pytest.skip(f"needs {n} devices, {len(jax.devices())} {jax.default_backend()} devices here")


def mesh_of(n):
    need_devices(n)
    return jax.make_mesh((n,), ("sp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])


@functools.lru_cache(maxsize=None)
def _compiled(n, layout, mode, kw_items, has_seg, has_sinks, has_alibi):
    kw = dict(kw_items)
    mesh = mesh_of(n)

    def loss_and_out(q, k, v, seg, sinks, alibi, rng, dout, dlse):
        def attn(q, k, v, seg, sinks, alibi, rng):
            if rng is not None:
                rng = jax.random.wrap_key_data(rng)
            return ringjax.ring_attention(q, k, v, axis_name="sp", layout=layout, segment_ids=seg, sinks=sinks,
                                          alibi_slopes=alibi, dropout_rng=rng, return_lse=True, **kw)

        if mode == "shard_map":
            spec = P(None, "sp")
            maybe = lambda x, s: None if x is None else s  # noqa: E731
            attn = jax.shard_map(attn, mesh=mesh, in_specs=(spec, spec, spec, maybe(seg, spec), maybe(sinks, P()),
                                                            maybe(alibi, P()), maybe(rng, P())),
                                 out_specs=(spec, P(None, None, "sp")))
        out, lse = attn(q, k, v, seg, sinks, alibi, rng)
        val = (out.astype(jnp.float32) * dout).sum() + jnp.where(jnp.isfinite(lse), lse * dlse, 0.0).sum()
        return val, (out, lse)

    grad_args = (0, 1, 2) + ((4,) if has_sinks else ()) + ((5,) if has_alibi else ())
    return jax.jit(jax.value_and_grad(loss_and_out, argnums=grad_args, has_aux=True)), mesh


def run_ring(x, n, *, layout="contiguous", mode="shard_map", **kw):
    """Outputs, lse and gradients of ringjax on n devices, in natural token order, as float64 numpy."""
    fn, mesh = _compiled(n, layout, mode, tuple(sorted(kw.items())), "segment_ids" in x, "sinks" in x,
                         "alibi_slopes" in x)
    seq_sharding = NamedSharding(mesh, P(None, "sp"))
    to = functools.partial(ringjax.to_layout, layout=layout, axis_size=n, axis=1)
    dtype = x["dtype"]
    q, k, v = (jax.device_put(to(jnp.asarray(x[name], dtype)), seq_sharding) for name in ("q", "k", "v"))
    seg = None
    if "segment_ids" in x:
        seg = jax.device_put(to(jnp.asarray(x["segment_ids"])), seq_sharding)
    rep = NamedSharding(mesh, P())
    sinks, alibi, rng = (jax.device_put(jnp.asarray(x[name]), rep) if name in x else None
                         for name in ("sinks", "alibi_slopes", "dropout_rng"))
    dout = jax.device_put(to(jnp.asarray(x["dout"])), seq_sharding)
    dlse = jax.device_put(ringjax.to_layout(jnp.asarray(x["dlse"]), layout, n, axis=2),
                          NamedSharding(mesh, P(None, None, "sp")))
    with jax.set_mesh(mesh):
        (_, (out, lse)), grads = fn(q, k, v, seg, sinks, alibi, rng, dout, dlse)
    back = functools.partial(ringjax.from_layout, layout=layout, axis_size=n, axis=1)
    res = {
        "out": np.asarray(back(np.asarray(out.astype(jnp.float32))), np.float64),
        "lse": np.asarray(ringjax.from_layout(np.asarray(lse), layout, n, axis=2), np.float64),
        "dq": np.asarray(back(np.asarray(grads[0].astype(jnp.float32))), np.float64),
        "dk": np.asarray(back(np.asarray(grads[1].astype(jnp.float32))), np.float64),
        "dv": np.asarray(back(np.asarray(grads[2].astype(jnp.float32))), np.float64),
    }
    extra = iter(grads[3:])
    if "sinks" in x:
        res["dsinks"] = np.asarray(next(extra), np.float64)
    if "alibi_slopes" in x:
        res["dalibi"] = np.asarray(next(extra), np.float64)
    res["out_dtype"] = str(out.dtype)
    return res


def reference_for(x, **kw):
    """The float64 reference for the same inputs and features."""
    names = ("causal", "softmax_scale", "logits_soft_cap", "chunk_size", "num_sink_tokens", "dropout_rate")
    ref_kw = {name: kw[name] for name in names if name in kw}
    if kw.get("sliding_window") is not None:
        ref_kw["window"] = kw["sliding_window"]
    if "dropout_rng" in x:
        key = jax.random.wrap_key_data(jnp.asarray(x["dropout_rng"]))
        ref_kw["dropout_seed"] = np.asarray(jax.random.bits(key, (2,), jnp.uint32))
    return attention_reference(x["q"], x["k"], x["v"], segment_ids=x.get("segment_ids"), sinks=x.get("sinks"),
                               alibi_slopes=x.get("alibi_slopes"), dout=x["dout"], dlse=x["dlse"], **ref_kw)


def rel_err(got, ref, terms=None):
    """|got - ref| / |ref| over the finite entries; `terms`: the magnitudes summed into `ref` where it is a sum whose
    terms may cancel, against which its error is judged where they exceed it."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    finite = np.isfinite(ref)
    assert np.array_equal(finite, np.isfinite(got)), "non-finite entries differ from the reference"
    num = np.linalg.norm(np.where(finite, got, 0.0) - np.where(finite, ref, 0.0))
    den = max(np.linalg.norm(np.where(finite, ref, 0.0)), 1e-30)
    if terms is not None:
        den = max(den, np.linalg.norm(terms))
    return num / den


def tolerance_key(dtype: str) -> str:
    """`dtype`, or "tf32" for float32 where jax's matmul precision now rounds it to TF32 (GPUs)."""
    tf32 = jax.default_backend() == "gpu" and precision.current(dtype) not in precision.FULL_FLOAT32
    return "tf32" if dtype == "float32" and tf32 else dtype


def check_against_reference(got, ref, dtype, names=("out", "lse", "dq", "dk", "dv", "dsinks", "dalibi")):
    dtype = tolerance_key(dtype)
    tol = TOLERANCE[dtype]
    for name in names:
        if name not in ref:
            continue
        assert not np.isnan(got[name]).any(), f"{name} has NaN"
        err = rel_err(got[name], ref[name], ref.get(f"{name}_terms"))
        # gradients run through one more matmul chain in low precision
        limit = tol if name in ("out", "lse") or dtype == "float32" else 2 * tol
        assert err < limit, f"{name}: relative error {err:.2e} exceeds {limit:.0e} ({dtype})"
    assert np.array_equal(np.isneginf(got["lse"]), np.isneginf(ref["lse"])), "fully masked rows differ"
