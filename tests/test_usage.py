"""ringjax called the ways users call it: every kind of mesh, input and dtype.

Meshes come from `jax.sharding.Mesh(devices, names)` (Auto axes, what MaxText-style code
builds), `jax.make_mesh` (Explicit axes) and `jax.set_mesh`, with extra data and tensor
axes and the sequence axis not first; inputs are numpy arrays, unsharded and sharded jax
arrays and tracers; dtypes float32, bfloat16 and float16 with head_dim 64 to 256.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax
from ringjax.core import precision
from ringjax.dispatch import calling, registry

from harness import TOLERANCE, make_inputs, need_devices, reference_for, rel_err


def _auto_mesh(shape, names):
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _explicit_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape),
                         devices=jax.devices()[: int(np.prod(shape))])


MESHES = {
    "Mesh(auto)": lambda: _auto_mesh((4,), ("sp",)),
    "make_mesh(explicit)": lambda: _explicit_mesh((4,), ("sp",)),
    # sequence axis not first, with data and tensor axes beside it
    "Mesh(dp,sp,tp)": lambda: _auto_mesh((2, 2, 2), ("dp", "sp", "tp")),
    "make_mesh(dp,sp,tp)": lambda: _explicit_mesh((2, 2, 2), ("dp", "sp", "tp")),
}


def _spec(mesh):
    names = mesh.axis_names
    return P("dp" if "dp" in names else None, "sp", "tp" if "tp" in names else None, None)


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("how", ["mesh_arg", "set_mesh", "jit_set_mesh", "shard_map"])
def test_every_mesh_kind_and_calling_mode(mesh_name, how):
    need_devices(8)
    mesh = MESHES[mesh_name]()
    n = mesh.shape["sp"]
    layout = "zigzag"
    x = make_inputs(21, batch=2, seq=32, heads=4, kv_heads=2, segments="random", sinks=True)
    spec = _spec(mesh)
    put = lambda a, s: jax.device_put(ringjax.to_layout(jnp.asarray(a), layout, n), NamedSharding(mesh, s))  # noqa: E731
    q, k, v = (put(x[name], spec) for name in ("q", "k", "v"))
    seg = put(x["segment_ids"], P(spec[0], "sp"))
    sinks = jnp.asarray(x["sinks"])
    kw = dict(causal=True, sliding_window=11, layout=layout, return_lse=True)

    if how == "mesh_arg":
        out, lse = ringjax.ring_attention(q, k, v, segment_ids=seg, sinks=sinks, mesh=mesh, **kw)
    elif how == "set_mesh":
        with jax.set_mesh(mesh):
            out, lse = ringjax.ring_attention(q, k, v, segment_ids=seg, sinks=sinks, **kw)
    elif how == "jit_set_mesh":
        with jax.set_mesh(mesh):
            out, lse = jax.jit(lambda *a: ringjax.ring_attention(*a[:3], segment_ids=a[3], sinks=a[4], **kw))(
                q, k, v, seg, sinks)
    else:
        lse_spec = P(spec[0], spec[2], "sp")
        fn = jax.shard_map(
            lambda q, k, v, seg, sinks: ringjax.ring_attention(q, k, v, segment_ids=seg, sinks=sinks,
                                                               axis_name="sp", **kw),
            mesh=mesh, in_specs=(spec, spec, spec, P(spec[0], "sp"), P(spec[2])), out_specs=(spec, lse_spec))
        sinks = jax.device_put(sinks, NamedSharding(mesh, P(spec[2])))
        with jax.set_mesh(mesh):
            out, lse = jax.jit(fn)(q, k, v, seg, sinks)
    ref = reference_for(x, causal=True, sliding_window=11)
    assert rel_err(ringjax.from_layout(out, layout, n), ref["out"]) < 1e-5
    assert rel_err(ringjax.from_layout(lse, layout, n, axis=2), ref["lse"]) < 1e-5
    # the sequence stays sharded over "sp" on the way out
    assert "sp" in str(out.sharding.spec[1])


@pytest.mark.parametrize("mesh_name", ["Mesh(dp,sp,tp)", "make_mesh(dp,sp,tp)"])
@pytest.mark.parametrize("how", ["mesh_arg", "set_mesh"])
def test_inside_a_shard_map_manual_over_data_only(mesh_name, how):
    """Data parallelism by hand (shard_map over "dp" alone), ring attention on the rest of the mesh: with
    mesh= the concrete mesh's axes are not Manual there, so the call takes the enclosing abstract mesh."""
    need_devices(8)
    mesh = MESHES[mesh_name]()
    n, layout = mesh.shape["sp"], "zigzag"
    x = make_inputs(23, batch=2, seq=32, heads=4, kv_heads=2, segments="random", sinks=True)
    spec = _spec(mesh)
    put = lambda a, s: jax.device_put(ringjax.to_layout(jnp.asarray(a), layout, n), NamedSharding(mesh, s))  # noqa: E731
    q, k, v = (put(x[name], spec) for name in ("q", "k", "v"))
    seg = put(x["segment_ids"], P(spec[0], "sp"))
    kw = dict(causal=True, layout=layout, return_lse=True, sinks=jnp.asarray(x["sinks"]))

    def per_data_shard(q, k, v, seg):
        if how == "mesh_arg":
            return ringjax.ring_attention(q, k, v, segment_ids=seg, mesh=mesh, **kw)
        return ringjax.ring_attention(q, k, v, segment_ids=seg, **kw)

    fn = jax.shard_map(per_data_shard, mesh=mesh, in_specs=(P("dp"),) * 4, out_specs=(P("dp"), P("dp")),
                       axis_names={"dp"})
    with jax.set_mesh(mesh):
        out, lse = jax.jit(fn)(q, k, v, seg)
    ref = reference_for(x, causal=True)
    assert rel_err(ringjax.from_layout(out, layout, n), ref["out"]) < 1e-5
    assert rel_err(ringjax.from_layout(lse, layout, n, axis=2), ref["lse"]) < 1e-5


def test_mesh_arg_unlike_the_enclosing_shard_map_is_refused():
    need_devices(8)
    mesh = MESHES["make_mesh(dp,sp,tp)"]()
    other = _explicit_mesh((2, 4), ("dp", "sp"))
    q = jax.device_put(jnp.ones((2, 32, 4, 16)), NamedSharding(mesh, P("dp")))
    fn = jax.shard_map(lambda q: ringjax.ring_attention(q, q, q, axis_name="sp", mesh=other), mesh=mesh,
                       in_specs=P("dp"), out_specs=P("dp"), axis_names={"dp"})
    with pytest.raises(ValueError, match="not the mesh of the enclosing shard_map"):
        jax.jit(fn)(q)


@pytest.mark.parametrize("mode", ["Mesh", "make_mesh", "make_mesh+set_mesh", "single"])
@pytest.mark.parametrize("jit", [False, True])
def test_forward_mode_is_refused_with_jax_own_message(mode, jit):
    """ring_attention is reverse-mode only (a custom VJP). Eager jax.jvp of a global call used to raise jax's
    internal "unhashable type: 'Unhashable'" from the eager shard_map; every way now gives jax's own message."""
    need_devices(4)
    q = jnp.asarray(make_inputs(23, seq=32)["q"])
    mesh = _explicit_mesh((4,), ("sp",)) if mode.startswith("make_mesh") else _auto_mesh((4,), ("sp",))
    kw = {"single": dict(axis_name=None), "make_mesh+set_mesh": {}}.get(mode, dict(mesh=mesh))

    def f(q):
        return ringjax.ring_attention(q, q, q, causal=True, **kw)

    jvp = (lambda q: jax.jvp(f, (q,), (q,))) if not jit else jax.jit(lambda q: jax.jvp(f, (q,), (q,)))
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        if mode == "make_mesh+set_mesh":
            with jax.set_mesh(mesh):
                jvp(q)
        else:
            jvp(q)


def test_global_call_on_auto_mesh_has_gradients():
    need_devices(4)
    mesh = _auto_mesh((4,), ("sp",))
    x = make_inputs(22, seq=32, sinks=True)
    q, k, v = (jnp.asarray(x[name]) for name in ("q", "k", "v"))

    def loss(q, k, v, sinks):
        out, lse = ringjax.ring_attention(q, k, v, causal=True, sinks=sinks, mesh=mesh, return_lse=True)
        return (out * x["dout"]).sum() + (lse * x["dlse"]).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, jnp.asarray(x["sinks"]))
    ref = reference_for(x, causal=True)
    for got, name in zip(grads, ("dq", "dk", "dv", "dsinks")):
        assert rel_err(got, ref[name]) < 1e-5, name


@pytest.mark.parametrize("kind", ["numpy", "jax", "jax_auto", "jax_explicit", "jit_auto", "jit_explicit",
                                  "jit_auto_out_sharding"])
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_to_and_from_layout_on_every_input_kind(kind, layout):
    need_devices(4)
    n = 4
    base = np.random.default_rng(3).standard_normal((2, 16, 3)).astype(np.float32)
    expected = base[:, np.concatenate([ringjax.layouts.local_positions(layout, s, n, 16 // n, xp=np)
                                       for s in range(n)])]
    auto, explicit = _auto_mesh((n,), ("sp",)), _explicit_mesh((n,), ("sp",))
    sharded = lambda mesh: jax.device_put(base, NamedSharding(mesh, P(None, "sp")))  # noqa: E731
    if kind == "numpy":
        y = ringjax.to_layout(base, layout, n)
        assert isinstance(y, np.ndarray)
        back = ringjax.from_layout(y, layout, n)
    elif kind == "jax":
        y = ringjax.to_layout(jnp.asarray(base), layout, n)
        back = ringjax.from_layout(y, layout, n)
    elif kind in ("jax_auto", "jax_explicit"):
        mesh = auto if kind == "jax_auto" else explicit
        xs = sharded(mesh)
        y = ringjax.to_layout(xs, layout, n)
        assert y.sharding == xs.sharding, "the input's sharding is kept"
        back = ringjax.from_layout(y, layout, n)
        assert back.sharding == xs.sharding
    elif kind == "jit_explicit":
        xs = sharded(explicit)
        with jax.set_mesh(explicit):
            y = jax.jit(lambda a: ringjax.to_layout(a, layout, n))(xs)
            back = jax.jit(lambda a: ringjax.from_layout(a, layout, n))(y)
        assert y.sharding.spec[1] == "sp", "never replicated silently"
    elif kind == "jit_auto":
        xs = sharded(auto)
        y = jax.jit(lambda a: ringjax.to_layout(a, layout, n))(xs)
        back = jax.jit(lambda a: ringjax.from_layout(a, layout, n))(y)
    else:
        xs = sharded(auto)
        target = NamedSharding(auto, P(None, "sp"))
        y = jax.jit(lambda a: ringjax.to_layout(a, layout, n, out_sharding=target))(xs)
        assert y.sharding.is_equivalent_to(target, 3)
        with jax.set_mesh(auto):
            back = jax.jit(lambda a: ringjax.from_layout(a, layout, n, out_sharding=P(None, "sp")))(y)
        assert back.sharding.spec[1] == "sp"
    np.testing.assert_array_equal(np.asarray(y), expected)
    np.testing.assert_array_equal(np.asarray(back), base)


def test_layout_then_ring_attention_under_jit_on_auto_mesh_stays_sharded():
    """Inside jit on an Auto mesh, to_layout feeds the ring exactly (its placement follows the consumer)."""
    need_devices(4)
    mesh = _auto_mesh((4,), ("sp",))
    x = make_inputs(23, seq=32)

    def f(q, k, v):
        q, k, v = (ringjax.to_layout(a, "zigzag", 4) for a in (q, k, v))
        out = ringjax.ring_attention(q, k, v, causal=True, layout="zigzag", mesh=mesh)
        return ringjax.from_layout(out, "zigzag", 4)

    sharding = NamedSharding(mesh, P(None, "sp"))
    q, k, v = (jax.device_put(x[name], sharding) for name in ("q", "k", "v"))
    out = jax.jit(f, out_shardings=sharding)(q, k, v)
    assert rel_err(out, reference_for(x, causal=True)["out"]) < 1e-5


@pytest.mark.parametrize("mode", ["single", "global"])
def test_numpy_inputs(mode):
    x = make_inputs(24, seq=32, segments="random")
    kw = dict(causal=True, segment_ids=x["segment_ids"])
    if mode == "single":
        out = ringjax.ring_attention(x["q"], x["k"], x["v"], axis_name=None, **kw)
    else:
        need_devices(4)
        out = ringjax.ring_attention(x["q"], x["k"], x["v"], mesh=_auto_mesh((4,), ("sp",)), **kw)
    assert rel_err(out, reference_for(x, causal=True)["out"]) < 1e-5


@pytest.mark.parametrize("mode", ["single", "global"])
def test_numpy_inputs_eager_gradients(mode):
    """jax.grad without jit on numpy arrays: the custom VJP's forward rule got them as numpy (and indexed them
    with traced positions)."""
    x = make_inputs(25, seq=32, segments="random", sinks=True)
    kw = dict(causal=True, segment_ids=x["segment_ids"], return_lse=True)
    if mode == "global":
        need_devices(4)
        kw["mesh"] = _auto_mesh((4,), ("sp",))
    else:
        kw["axis_name"] = None

    def loss(q, k, v, sinks):
        out, lse = ringjax.ring_attention(q, k, v, sinks=sinks, **kw)
        return (out * x["dout"]).sum() + (lse * x["dlse"]).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(x["q"], x["k"], x["v"], x["sinks"])
    ref = reference_for(x, causal=True)
    for got, name in zip(grads, ("dq", "dk", "dv", "dsinks")):
        assert rel_err(got, ref[name]) < 1e-5, name


def test_eager_global_call_is_compiled_once(monkeypatch):
    """Calling without jax.jit traces the ring once per shape and options, not once per call."""
    need_devices(4)
    mesh = _auto_mesh((4,), ("sp",))
    traces = []
    real = registry.run_per_device
    monkeypatch.setattr(registry, "run_per_device", lambda *a: traces.append(1) or real(*a))
    x = make_inputs(25, seq=32)
    q, k, v = (jax.device_put(x[name], NamedSharding(mesh, P(None, "sp"))) for name in ("q", "k", "v"))
    first = ringjax.ring_attention(q, k, v, causal=True, mesh=mesh)
    for _ in range(3):
        again = ringjax.ring_attention(q, k, v, causal=True, mesh=mesh)
    assert len(traces) == 1
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    ringjax.ring_attention(q, k, v, causal=False, mesh=mesh)  # other options: one more trace
    assert len(traces) == 2
    assert len(calling._compiled) >= 2


def test_no_mesh_error_names_single_device_mode():
    x = make_inputs(26, seq=16)
    with pytest.raises(ValueError, match="axis_name=None"):
        ringjax.ring_attention(x["q"], x["k"], x["v"])


# ----------------------------------------------------------------------------- support matrix

# every registered implementation; those for other platforms skip. "auto" takes the first that does
# not refuse, so this matrix also says that "auto" never picks one that fails.
IMPLEMENTATIONS = [r.name for r in registry.registrations("ring_attention")]
DTYPES = ["float32", "bfloat16", "float16"]
HEAD_DIMS = [64, 80, 96, 128, 256]


def _runs_here(name):
    return any(r["name"] == name and r["runs_here"] for r in ringjax.list_implementations())


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_support_matrix(impl, dtype, head_dim):
    """Each (implementation, dtype, head_dim) either matches the reference or is refused with a reason."""
    if not _runs_here(impl):
        pytest.skip(f"{impl} does not run on {jax.default_backend()}")
    x = make_inputs(27, batch=1, seq=32, heads=2, kv_heads=1, head_dim=head_dim, dtype=dtype)
    q, k, v = (jnp.asarray(x[name], dtype) for name in ("q", "k", "v"))
    opts = ringjax.options.make_options(q, causal=True, sliding_window=None, softmax_scale=None,
                                        logits_soft_cap=None, layout="contiguous", axis_name=None, axis_size=1,
                                        has_segments=False, has_sinks=False)
    problem = registry.Problem(opts=opts, batch=1, seq=32, heads=2, kv_heads=1, head_dim=head_dim, dtype=dtype,
                               platform=registry.current_platform(), precision=precision.current(dtype))
    reg = next(r for r in registry.registrations("ring_attention") if r.name == impl)
    why = registry.refusal(reg, problem)
    if why is not None:
        assert isinstance(why, str) and why.strip(), "a refusal carries a reason"
        with pytest.raises(ValueError, match=impl):
            ringjax.ring_attention(q, k, v, axis_name=None, causal=True, implementation=impl)
        return

    def loss(q, k, v):
        out, lse = ringjax.ring_attention(q, k, v, axis_name=None, causal=True, implementation=impl,
                                          return_lse=True)
        return (out.astype(jnp.float32) * x["dout"]).sum() + (lse * x["dlse"]).sum(), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert out.dtype == jnp.dtype(dtype)
    ref = reference_for(x, causal=True)
    tol = TOLERANCE[dtype]
    assert rel_err(out, ref["out"]) < tol
    assert rel_err(lse, ref["lse"]) < tol
    for got, name in zip(grads, ("dq", "dk", "dv")):
        assert rel_err(np.asarray(got, np.float32), ref[name]) < (tol if dtype == "float32" else 2 * tol), name


@pytest.mark.parametrize("framework", ["equinox", "nnx"])
def test_layers_on_an_auto_mesh_with_data_axis(framework):
    """A layer on global arrays over Mesh(devices, ("dp", "sp")) equals the same layer unsharded."""
    need_devices(8)
    mesh = _auto_mesh((2, 4), ("dp", "sp"))
    kw = dict(num_heads=4, num_kv_heads=2, causal=True, sliding_window=9)
    x = np.random.default_rng(31).standard_normal((2, 32, 32)).astype(np.float32)
    xs = jax.device_put(ringjax.to_layout(x, "zigzag", 4), NamedSharding(mesh, P("dp", "sp")))
    if framework == "equinox":
        pytest.importorskip("equinox")
        from ringjax.equinox import MultiHeadAttention

        ring = MultiHeadAttention(32, axis_name="sp", layout="zigzag", key=jax.random.key(2), **kw)
        dense = MultiHeadAttention(32, axis_name=None, key=jax.random.key(2), **kw)
    else:
        nnx = pytest.importorskip("flax.nnx")
        from ringjax.flax import MultiHeadAttention

        ring = MultiHeadAttention(32, axis_name="sp", layout="zigzag", rngs=nnx.Rngs(2), **kw)
        dense = MultiHeadAttention(32, axis_name=None, rngs=nnx.Rngs(2), **kw)
    with jax.default_matmul_precision("highest"):
        with jax.set_mesh(mesh):
            out = ring(xs)  # eager, as a user tries it first
        want = dense(jnp.asarray(x))
    assert rel_err(ringjax.from_layout(np.asarray(out), "zigzag", 4), want) < 1e-5


# ------------------------------------------------------ every public function, global and local

def _public_calls(x, dtype):
    """(function, positional arrays, in_specs over ("dp", "sp"), keyword arguments) per public function."""
    q, k, v = (jnp.asarray(x[name], dtype) for name in ("q", "k", "v"))
    bsd, tok = P("dp", "sp"), P("sp")
    cu = jnp.asarray([0, 5, 5, 19, 40, 64], jnp.int32)  # an empty sequence, lengths across shard edges
    flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731  (batch 1 for varlen)
    return {
        "ring_attention": (ringjax.ring_attention, (q, k, v), (bsd,) * 3,
                           dict(causal=True, sliding_window=13, logits_soft_cap=5.0)),
        "ring_attention_kvpacked": (ringjax.ring_attention_kvpacked, (q, jnp.stack([k, v], axis=2)), (bsd,) * 2,
                                    dict(causal=True)),
        "ring_attention_qkvpacked": (ringjax.ring_attention_qkvpacked, (jnp.stack([q[:, :, :2], k, v], axis=2),),
                                     (bsd,),
                                     dict(causal=True, sliding_window=9)),
        "ring_attention_varlen": (ringjax.ring_attention_varlen, (flat(q[:1]), flat(k[:1]), flat(v[:1]), cu),
                                  (tok, tok, tok, P()), dict(causal=True)),
        "dilated_attention": (ringjax.dilated_attention, (q, k, v), (bsd,) * 3,
                              dict(segment_lengths=[16, 32], dilation_rates=[1, 2], causal=True)),
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["global", "shard_map"])
@pytest.mark.parametrize("name", ["ring_attention", "ring_attention_kvpacked", "ring_attention_qkvpacked",
                                  "ring_attention_varlen", "dilated_attention"])
def test_every_public_function_on_global_and_local_arrays(name, mode, dtype):
    """Each public attention function on an Auto (dp, sp) mesh equals its single-device call."""
    need_devices(8)
    mesh = _auto_mesh((2, 4), ("dp", "sp"))
    x = make_inputs(28, batch=2, seq=64, heads=4, kv_heads=2, head_dim=64, dtype=dtype)
    fn, args, specs, kw = _public_calls(x, dtype)[name]
    expected = fn(*args, axis_name=None, **kw)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    if mode == "global":
        got = fn(*placed, mesh=mesh, **kw)
    else:
        local = jax.shard_map(lambda *a: fn(*a, axis_name="sp", **kw), mesh=mesh, in_specs=specs,
                              out_specs=specs[0])
        with jax.set_mesh(mesh):
            got = jax.jit(local)(*placed)
    assert got.dtype == jnp.dtype(dtype) and got.shape == expected.shape
    assert "sp" in str(got.sharding.spec)
    assert rel_err(np.asarray(got, np.float32), np.asarray(expected, np.float32)) < TOLERANCE[dtype]
