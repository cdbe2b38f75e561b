"""The small decoder-only transformer the examples share (Equinox; ringjax attention in every block).

`Transformer(vocab, d_model, layers, heads, kv_heads, key=..., **attention)` builds its blocks'
`ringjax.equinox.MultiHeadAttention(d_model, heads, num_kv_heads=kv_heads, causal=True, **attention)`;
calling it with `caches` (one `ringjax.KVCache` per layer) runs the layers in decode mode and returns the
caches with the new tokens appended; other keyword arguments (e.g. `segment_ids`) go to every attention call.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ringjax.equinox import MultiHeadAttention


def rms_norm(x, weight, eps=1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + eps) * weight).astype(x.dtype)


class Block(eqx.Module):
    attn: MultiHeadAttention
    norm1: jax.Array
    norm2: jax.Array
    w_in: jax.Array
    w_out: jax.Array

    def __init__(self, d_model, heads, kv_heads, *, key, **attention):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attn = MultiHeadAttention(d_model, heads, num_kv_heads=kv_heads, causal=True, key=k1, **attention)
        self.norm1 = jnp.ones(d_model)
        self.norm2 = jnp.ones(d_model)
        self.w_in = jax.random.normal(k2, (d_model, 4 * d_model)) / np.sqrt(d_model)
        self.w_out = jax.random.normal(k3, (4 * d_model, d_model)) / np.sqrt(4 * d_model)

    def __call__(self, x, cache=None, **kw):
        h = rms_norm(x, self.norm1)
        if cache is None:
            a = self.attn(h, **kw)
        else:
            a, cache = self.attn(h, cache=cache, **kw)
        x = x + a
        x = x + jax.nn.gelu(rms_norm(x, self.norm2) @ self.w_in) @ self.w_out
        return x, cache


class Transformer(eqx.Module):
    embed: jax.Array
    blocks: list
    norm: jax.Array
    unembed: jax.Array

    def __init__(self, vocab, d_model, layers, heads, kv_heads, *, key, **attention):
        keys = jax.random.split(key, layers + 2)
        self.embed = jax.random.normal(keys[0], (vocab, d_model))
        self.blocks = [Block(d_model, heads, kv_heads, key=k, **attention) for k in keys[2:]]
        self.norm = jnp.ones(d_model)
        self.unembed = jax.random.normal(keys[1], (d_model, vocab)) / np.sqrt(d_model)

    def __call__(self, tokens, caches=None, **kw):
        """tokens [batch, t] -> logits [batch, t, vocab], and the caches with these tokens appended (None
        without caches)."""
        x = self.embed[tokens]
        new = []
        for i, block in enumerate(self.blocks):
            x, cache = block(x, None if caches is None else caches[i], **kw)
            new.append(cache)
        logits = rms_norm(x, self.norm) @ self.unembed
        return logits, (None if caches is None else new)
