"""A Pallas call's operands under names, so that kernels take their refs by name, not by position.

The launcher adds each array with its BlockSpec (`Operands.add`), or a run of them under one
name (`add_group`, e.g. optional tables); the kernel gets `Refs(layout, refs)` and reads
`r.q`, `r.tables`. Outputs and scratch can be named the same way; the layouts are
concatenated in the order the kernel receives its refs.
"""

from __future__ import annotations

from typing import Any


class Operands:
    """Arrays (or output shapes) with their BlockSpecs, in call order, each under a name."""

    def __init__(self):
        self.arrays: list[Any] = []
        self.specs: list[Any] = []
        self.layout: tuple[tuple[str, int | None], ...] = ()  # (name, None for one ref or a group's length)

    def add(self, name: str, array, spec=None) -> Operands:
        self.arrays.append(array)
        self.specs.append(spec)
        self.layout += ((name, None),)
        return self

    def add_group(self, name: str, arrays, specs) -> Operands:
        self.arrays += list(arrays)
        self.specs += list(specs)
        self.layout += ((name, len(arrays)),)
        return self

    def index(self, name: str) -> int:
        """Position of the single operand `name` among the arrays (for input_output_aliases)."""
        i = 0
        for key, count in self.layout:
            if key == name:
                return i
            i += 1 if count is None else count
        raise KeyError(name)


class Refs:
    """The refs a kernel received, by the names of `layout`: `r.q` (a name the layout lacks is an
    error), `r.get("qseg")` for operands that may be absent (None then)."""

    def __init__(self, layout, refs):
        self._by_name: dict[str, Any] = {}
        i = 0
        for name, count in layout:
            self._by_name[name] = refs[i] if count is None else tuple(refs[i:i + count])
            i += 1 if count is None else count
        if i != len(refs):
            raise ValueError(f"kernel got {len(refs)} refs, its layout names {i}")

    def __getattr__(self, name: str):
        if name.startswith("_"):  # private attributes are never operands (and _by_name may not exist yet)
            raise AttributeError(name)
        try:
            return self._by_name[name]
        except KeyError:
            raise AttributeError(f"no kernel operand named {name!r}; the layout has {sorted(self._by_name)}") from None

    def get(self, name: str):
        return self._by_name.get(name)
