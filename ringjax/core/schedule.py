"""Which ring steps a mask leaves non-empty, and in what order they are visited.

At step s device r holds the K/V shard of source (r + offset - s) mod N. A full
ring has offset 0 and N steps. A sliding window on the contiguous layout only
needs the shards that overlap [first query - left, last query + right], so K/V
start `offset` shards ahead and the ring stops after that span: fewer steps and
fewer transfers.
"""

from __future__ import annotations

import dataclasses

from ringjax.options import AttentionOptions


@dataclasses.dataclass(frozen=True)
class RingPlan:
    offset: int  # device r starts with the K/V of shard r + offset
    num_steps: int
    # sink tokens the shortened ring would not reach get one extra step of their own
    sink_step: bool = False

    def source(self, shard, step: int, axis_size: int):
        """Index of the shard whose K/V a device holds at `step` (shard may be traced)."""
        return (shard + self.offset - step) % axis_size

    @property
    def home_shift(self) -> int:
        """Shift that returns an accumulator from the last step's holder to its owner."""
        return self.offset - self.num_steps + 1


def reach(opts: AttentionOptions) -> tuple[int, int] | None:
    """How far (left, right) in positions a query can see, if the mask bounds it."""
    bounds = []
    if opts.window is not None:
        bounds.append(opts.window)
    if opts.chunk_size is not None:
        c = opts.chunk_size - 1
        bounds.append((c, 0 if opts.causal else c))
    if not bounds:
        return None
    return min(b[0] for b in bounds), min(b[1] for b in bounds)


def ring_plan(opts: AttentionOptions, local_len: int) -> RingPlan:
    n = opts.axis_size
    span = reach(opts)
    # with subshards a device's tokens are spread over the sequence: every shard may be in reach
    if opts.layout == "contiguous" and opts.subshards == 1 and span is not None:
        left, right = span
        back = -(-left // local_len)  # ceil: shards behind that the window reaches
        ahead = -(-right // local_len)
        # sinks of packed segments can sit on any shard: those need the whole ring
        if back + ahead + 1 < n and not (opts.num_sink_tokens and opts.has_segments):
            return RingPlan(offset=ahead, num_steps=back + ahead + 1, sink_step=opts.num_sink_tokens > 0)
    return RingPlan(offset=0, num_steps=n)


def steps_may_be_empty(opts: AttentionOptions) -> bool:
    """Whether a whole ring step can be masked out for some device (static).

    Zigzag and striped spread every shard over the sequence, so causal and window
    masks never empty a whole step there; segments and chunks can, under any layout.
    """
    if opts.axis_size == 1:
        return False
    if opts.has_segments or opts.chunk_size is not None:
        return True
    return opts.layout == "contiguous" and (opts.causal or opts.window is not None)
