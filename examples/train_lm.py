"""Train a small decoder-only transformer with sequence-parallel ring attention.

The mesh has a data axis (batch) and a sequence axis ("sp", ring attention); the
sequence is stored in the zigzag layout, which balances causal work over the ring,
and holds packed documents separated by segment ids. The data is made here: each
document is an arithmetic sequence of tokens (start and stride random per
document, modulo the vocabulary), so the next token is predictable from the two
before it and the loss falls well below log(vocab).

On CPU it simulates 8 devices (a 2 x 4 mesh); on GPUs it uses the real ones.

    python examples/train_lm.py --steps 200 --seq-len 512
    python examples/train_lm.py --data 1 --sp 8   # all devices on the ring

Needs: pip install -e ".[examples]"  (equinox, optax, matplotlib, tqdm)
"""

from __future__ import annotations

import argparse
import os
import time

if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # simulated devices for CPU runs; ignored by GPU backends
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _model import Transformer  # examples/_model.py: examples/ is on sys.path when its scripts run
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

import ringjax


def make_batch(rng, batch, seq, vocab, *, min_doc, max_doc, max_stride=4):
    """Packed arithmetic-sequence documents, natural order: tokens, targets, loss mask, segment ids."""
    tokens = np.zeros((batch, seq), np.int32)
    segments = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        t, doc = 0, 0
        while t < seq:
            n = min(int(rng.integers(min_doc, max_doc + 1)), seq - t)
            start, stride = rng.integers(vocab), rng.integers(1, max_stride + 1)
            tokens[b, t:t + n] = (start + stride * np.arange(n)) % vocab
            segments[b, t:t + n] = doc
            t, doc = t + n, doc + 1
    # predict token t+1 from tokens <= t, only inside a document
    targets = np.concatenate([tokens[:, 1:], np.zeros((batch, 1), np.int32)], axis=1)
    mask = np.concatenate([segments[:, 1:] == segments[:, :-1], np.zeros((batch, 1), bool)], axis=1)
    return tokens, targets, mask.astype(np.float32), segments


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=256, help="global sequence length")
    p.add_argument("--batch", type=int, default=8, help="global batch size")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-doc", type=int, default=8, help="shortest packed document")
    p.add_argument("--max-doc", type=int, default=64, help="longest packed document")
    p.add_argument("--data", type=int, default=None, help="data-parallel mesh axis size (default: devices / sp)")
    p.add_argument("--sp", type=int, default=None, help="sequence (ring) axis size (default: 4, or all devices)")
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "contiguous", "striped"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def make_mesh(data, sp):
    n = len(jax.devices())
    if sp is None:
        sp = 4 if n % 4 == 0 and (data is None or data * 4 <= n) else n // (data or 1)
    if data is None:
        data = n // sp
    if data * sp > n or data < 1 or sp < 1:
        raise ValueError(f"mesh {data} x {sp} needs {data * sp} devices, {n} available")
    return jax.make_mesh((data, sp), ("data", "sp"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[: data * sp])


def main(argv=None) -> dict:
    """Train; returns {"losses": [...], "tokens_per_s": float, "mesh": {...}}."""
    args = parse_args(argv)
    mesh = make_mesh(args.data, args.sp)
    data, sp = mesh.shape["data"], mesh.shape["sp"]
    if args.batch % data:
        raise ValueError(f"--batch {args.batch} must be divisible by the data axis ({data})")
    chunks = sp * (2 if args.layout == "zigzag" else 1)
    if args.seq_len % chunks:
        raise ValueError(f"--seq-len {args.seq_len} must be divisible by {chunks} for layout {args.layout}")

    model = Transformer(args.vocab, args.d_model, args.layers, args.heads, args.kv_heads, key=jax.random.key(args.seed),
                        axis_name="sp", layout=args.layout)
    params, static = eqx.partition(model, eqx.is_array)
    optimizer = optax.adamw(args.lr, weight_decay=0.0)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(optimizer.init(params), replicated)
    seq_spec = P("data", "sp")

    def local_loss(params, tokens, targets, mask, segments):
        logits, _ = eqx.combine(params, static)(tokens, segment_ids=segments)
        logits = logits.astype(jnp.float32)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        total = jax.lax.psum((nll * mask).sum(), ("data", "sp"))
        return total / jax.lax.psum(mask.sum(), ("data", "sp"))

    loss_fn = jax.shard_map(local_loss, mesh=mesh, in_specs=(P(),) + (seq_spec,) * 4, out_specs=P())

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(args.seed)
    sharding = NamedSharding(mesh, seq_spec)

    def next_batch():
        arrays = make_batch(rng, args.batch, args.seq_len, args.vocab, min_doc=args.min_doc, max_doc=args.max_doc)
        # the layout permutes the sequence; every per-token array gets the same permutation
        return tuple(jax.device_put(ringjax.to_layout(a, args.layout, sp, axis=1), sharding) for a in arrays)

    tokens_per_step = args.batch * args.seq_len
    losses, times = [], []
    bar = tqdm(range(args.steps), disable=args.no_progress, desc=f"train {data}x{sp} {args.layout}")
    for _ in bar:
        batch = next_batch()
        start = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, batch)
        loss = float(loss)  # waits for the step
        times.append(time.perf_counter() - start)
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / times[-1]:,.0f}")
    steady = times[1:] or times  # the first step compiles
    tokens_per_s = tokens_per_step * len(steady) / sum(steady)
    device = jax.devices()[0]
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (log vocab = {np.log(args.vocab):.3f}); "
          f"{tokens_per_s:,.0f} tokens/s on a {data}x{sp} mesh of {device.device_kind} ({device.platform}), "
          f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
    return {"losses": losses, "tokens_per_s": tokens_per_s, "mesh": dict(mesh.shape)}


if __name__ == "__main__":
    main()
