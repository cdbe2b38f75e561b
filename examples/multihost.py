"""Ring attention across processes: one program per host, one ring over every device.

Start one copy per process with the same --coordinator (process 0's address):

    # two processes with 4 simulated CPU devices each, on one machine
    python examples/multihost.py --process-id 0 --num-processes 2 --coordinator 127.0.0.1:12355 --cpu-devices 4 &
    python examples/multihost.py --process-id 1 --num-processes 2 --coordinator 127.0.0.1:12355 --cpu-devices 4

On a GPU cluster, run one copy per host (or let `jax.distributed.initialize()`
detect SLURM / Open MPI / Kubernetes settings: pass no --coordinator). One copy per GPU
of one host works too (`--local-device-ids 0`, `1`, ...: each process sees every GPU and
uses its own). The Mosaic GPU fused ring (`--fused`) needs one process for all GPUs and is
refused with a reason otherwise.

Every process builds the same global inputs from --seed and feeds only its own
devices' shards (`jax.make_array_from_callback`); the sequence is sharded over all
global devices, so K/V shards travel between processes as part of the ring (over
gloo TCP on CPU, NCCL on GPUs). With --out, process 0 gathers the inputs, the
outputs and the gradients in natural token order and saves them (.npz).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ringjax


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (default: auto-detect a cluster)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.add_argument("--cpu-devices", type=int, default=None, help="simulated CPU devices in this process")
    p.add_argument("--timeout", type=int, default=120, help="seconds to wait for the other processes")
    p.add_argument("--local-device-ids", default=None,
                   help="comma-separated local GPU ids this process uses (one process per GPU: its index)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128, help="global sequence length")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous", "striped"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--implementation", default="auto", help="ringjax implementation (default auto)")
    p.add_argument("--fused", action="store_true",
                   help="the Mosaic GPU fused ring (implementation pallas_mosaic_gpu, MosaicGpuConfig(fused=True))")
    p.add_argument("--deterministic", default="false", choices=["false", "true", "invariant"],
                   help="ring_attention's deterministic (invariant: the same bits as on any other number of devices)")
    p.add_argument("--out", default=None, help="process 0 saves inputs, outputs and gradients here (.npz)")
    return p.parse_args(argv)


def make_inputs(args):
    """The same global inputs on every process (natural token order, float32)."""
    rng = np.random.default_rng(args.seed)
    b, t, h, kvh, d = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim
    x = {
        "q": rng.standard_normal((b, t, h, d)),
        "k": rng.standard_normal((b, t, kvh, d)),
        "v": rng.standard_normal((b, t, kvh, d)),
        "dout": rng.standard_normal((b, t, h, d)),
        "dlse": rng.standard_normal((b, h, t)),
        "sinks": rng.standard_normal(h),
    }
    x = {name: val.astype(np.float32) for name, val in x.items()}
    # packed documents; boundaries fall inside shards of both processes
    cuts = np.sort(rng.choice(np.arange(1, t), size=5, replace=False))
    x["segment_ids"] = np.broadcast_to(np.searchsorted(cuts, np.arange(t), side="right"), (b, t)).astype(np.int32)
    return x


def main(argv=None):
    args = parse_args(argv)
    if args.cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    kw = {}
    if args.coordinator is not None and args.process_id == 0:
        # listen on the coordinator's own address, not on every interface
        kw["coordinator_bind_address"] = args.coordinator
    if args.local_device_ids is not None:
        kw["local_device_ids"] = [int(i) for i in args.local_device_ids.split(",")]
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               initialization_timeout=args.timeout, **kw)
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("sp",), axis_types=(AxisType.Explicit,))
    x = make_inputs(args)

    def global_array(a, spec, seq_axis=None):
        """This process's shards of global array `a`, put in `layout` order along `seq_axis`."""
        if seq_axis is not None:
            a = ringjax.to_layout(a, args.layout, n, axis=seq_axis)
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    seq = P(None, "sp")
    q, k, v, dout = (global_array(x[name].astype(args.dtype), seq, 1) for name in ("q", "k", "v", "dout"))
    deterministic = {"false": False, "true": True}.get(args.deterministic, args.deterministic)
    options = dict(implementation=args.implementation, deterministic=deterministic)
    if args.fused:
        from ringjax.backends.pallas_mosaic_gpu import MosaicGpuConfig

        options = dict(implementation="pallas_mosaic_gpu", config=MosaicGpuConfig(fused=True),
                       deterministic=deterministic)
    seg = global_array(x["segment_ids"], seq, 1)
    dlse = global_array(x["dlse"], P(None, None, "sp"), 2)
    sinks = global_array(x["sinks"], P())

    def loss(q, k, v, sinks, seg, dout, dlse):  # global arrays must be arguments, not closed over
        out, lse = ringjax.ring_attention(q, k, v, axis_name="sp", causal=True, layout=args.layout,
                                          segment_ids=seg, sinks=sinks, return_lse=True, **options)
        value = (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum()
        value = value + jnp.where(jnp.isfinite(lse), lse * dlse, 0.0).sum()
        return value, (out, lse)

    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        (value, (out, lse)), (dq, dk, dv, dsinks) = step(q, k, v, sinks, seg, dout, dlse)

    def gather(a, seq_axis):
        full = np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return full if seq_axis is None else ringjax.from_layout(full, args.layout, n, axis=seq_axis)

    result = {"out": gather(out, 1), "lse": gather(lse, 2), "dq": gather(dq, 1), "dk": gather(dk, 1),
              "dv": gather(dv, 1), "dsinks": gather(dsinks, None)}
    result = {name: val.astype(np.float32) for name, val in result.items()}  # bf16 does not survive .npz
    print(f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} local of {n} devices, "
          f"loss {float(value):.6f}", flush=True)
    if args.out is not None and jax.process_index() == 0:
        np.savez(args.out, **x, **result, num_devices=n, num_processes=jax.process_count())
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
