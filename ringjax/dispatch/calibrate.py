"""Building calibration files (`dispatch/costs.py`): from benchmark results, or measured here.

    python -m ringjax calibrate                                   # measure on this machine's devices
    python -m ringjax calibrate --from-results benchmarks/results/*.jsonl
    python -m ringjax calibrate --from-results FILE --candidates  # and every implementation coverage timed

Either way the rows are merged into the device kind's existing file (a row replaces the one with the
same implementation, dtype, precision, shape and features; the newest measurement wins) and the file
is written to the user's calibration folder, or with `--shipped` to `ringjax/configs/calibration/`.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ringjax.dispatch import costs

# the coverage suite's cases (benchmarks/bench.py coverage_features) as ringjax.options.TUNABLE keywords;
# "window" and "chunk" name the suite's options
_COVERAGE = {
    "plain": {}, "float32": {}, "alibi": {"alibi": True}, "dropout": {"dropout_rate": 0.1},
    "sink_tokens": {"num_sink_tokens": 4, "sliding_window": "window"}, "chunked": {"chunk_size": "chunk"},
    "segments": {"segments": True}, "chunked_documents": {"chunk_size": "chunk", "segments": True},
    "sink_tokens_documents": {"num_sink_tokens": 4, "sliding_window": "window", "segments": True},
    "soft_cap": {"logits_soft_cap": 30.0}, "window": {"sliding_window": "window"},
    "learnable_sinks": {"sinks": True},
}
_SHAPE = ("batch", "heads", "kv_heads", "head_dim", "dtype")


def row_key(row: Mapping[str, Any]) -> str:
    """What a measurement measured (rows with equal keys replace each other)."""
    return json.dumps({k: row.get(k) for k in ("implementation", "dtype", "precision", "batch", "seq", "heads",
                                               "kv_heads", "head_dim", "features")}, sort_keys=True)


def kernel_row(result: Mapping[str, Any], source: str) -> dict[str, Any] | None:
    """A calibration row from one line of a benchmark results file, or None if it is no one-device
    ringjax measurement (other libraries, multi-device suites, failures, unknown coverage cases, config A/B rows)."""
    case = result.get("case", {})
    if result.get("device_count", 1) != 1 or "fwd_ms" not in result or result.get("error"):
        return None
    if "variant" in case:  # an A/B of configs (`bench.py step --variant`), not what the library runs by itself
        return None
    if case.get("v_head_dim") is not None:  # multi-head latent attention: the cost model prices v at q's head_dim
        return None
    suite = result.get("suite")
    features: dict[str, Any]
    if suite == "coverage":
        name = case.get("feature", "")
        if name not in _COVERAGE and not name.startswith("head_dim="):
            return None
        options = result.get("options", {})
        features = {k: options.get(v, v) if isinstance(v, str) else v for k, v in _COVERAGE.get(name, {}).items()}
    elif suite in ("step", "precision") and case.get("library") == "ringjax":
        features = {}
    else:
        return None
    if case.get("causal"):
        features["causal"] = True
    row = {"implementation": result["implementation"], **{k: case[k] for k in _SHAPE}, "seq": case["T"],
           "features": features, "fwd_ms": result["fwd_ms"], "fwd_bwd_ms": result.get("fwd_bwd_ms"),
           "source": source, "measured": result.get("time", "")}
    if (result.get("options", {}).get("back_to_back") or 1) > 1:  # calls per timed sample; absent: each synced
        row["back_to_back"] = result["options"]["back_to_back"]
    if case["dtype"] == "float32":
        row["precision"] = case.get("precision", "default")
    return row


def candidate_rows(result: Mapping[str, Any], source: str, row: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The rows of every implementation a `coverage --candidates` line timed beside auto's (each with the config
    it runs by itself), auto's own included; [] for any other line. `row`: the line's `kernel_row`, if computed."""
    row = kernel_row(result, source) if row is None else row
    if row is None or "candidates" not in result:
        return []
    others = [{**row, "implementation": name, "fwd_ms": c["fwd_ms"], "fwd_bwd_ms": c["fwd_bwd_ms"],
               "source": f"{source}, candidates"}
              for name, c in result["candidates"].items()
              if name != row["implementation"] and c.get("fwd_ms") and c.get("fwd_bwd_ms")]
    return [row, *others]


def rows_from_results(paths: Iterable[str | Path], candidates: bool = False) -> tuple[str, list[dict[str, Any]]]:
    """(device kind, kernel rows) of benchmark results files of one device kind; `candidates`: also the rows of
    every implementation `coverage --candidates` timed (`candidate_rows`)."""
    kinds, rows = set(), []
    for path in paths:
        path = Path(path)
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            result = json.loads(line)
            source = f"benchmarks/results/{path.name}"
            row = kernel_row(result, source)
            found = [] if row is None else (candidate_rows(result, source, row) if candidates else []) or [row]
            if found:
                kinds.add(result["device_kind"])
                rows.extend(found)
    if len(kinds) > 1:
        raise ValueError(f"results of several device kinds {sorted(kinds)}: calibrate one at a time")
    if not kinds:
        raise ValueError("no one-device ringjax measurements in these files (suites step, coverage, precision)")
    return kinds.pop(), rows


def merge(doc: dict[str, Any], kernels: Sequence[Mapping] = (), collectives: Sequence[Mapping] = ()) -> dict:
    """`doc` with `kernels` and `collectives` rows added; a row replaces an older one with the same key."""
    out = dict(doc)
    by_key = {row_key(r): r for r in doc["kernels"]}
    for row in kernels:
        old = by_key.get(row_key(row))
        if old is None or str(row.get("measured", "")) >= str(old.get("measured", "")):
            by_key[row_key(row)] = dict(row)
    out["kernels"] = sorted(by_key.values(), key=row_key)
    coll = {json.dumps([r["collective"], r["devices"], r["bytes"]]): r for r in doc["collectives"]}
    coll.update({json.dumps([r["collective"], r["devices"], r["bytes"]]): dict(r) for r in collectives})
    out["collectives"] = sorted(coll.values(), key=lambda r: (r["collective"], r["devices"], r["bytes"]))
    costs.from_document(out)  # every row must fit before the file is written
    return out


def existing(device_kind: str, path: Path | None = None) -> dict[str, Any]:
    """The document to merge into: `path`, else the user's file, else the shipped one, else empty."""
    candidates = [path] if path is not None else [costs.path_for(device_kind),
                                                   costs.path_for(device_kind, shipped=True)]
    for p in candidates:
        if p is not None and p.is_file():
            return costs.check_document(json.loads(p.read_text()), str(p))
    return costs.empty_document(device_kind)


def write(doc: Mapping[str, Any], path: Path) -> None:
    """Replace `path` atomically with `doc`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- measuring here

# one at a time, causal, at the shortest length (what the coverage suite times)
FEATURE_CASES = ({"logits_soft_cap": 30.0}, {"alibi": True}, {"dropout_rate": 0.1}, {"sinks": True},
                 {"num_sink_tokens": 4, "sliding_window": 1024}, {"sliding_window": 1024}, {"chunk_size": 2048})


# calls per timed run: a calibration prices calls as a training step runs them, back to back (the shipped H200
# file is fitted so; synced one by one, its Mosaic forward+backward line took 0.48 ms of host wait per call)
BACK_TO_BACK = 5


def _time(fn, args, repeats: int) -> float:
    from ringjax.dispatch import autotuning

    compiled = fn.lower(*args).compile()
    settings = autotuning.TuneSettings(warmup=1, repeats=repeats, progress=False, back_to_back=BACK_TO_BACK)
    return autotuning.measure(compiled, args, settings)


def measure_kernel(implementation: str, *, seq: int, batch: int, heads: int, kv_heads: int, head_dim: int,
                   dtype: str, precision: str, features: Mapping[str, Any], repeats: int) -> dict[str, Any]:
    """One calibration row: `implementation` on one device, forward and forward + backward."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import ringjax
    from ringjax.options import FEATURE, TUNABLE

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((batch, seq, kv_heads, head_dim)), dtype) for _ in range(2))
    kw = {name: tuple(v) if isinstance(v, list) else v for name, v in features.items() if TUNABLE[name].role == FEATURE}
    if features.get("segments"):
        docs = costs.MEASURED_DOCUMENTS
        kw["segment_ids"] = jnp.asarray(np.arange(seq) * docs // seq, jnp.int32)[None].repeat(batch, 0)
    if features.get("sinks"):
        kw["sinks"] = jnp.zeros((heads,), jnp.float32)
    if features.get("alibi"):
        kw["alibi_slopes"] = 2.0 ** (-8.0 * jnp.arange(1, heads + 1) / heads)
    if features.get("dropout_rate"):
        kw["dropout_rng"] = jax.random.key(1)

    def fwd(q, k, v):
        return ringjax.ring_attention(q, k, v, axis_name=None, implementation=implementation, **kw)

    def fwd_bwd(q, k, v):
        return jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

    with jax.default_matmul_precision(precision):
        fwd_s = _time(jax.jit(fwd), (q, k, v), repeats)
        fwd_bwd_s = _time(jax.jit(fwd_bwd), (q, k, v), repeats)
    row = {"implementation": implementation, "batch": batch, "seq": seq, "heads": heads, "kv_heads": kv_heads,
           "head_dim": head_dim, "dtype": dtype, "features": dict(features), "fwd_ms": fwd_s * 1e3,
           "fwd_bwd_ms": fwd_bwd_s * 1e3, "source": f"python -m ringjax calibrate (jax {jax.__version__})",
           "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "back_to_back": BACK_TO_BACK}
    if dtype == "float32":
        row["precision"] = precision
    return row


def measure_collective(kind: str, nbytes: int, devices, repeats: int) -> dict[str, Any]:
    """One collective over `devices` in a jitted shard_map, `nbytes` sent per device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = len(devices)
    mesh = Mesh(np.array(devices), ("x",))
    count = max(nbytes // 2, n * n)
    count -= count % (n * n)
    body = {
        "ppermute": lambda x: jax.lax.ppermute(x, "x", [(i, (i + 1) % n) for i in range(n)]),
        "all_gather": lambda x: jax.lax.all_gather(x, "x", tiled=True),
        "reduce_scatter": lambda x: jax.lax.psum_scatter(x, "x", tiled=True),
        "all_to_all": lambda x: jax.lax.all_to_all(x, "x", 0, 0, tiled=True),
    }[kind]
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.device_put(jnp.zeros((count * n,), jnp.bfloat16), NamedSharding(mesh, P("x")))
    seconds = _time(fn, (x,), repeats)
    return {"collective": kind, "devices": n, "bytes": count * 2, "ms": seconds * 1e3,
            "source": f"python -m ringjax calibrate (jax {jax.__version__})",
            "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def measure(*, seqs: Sequence[int] = (8192, 32768), floor_seq: int | None = 1024, batch: int = 1, heads: int = 32,
            kv_heads: int = 8,
            head_dims: Sequence[int] = (64, 128, 256), collective_mib: Sequence[float] = (16, 64, 256),
            repeats: int = 5, features: Sequence[Mapping[str, Any]] = FEATURE_CASES,
            dtypes: Sequence[tuple[str, str]] = (("bfloat16", "default"), ("float32", "default"),
                                                 ("float32", "highest")),
            say=print) -> tuple[str, list[dict], list[dict]]:
    """(device kind, kernel rows, collective rows) measured on this machine's default devices.

    Every implementation "auto" may run here is timed in the first of `dtypes` (with its matmul
    precision) plain at each length (causal, and not causal at the shortest), at each head_dim and with
    each of `features` at the shortest length; in the other dtypes plain at each length; and plain at
    `floor_seq` (causal and not; None: not), a launch-bound call that gives each line its floor
    (`costs.FLOOR_SEQ`: without one a line prices short calls by extrapolation, near nothing). Calls an
    implementation refuses are skipped. With several devices, each collective at each size.
    """
    import jax

    from ringjax.dispatch import registry
    from ringjax.dispatch.autotuning import short_error

    kind = registry.current_device_kind()
    platform = registry.current_platform()
    names = [r.name for r in registry.registrations("ring_attention") if r.auto and platform in r.platforms]
    shape = dict(batch=batch, heads=heads, kv_heads=kv_heads)
    short = min(seqs)
    first, ref = dtypes[0], max(head_dims, key=lambda d: (d == costs.REFERENCE_HEAD_DIM, d))
    cases = [(t, ref, *first, {"causal": True}) for t in seqs]
    cases += [(short, d, *first, {"causal": True}) for d in head_dims if d != ref]
    cases += [(short, ref, *first, {"causal": True, **f}) for f in features]
    cases += [(short, ref, *first, {})]
    if floor_seq is not None and floor_seq not in seqs:
        cases += [(floor_seq, ref, *first, {"causal": True}), (floor_seq, ref, *first, {})]
    cases += [(t, ref, *other, {"causal": True}) for other in dtypes[1:] for t in seqs]
    kernels = []
    for name in names:
        for seq, head_dim, dtype, prec, features in cases:
            features = {k: min(v, seq // 2) if k in ("sliding_window", "chunk_size") else v
                        for k, v in features.items()}
            row = {"implementation": name, "seq": seq, "head_dim": head_dim, "dtype": dtype, **shape,
                   "features": features}
            why = registry.refusal(next(r for r in registry.registrations("ring_attention") if r.name == name),
                                   costs.problem_of(row, platform, kind) if dtype != "float32" else
                                   costs.problem_of({**row, "precision": prec}, platform, kind))
            if why:
                continue
            try:
                kernels.append(measure_kernel(name, seq=seq, head_dim=head_dim, dtype=dtype, precision=prec,
                                              features=features, repeats=repeats, **shape))
                say(f"{name} {dtype}{'/' + prec if dtype == 'float32' else ''} T={seq} D={head_dim} "
                    f"{features}: {kernels[-1]['fwd_ms']:.3f} / {kernels[-1]['fwd_bwd_ms']:.3f} ms")
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: skip the case, say why
                say(f"{name} T={seq} D={head_dim} {features}: skipped ({short_error(e)})")
    collectives = []
    devices = jax.devices()
    if len(devices) > 1:
        for kind_ in ("ppermute", "all_gather", "reduce_scatter", "all_to_all"):
            for mib in collective_mib:
                try:
                    collectives.append(measure_collective(kind_, int(mib * 2**20), devices, repeats))
                    say(f"{kind_} over {len(devices)} devices, {mib} MiB: {collectives[-1]['ms']:.3f} ms")
                except Exception as e:  # noqa: BLE001
                    say(f"{kind_} {mib} MiB: skipped ({short_error(e)})")
    return kind, kernels, collectives
