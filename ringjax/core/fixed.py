"""Exact sums in fixed point: float32 values on a power-of-two grid, held as int32 limbs.

Integer addition is associative, so a fixed-point sum has the same bits whatever the order and grouping of
its terms: on any ring size, layout or number of partial sums. `deterministic="invariant"` sums every
partial result of the ring this way (`core.invariant`).

A value on grid `e` is the integer X = round(x / 2**e), held as LIMBS int32 limbs of LIMB_BITS bits, least
significant first, along a new leading axis: X = sum_i limbs[i] * 2**(LIMB_BITS * i). Normalised, every limb
but the last lies in [0, 2**LIMB_BITS) and the last carries the sign, so each integer has one form.
`exponent(bound)` puts a bound on |x| (and on every partial sum) below 2**(e + HEADROOM): the grid is then
2**-HEADROOM of the bound, far finer than float32's 2**-24 of the values themselves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

LIMB_BITS = 16
LIMBS = 5  # 80 bits: a sum of up to 2**15 terms of 16-bit limbs stays within int32 before carries
HEADROOM = 76  # bits between the grid and a bound; the top limb keeps int32's spare bits for carries
_MOST_TERMS = 1 << 14  # terms one integer reduction adds before its carries are propagated


def exponent(bound) -> jax.Array:
    """int32 grid exponent e with `bound` < 2**(e + HEADROOM): |x| <= bound for every term and partial sum."""
    # a bound that overflowed float32 (huge inputs) still gives a grid: values past it are inf anyway
    bound = jnp.minimum(jnp.asarray(bound, jnp.float32), jnp.finfo(jnp.float32).max)
    _, ex = jnp.frexp(bound)
    return (ex - HEADROOM).astype(jnp.int32)


def encode(x, e) -> jax.Array:
    """int32 limbs [LIMBS, *x.shape] of round(x / 2**e); `e` broadcasts against x.

    Every float32 step is exact: scaling by a power of two, `floor`, and each subtraction, which keeps a
    subset of the bits of |X| (at most 24). The sign multiplies every limb, so the limbs are not normalised.
    """
    y = jnp.round(jnp.ldexp(x.astype(jnp.float32), -e))
    a = jnp.abs(y)
    limbs = []
    for i in range(LIMBS - 1, 0, -1):
        top = jnp.floor(a * 2.0 ** (-LIMB_BITS * i))
        a = a - top * 2.0 ** (LIMB_BITS * i)
        limbs.append(top)
    limbs.append(a)
    sign = jnp.sign(y)
    return jnp.stack([(sign * limb).astype(jnp.int32) for limb in reversed(limbs)])


def normalize(limbs) -> jax.Array:
    """The one normal form of the same integer: carries propagated from the least significant limb."""
    out, carry = [], 0
    for i in range(LIMBS):
        limb = limbs[i] + carry
        if i == LIMBS - 1:
            out.append(limb)
            break
        carry = limb >> LIMB_BITS  # arithmetic shift: floor division, so the kept limb is in [0, 2**LIMB_BITS)
        out.append(limb & ((1 << LIMB_BITS) - 1))
    return jnp.stack(out)


def add(a, b) -> jax.Array:
    """a + b, normalised (either may be unnormalised limbs of one encoded term)."""
    return normalize(a + b)


def total(limbs, axis: int | tuple[int, ...]) -> jax.Array:
    """The exact sum over `axis` of the values (axes of the values, not counting the limb axis)."""
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = tuple(a % (limbs.ndim - 1) + 1 for a in axes)
    x = jnp.moveaxis(limbs, axes, tuple(range(limbs.ndim - len(axes), limbs.ndim)))
    x = x.reshape(*x.shape[:x.ndim - len(axes)], -1)
    while x.shape[-1] > 1:
        n = x.shape[-1]
        groups = -(-n // _MOST_TERMS)
        pad = groups * _MOST_TERMS - n if groups > 1 else 0
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
        x = x.reshape(*x.shape[:-1], groups, -1)
        x = normalize(x.sum(axis=-1))
    return x[..., 0]


def psum(limbs, axis_name) -> jax.Array:
    """The exact sum over a mesh axis (integer all-reduce), normalised; `axis_name` None: unchanged."""
    if axis_name is None:
        return limbs
    return normalize(lax.psum(limbs, axis_name))


def decode(limbs, e) -> jax.Array:
    """float32 value of normalised limbs on grid `e`: Horner's rule from the top limb, a function of the
    integer alone (its normal form is unique), within a few float32 roundings of it."""
    acc = limbs[LIMBS - 1].astype(jnp.float32)
    for i in range(LIMBS - 2, -1, -1):
        acc = acc * float(1 << LIMB_BITS) + limbs[i].astype(jnp.float32)
    return jnp.ldexp(acc, e)


def zeros(shape) -> jax.Array:
    return jnp.zeros((LIMBS, *shape), jnp.int32)
