"""What a call runs and why: the implementation, its config, the strategy, every candidate's predicted
time and every refusal. `ring_attention` logs it to the "ringjax.implementation" logger at INFO level
once per compiled problem; `python -m ringjax explain` prints it without running anything.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any

from ringjax.core import invariant
from ringjax.dispatch import costs, registry

log = logging.getLogger("ringjax.implementation")


@dataclasses.dataclass(frozen=True)
class Report:
    op: str
    asked: str  # the `implementation` argument
    problem: registry.Problem  # one device's, under the chosen strategy
    implementation: str
    config: Any
    config_source: str  # explicit | memory | persistent | shipped | autotuned | heuristic
    strategy: str  # Strategy.describe()
    strategy_reason: str
    candidates: tuple[registry.Candidate, ...]
    calibration: str  # the calibration file behind the predictions, "" if none
    config_note: str = ""  # what the config changes that it does not say (`Implementation.config_note`)

    def __str__(self) -> str:
        p = self.problem
        try:
            config = json.dumps(registry.config_to_json(self.config), sort_keys=True)
        except TypeError:
            config = repr(self.config)
        precision = f" at matmul precision {p.precision!r}" if p.dtype == "float32" else ""
        masks = ", ".join((("causal",) if p.opts.causal else ()) + costs.cost_features(p.opts)) or "no mask"
        if p.opts.has_segments:
            docs = costs.known_documents(p)
            masks += ", segments" + ("" if docs is None else
                                     f" ({sum(n > 0 for row in docs for n in row) / len(docs):.3g} documents "
                                     "per row, from the ids)")
        v_dim = "" if p.v_head_dim == p.head_dim else f" (v {p.v_head_dim})"
        # which backward that runs, where a config asked for a fused one, is its implementation's config_note
        deterministic = "; deterministic gradients" if p.opts.deterministic else ""
        if p.opts.invariant:
            g = invariant.granule(p.seq * p.opts.axis_size)
            deterministic = f"; deterministic='invariant': kernels on {g}-token granule pairs, summed in fixed point"
        # subshards: each device's tokens are that many layout shards, concatenated (a hybrid's all-to-all)
        layout = p.opts.layout + (f" in {p.opts.subshards} subshards" if p.opts.subshards > 1 else "")
        lines = [
            f"{self.op}/{self.implementation}: {self.config_source} config {config}; strategy {self.strategy} "
            f"({self.strategy_reason})",
            f"  per device: batch {p.batch}, seq {p.seq}, heads {p.heads}/{p.kv_heads} kv, "
            f"head_dim {p.head_dim}{v_dim}, {p.dtype}{precision}, {masks}; "
            f"{p.opts.axis_size} on the ring, layout {layout}; {p.device_kind or p.platform}{deterministic}",
        ]
        if self.config_note:
            lines.append(f"  {self.config_note}")
        if self.asked != "auto":
            lines.append(f"  implementation={self.asked!r} was asked for")
        elif self.calibration and any(c.prediction for c in self.candidates):
            lines.append(f"  auto: the fastest predicted forward + backward (calibration {self.calibration})")
        else:
            lines.append(f"  auto: by priority, nothing is measured for {p.device_kind or p.platform!r} "
                         "(python -m ringjax calibrate measures it)")
        for c in self.candidates:
            mark = "*" if c.name == self.implementation else " "
            if c.refusal is not None:
                lines.append(f"  {mark} {c.name}: refused: {c.refusal}")
            elif c.prediction is not None:
                lines.append(f"  {mark} {c.name}: predicted {c.prediction.describe()}")
            else:
                missing = " (not in the calibration)" if self.calibration else ""
                lines.append(f"  {mark} {c.name}: no prediction{missing}")
        return "\n".join(lines)


def build(op: str, asked: str, problem: registry.Problem, implementation: str, config, config_source: str,
          strategy: str, strategy_reason: str) -> Report:
    """The report of one call; candidates are those "auto" considers, and the asked one."""
    found = registry.candidates(op, "auto", problem)
    if asked != "auto" and all(c.name != implementation for c in found):
        found = registry.candidates(op, asked, problem) + found
    calibration = costs.for_problem(problem)
    reg = next((r for r in registry.registrations(op) if r.name == implementation), None)
    note = getattr(reg.load(), "config_note", None) if reg is not None and config is not None else None
    return Report(op, asked, problem, implementation, config, config_source, strategy, strategy_reason,
                  tuple(found), calibration.where if calibration else "", note(problem, config) if note else "")


def announce(make: Callable[[], Report]) -> None:
    """Log `make()` at INFO if the logger would show it (not while autotuning collects problems)."""
    from ringjax.dispatch import autotuning

    if log.isEnabledFor(logging.INFO) and autotuning.recorder() is None:
        log.info("%s", make())
