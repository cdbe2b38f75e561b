"""Command line: inspect, ship and pre-tune configs.

    python -m ringjax implementations
    python -m ringjax cache list|show|clear|export|import ...
    python -m ringjax tune --batch 1 --seq 65536 --heads 32 --kv-heads 8 --head-dim 128 --axis-size 8 --causal
    python -m ringjax strategy --chip h200 --devices 2 --seq 65536 --heads 32 --kv-heads 8 --head-dim 128 --causal
    python -m ringjax explain --shape 1,32768,32,128 --kv-heads 8 --causal --device-kind "NVIDIA H200" --devices 8
    python -m ringjax calibrate [--from-results benchmarks/results/*.jsonl] [--shipped]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path


def _head_dims(head_dim, v_head_dim=None) -> str:
    """q/k's head_dim, and v's after a slash where it differs."""
    return str(head_dim) if v_head_dim in (None, head_dim) else f"{head_dim}/{v_head_dim}"


def _cache_entries_table(entries: dict, current: dict | None) -> list[str]:
    lines = []
    for kid, entry in sorted(entries.items(), key=lambda kv: json.dumps(kv[1]["key"], sort_keys=True)):
        key = entry["key"]
        shape = key.get("shape", {})
        feats = key.get("features", {})
        on = []
        for name, value in sorted(feats.items()):
            if value is True:
                on.append(name.removeprefix("has_"))
            elif name == "window" and value is not None:
                on.append(f"window={value}")
            elif name == "layout" and value != "contiguous":
                on.append(str(value))
            elif name == "gqa_ratio" and value != 1:
                on.append(f"gqa={value}")
        versions = key.get("versions")
        state = "" if versions is None or current is None else ("" if versions == current else "  [stale]")
        timing = f"  {entry['median_s'] * 1e3:.3f} ms" if isinstance(entry.get("median_s"), (int, float)) else ""
        lines.append(
            f"{kid}  {key.get('implementation')} {key.get('dtype')} "
            f"B={shape.get('batch')} T={shape.get('seq')} H={shape.get('heads')}/{shape.get('kv_heads')} "
            f"D={_head_dims(shape.get('head_dim'), shape.get('v_head_dim'))} ring={key.get('axis_size')} "
            f"{','.join(on) or '-'}"
            f"  -> {json.dumps(entry['config'], sort_keys=True)}{timing}{state}"
        )
    return lines


def _load_file(path: Path):
    from ringjax.dispatch import cache

    try:
        return cache.read_document(path), None
    except (cache.CacheFileError, OSError, UnicodeDecodeError) as e:
        return None, str(e)


def _cmd_implementations(args) -> int:
    from ringjax import list_implementations
    from ringjax.dispatch import registry

    if args.markdown:  # the README's coverage table
        print(registry.feature_table(args.op))
        return 0
    rows = [(impl["name"], str(impl["priority"]), ",".join(impl["platforms"]),
             "runs here" if impl["runs_here"] else "not on this platform")
            for impl in list_implementations(args.op)]
    rows.insert(0, ("name", "priority", "platforms", "here"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
    print()
    print(registry.feature_table(args.op))
    return 0


def _cmd_cache_list(args) -> int:
    from ringjax.dispatch import cache

    folder = cache.cache_dir()
    state = "" if folder.is_dir() else " (does not exist yet: nothing has been tuned or imported)"
    print(f"user cache: {folder}{state}")
    for label, files in (("user", cache.user_files()), ("shipped", cache.shipped_files())):
        for path in files:
            doc, err = _load_file(path)
            if doc is None:
                print(f"  {label:<8} {path.name}: unreadable ({err})")
                continue
            n = len(doc["entries"])
            print(f"  {label:<8} {path.name}: {doc.get('device_kind')!r}, {n} entr{'y' if n == 1 else 'ies'}")
    return 0


def _selected_files(args) -> list[Path]:
    from ringjax.dispatch import cache

    files = cache.user_files()
    if args.device_kind:
        files = [p for p in files if p == cache.user_path(args.device_kind)]
    return files


def _cmd_cache_show(args) -> int:
    from ringjax.dispatch import cache

    current = cache.versions()
    files = list(_selected_files(args))
    if args.shipped:
        files += [p for p in cache.shipped_files() if not args.device_kind or p == cache.shipped_path(args.device_kind)]
    if not files:
        print(f"no cached configs{' for ' + repr(args.device_kind) if args.device_kind else ''} "
              f"in {cache.cache_dir()}")
    for path in files:
        doc, err = _load_file(path)
        if doc is None:
            print(f"{path}: unreadable ({err})")
            continue
        if args.json:
            print(json.dumps(doc, indent=1, sort_keys=True))
            continue
        print(f"{path} ({doc.get('device_kind')!r}):")
        for line in _cache_entries_table(doc["entries"], current):
            print("  " + line)
    return 0


def _cmd_cache_clear(args) -> int:
    from ringjax.dispatch import cache

    for path in _selected_files(args):
        doc, _ = _load_file(path)
        kind = doc.get("device_kind", path.stem) if doc else path.stem
        store = cache.Store(path, kind)
        if args.stale:
            stale = [kid for kid, e in (doc or {"entries": {}})["entries"].items() if not cache.is_current(e)]
            store.remove(stale)
            print(f"{path}: removed {len(stale)} stale entr{'y' if len(stale) == 1 else 'ies'}")
        else:
            store.clear()
            print(f"{path}: removed")
    return 0


def _cmd_cache_export(args) -> int:
    from ringjax.dispatch import cache, registry

    kind = args.device_kind or registry.current_device_kind()
    doc, err = _load_file(cache.user_path(kind))
    if doc is None:
        print(f"nothing to export for {kind!r}: {err}", file=sys.stderr)
        return 1
    out = cache.empty_document(kind)
    for entry in doc["entries"].values():
        if not args.all_versions and not cache.is_current(entry):
            continue
        entry = dict(entry)
        if args.portable:
            entry["key"] = {k: v for k, v in entry["key"].items() if k != "versions"}
        out["entries"][cache.key_id(entry["key"])] = entry
    text = json.dumps(out, indent=1, sort_keys=True) + "\n"
    if args.file == "-":
        sys.stdout.write(text)
    else:
        try:
            Path(args.file).write_text(text)
        except OSError as e:
            print(f"cannot export to {args.file}: {e}", file=sys.stderr)
            return 1
        print(f"exported {len(out['entries'])} entries for {kind!r} to {args.file}")
    return 0


def _cmd_cache_import(args) -> int:
    from ringjax.dispatch import cache

    doc, err = _load_file(Path(args.file))
    if doc is None:
        print(f"cannot import {args.file}: {err}", file=sys.stderr)
        return 1
    kind = args.device_kind or doc.get("device_kind")
    if not isinstance(kind, str) or not kind:
        print(f"{args.file} names no device_kind; pass --device-kind", file=sys.stderr)
        return 1
    current = cache.versions()
    entries, stale = {}, 0
    for entry in doc["entries"].values():
        entry = dict(entry)
        if "versions" not in entry["key"]:  # a portable export: adopt it for the versions installed here
            entry["key"] = {**entry["key"], "versions": current}
        stale += entry["key"]["versions"] != current
        entries[cache.key_id(entry["key"])] = entry
    if not cache.user_store(kind).merge(entries):
        return 1
    print(f"imported {len(entries)} entries into {cache.user_path(kind)}"
          + (f" ({stale} tuned with other versions, unused here)" if stale else ""))
    return 0


def _cmd_tune(args) -> int:
    import datetime

    import jax

    from ringjax.dispatch import autotuning, registry

    settings = autotuning.TuneSettings(
        warmup=args.warmup, repeats=args.repeats, backward=not args.forward_only, progress=not args.no_progress,
        rounds=args.rounds, back_to_back=args.back_to_back,
    )
    result = autotuning.tune_shapes(
        batch=args.batch, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        v_head_dim=args.v_head_dim, dtype=args.dtype, axis_size=args.axis_size, implementation=args.implementation,
        settings=settings, **_features(args),
    )
    p = result.problem
    print(f"{result.implementation} on {p.device_kind} ({p.platform}), jax {jax.__version__}, "
          f"{datetime.date.today().isoformat()}; per device: B={p.batch} T={p.seq} H={p.heads}/{p.kv_heads} "
          f"D={_head_dims(*p.head_dims)} {p.dtype}, ring of {p.opts.axis_size}, "
          f"{'fwd+bwd' if settings.backward else 'fwd'}")
    for cfg, seconds, err in result.timings:
        try:
            shown = json.dumps(registry.config_to_json(cfg), sort_keys=True)
        except TypeError:  # a candidate that is not a config at all (it failed; say which)
            shown = repr(cfg)
        print(f"  {shown:<40} " + (f"{seconds * 1e3:10.3f} ms" if err is None else err))
    if result.config is None:
        print("no candidate ran; nothing cached", file=sys.stderr)
        return 1
    print(f"best: {json.dumps(registry.config_to_json(result.config), sort_keys=True)} "
          f"({result.median_s * 1e3:.3f} ms), saved to the user cache")
    return 0


def _cmd_strategy(args) -> int:
    import dataclasses

    from ringjax.strategies import plan

    hybrid = tuple(args.hybrid) if args.hybrid else None
    chip = plan.CHIPS[args.chip]
    if args.link_gbps is not None:  # every transfer at that rate: the measured figures go
        chip = dataclasses.replace(chip, link_bandwidth=args.link_gbps * 1e9, collectives=())
    costs = plan.strategy_costs(
        chip, devices=args.devices, seq_len=args.seq, heads=args.heads, kv_heads=args.kv_heads or args.heads,
        head_dim=args.head_dim, v_head_dim=args.v_head_dim, dtype=args.dtype, causal=args.causal, layout=args.layout,
        batch=args.batch, hybrid=hybrid, efficiency=args.efficiency, memory_fraction=args.memory_fraction,
    )
    measured = ", ".join(kind for kind, _ in chip.collectives)
    print(f"cost model: {args.devices} x {chip.name} (link {chip.link_bandwidth / 1e9:g} GB/s"
          + (f"; measured {measured}" if measured else "") + "), "
          f"seq {args.seq} ({args.seq // args.devices} per device), "
          f"batch {args.batch}, heads {args.heads}/{args.kv_heads or args.heads}, "
          f"head_dim {_head_dims(args.head_dim, args.v_head_dim)}, "
          f"{args.dtype}, {'causal' if args.causal else 'full'}, layout {args.layout}"
          + (f", hybrid {hybrid[0]} x {hybrid[1]}" if hybrid else ""))
    print(plan.strategy_table(costs))
    best = plan.best_strategy(costs)
    print(f"strategy='auto' picks {best.strategy} ({best.total_s * 1e3:.3f} ms forward + backward; the ring unless "
          f"another is over {plan.TIE_TOLERANCE:.0%} faster); a measurement through the autotuner "
          "(autotune='on') overrides the model")
    return 0


def _platform_of(device_kind: str) -> str:
    kind = device_kind.lower()
    if kind.startswith("tpu"):
        return "tpu"
    if kind == "cpu":
        return "cpu"
    if any(word in kind for word in ("nvidia", "gpu", "h100", "h200", "a100", "b200", "gh200")):
        return "gpu"
    raise ValueError(f"cannot tell the platform of device kind {device_kind!r}: pass --platform")


def explain(*, shape, kv_heads=None, v_head_dim=None, dtype="bfloat16", precision="default", device_kind=None,
            platform=None, devices=1, strategy="ring", implementation="auto", op="ring_attention", documents=None,
            **features) -> str:
    """What `ring_attention` would run for global q of `shape` (batch, seq, heads, head_dim) and v of head_dim
    `v_head_dim` (None: q's) with the sequence split over `devices` devices of `device_kind` (default: this
    host's), and why; nothing is run. `documents`: every row packs that many documents of equal length
    (segment ids on), priced by the blocks they skip."""
    import jax.numpy as jnp

    from ringjax.core import precision as precisions
    from ringjax.dispatch import autotuning, costs, registry, report
    from ringjax.options import TUNABLE, check_keywords, make_options, sequence_chunks
    from ringjax.strategies import auto as strategy_auto
    from ringjax.strategies import plan, predict, spread

    check_keywords("explain", features, TUNABLE)
    batch, seq, heads, head_dim = shape
    if documents is not None:
        if not isinstance(documents, int) or isinstance(documents, bool) or not 1 <= documents <= seq:
            raise ValueError(f"documents must be an int from 1 to seq ({seq}), got {documents!r}")
        features["segments"] = True
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if device_kind is None:
        platform = platform or registry.current_platform()
        device_kind = registry.current_device_kind(platform)
    platform = platform or _platform_of(device_kind)
    spread.check_strategy(strategy, "sp")
    opts = make_options(head_dim, axis_name=None, axis_size=devices,
                        **{TUNABLE[name].option_name: value for name, value in features.items()})
    chunks = sequence_chunks(opts.layout, devices)
    if seq % chunks:
        raise ValueError(f"seq ({seq}) must be divisible by {chunks} for {devices} devices and layout {opts.layout!r}")
    dtype = str(jnp.dtype(dtype))
    base = registry.Problem(opts=opts, batch=batch, seq=seq // devices, heads=heads, kv_heads=kv_heads,
                            head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype, platform=platform,
                            device_kind=device_kind,
                            precision=precisions.canonical(precision) if dtype == "float32" else precisions.DEFAULT,
                            documents=None if documents is None else costs.equal_documents(documents, seq))
    axis, sizes = ("sp", {"sp": devices}) if devices > 1 else (None, {})
    if strategy == "auto":
        strat, reason = strategy_auto.choice(base, axis, sizes, implementation=implementation, op=op,
                                             autotune="cached")
    else:
        strat, reason = spread.bind(strategy, axis, sizes), f"strategy={strategy!r}"
    problem = strat.problem(base)
    reg, impl = registry.choose(op, implementation, problem)
    selection = autotuning.select(op, reg, impl, problem, policy="cached")
    lines = [str(report.build(op, implementation, problem, reg.name, selection.config, selection.source,
                              strat.describe(), reason))]
    calibration = costs.load(device_kind)
    predicted = None
    if devices > 1 and calibration is not None:
        runnable = [spread.bind(name, axis, sizes) for name in ("ring", "all_gather", "ulysses")
                    if spread._refusal(spread.bind(name, axis, sizes), base, implementation, op) is None]
        predicted = predict.strategy_costs(base, runnable, calibration, implementation=implementation, op=op)
        if predicted:
            lines += ["", f"strategies on {devices} x {device_kind} (predicted; strategy='auto' picks "
                          f"{plan.best_strategy(predicted).strategy}):", plan.strategy_table(predicted)]
    fused = getattr(selection.config, "fused", False) or any(c.fused for c in predicted or ())
    if fused and platform == "gpu" and registry.described(problem):
        lines += ["", f"(the fused ring judged for one process holding the {devices} GPUs; with one process per GPU "
                      "it is refused and the step ring runs)"]
    lines += ["", "(nothing was run: predictions from " + (calibration.where if calibration else
                                                           "no calibration, so no times") + ")"]
    return "\n".join(lines)


def _cmd_explain(args) -> int:
    from ringjax.dispatch import registry

    device_kind = args.device_kind
    if device_kind is None and args.platform is not None:
        try:
            device_kind = registry.current_device_kind(args.platform)
        except RuntimeError:  # jax has no such backend here
            args.parser.error(f"argument --platform: no {args.platform} device on this host; pass --device-kind "
                              "to explain for one")
    print(explain(shape=args.shape, kv_heads=args.kv_heads, v_head_dim=args.v_head_dim, dtype=args.dtype,
                  precision=args.precision,
                  device_kind=device_kind, platform=args.platform, devices=args.devices, strategy=args.strategy,
                  implementation=args.implementation, op=args.op, documents=args.documents, **_features(args)))
    return 0


def _cmd_calibrate(args) -> int:
    from ringjax.dispatch import calibrate, costs

    if args.from_results:
        try:
            kind, kernels = calibrate.rows_from_results(args.from_results, candidates=args.candidates)
        except OSError as e:
            print(f"cannot read --from-results: {e}", file=sys.stderr)
            return 1
        collectives: list = []
    else:
        sizes = dict(seqs=(256,), floor_seq=128, heads=4, kv_heads=2, head_dims=(32, 64), collective_mib=(1, 4),
                     repeats=2) \
            if args.tiny else dict(seqs=tuple(args.seqs), repeats=args.repeats)
        kind, kernels, collectives = calibrate.measure(**sizes)
    path = Path(args.out) if args.out else costs.path_for(kind, shipped=args.shipped)
    doc = calibrate.merge(calibrate.existing(kind, path if args.out else None), kernels, collectives)
    calibrate.write(doc, path)
    print(f"{len(kernels)} kernel and {len(collectives)} collective measurements of {kind!r} merged into {path}")
    return 0


class _OneOrTwo(argparse.Action):
    """nargs="+" capped at two: one value as itself, two as a (left, right) tuple, which `check` then checks
    whole (so its error shows the pair as given)."""

    def __init__(self, *args, check, **kwargs):
        super().__init__(*args, **kwargs)
        self.check = check

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            if len(values) > 2:
                raise ValueError("takes W or LEFT RIGHT")
            value = values[0] if len(values) == 1 else tuple(values)
            self.check(value)
        except (TypeError, ValueError) as e:
            parser.error(str(argparse.ArgumentError(self, str(e))))
        setattr(namespace, self.dest, value)


# flags the tune command had before they were generated from ringjax.options.TUNABLE
_OLD_FLAGS = {"sliding_window": ("--window",), "logits_soft_cap": ("--softcap",)}


def _add_feature_flags(p: argparse.ArgumentParser) -> None:
    """One flag per entry of ringjax.options.TUNABLE, so every feature a call can ask for can be tuned."""
    from ringjax.options import FEATURE, TUNABLE

    for name, kw in TUNABLE.items():
        flags = ("--" + name.replace("_", "-"), *_OLD_FLAGS.get(name, ()))
        if kw.role != FEATURE:  # an array argument: whether the call has one
            p.add_argument(*flags, dest=name, action="store_true", help=f"as if {kw.name} were given ({kw.help})")
        elif kw.type is bool and kw.also:  # a switch that also takes a word: --deterministic [invariant]
            p.add_argument(*flags, dest=name, nargs="?", const=True, default=kw.default, choices=kw.also,
                           help=kw.help)
        elif kw.type is bool:
            p.add_argument(*flags, dest=name, action="store_true", help=kw.help)
        elif kw.pair:
            p.add_argument(*flags, dest=name, type=kw.type, nargs="+", action=_OneOrTwo, check=_feature_check(name),
                           metavar="N", help=kw.help)
        elif kw.type in (int, float):
            p.add_argument(*flags, dest=name, type=_checked(kw.type, _feature_check(name)), default=kw.default,
                           help=kw.help)
        else:  # a word: argparse checks the choices
            p.add_argument(*flags, dest=name, type=kw.type, default=kw.default, choices=kw.choices, help=kw.help)


def _features(args) -> dict:
    """The TUNABLE features as parsed, defaults included: every value the user gave reaches the library, a falsy
    one too (a sliding window of 0)."""
    from ringjax.options import TUNABLE

    return {name: getattr(args, name) for name in TUNABLE}


def _checked(convert, check):
    """An argparse type: `convert(text)`, then `check(value)`; a failure of either becomes argparse's error
    naming the flag (exit code 2, usage on stderr) instead of a traceback or an error after the parse."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {convert.__name__} value: {text!r}") from None
        try:
            check(value)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    return parse


def _feature_check(name: str):
    """A feature flag's check: `make_options`, as the library checks a call's value, so `tune`, `explain` and
    ring_attention refuse the same values in the same words. Alone, without the other flags: a causal window's
    right side is refused if negative, where the library would drop it."""
    from ringjax.options import make_options

    return lambda value: make_options(1, axis_name=None, axis_size=1, **{name: value})


def _at_least_one(value: int) -> None:
    if value < 1:
        raise ValueError(f"must be a positive integer, got {value}")


_positive_int = _checked(int, _at_least_one)


def _shape(text: str) -> tuple[int, ...]:
    """--shape's BATCH,SEQ,HEADS,HEAD_DIM."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:  # not integers: refused below, with the form expected
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"must be BATCH,SEQ,HEADS,HEAD_DIM (four positive integers), got {text!r}")
    return shape


def build_parser() -> argparse.ArgumentParser:
    from ringjax.strategies import plan

    parser = argparse.ArgumentParser(prog="python -m ringjax", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("implementations", help="registered implementations, whether they run here, what each supports")
    p.add_argument("--op", default="ring_attention")
    p.add_argument("--markdown", action="store_true", help="only the feature table, as the README shows it")
    p.set_defaults(run=_cmd_implementations)

    cache_p = sub.add_parser("cache", help="inspect and manage the persistent config cache")
    csub = cache_p.add_subparsers(dest="cache_command", required=True)
    p = csub.add_parser("list", help="cache files and their entry counts")
    p.set_defaults(run=_cmd_cache_list)
    p = csub.add_parser("show", help="entries of the user cache (current and stale)")
    p.add_argument("--device-kind", help="only this device kind")
    p.add_argument("--shipped", action="store_true", help="also show configs shipped with ringjax")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.set_defaults(run=_cmd_cache_show)
    p = csub.add_parser("clear", help="delete user cache files (or only stale entries)")
    p.add_argument("--device-kind", help="only this device kind")
    p.add_argument("--stale", action="store_true", help="only entries tuned with other jax/jaxlib/ringjax versions")
    p.set_defaults(run=_cmd_cache_clear)
    p = csub.add_parser("export", help="write one device kind's entries to a file")
    p.add_argument("file", help="output path, or - for stdout")
    p.add_argument("--device-kind", help="default: this machine's first device")
    p.add_argument("--portable", action="store_true",
                   help="drop versions from keys (the format of ringjax/configs/<device kind>.json)")
    p.add_argument("--all-versions", action="store_true", help="include stale entries")
    p.set_defaults(run=_cmd_cache_export)
    p = csub.add_parser("import", help="merge an exported file into the user cache")
    p.add_argument("file")
    p.add_argument("--device-kind", help="override the file's device kind")
    p.set_defaults(run=_cmd_cache_import)

    p = sub.add_parser("strategy", help="the cost model's prediction for each strategy, and what 'auto' picks")
    p.add_argument("--chip", required=True, choices=sorted(plan.CHIPS), help="a chip of ringjax.strategies.plan.CHIPS")
    p.add_argument("--devices", type=_positive_int, required=True, help="devices the sequence is split over")
    p.add_argument("--seq", type=_positive_int, required=True, help="global sequence length")
    p.add_argument("--heads", type=_positive_int, required=True)
    p.add_argument("--kv-heads", type=_positive_int, help="default: --heads")
    p.add_argument("--head-dim", type=_positive_int, required=True)
    p.add_argument("--v-head-dim", type=_positive_int, help="v's head_dim (default: --head-dim)")
    p.add_argument("--batch", type=_positive_int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--layout", default="contiguous", choices=("contiguous", "zigzag", "striped"))
    p.add_argument("--hybrid", type=_positive_int, nargs=2, metavar=("HEAD", "RING"),
                   help="also predict hybrid with HEAD x RING devices")
    p.add_argument("--efficiency", type=_checked(float, functools.partial(plan.check_fraction, "efficiency")),
                   default=0.6, help="fraction of peak FLOP/s a kernel reaches")
    p.add_argument("--memory-fraction", type=_checked(float, functools.partial(plan.check_fraction,
                                                                                "memory_fraction")),
                   default=0.5, help="share of HBM a strategy may use")
    p.add_argument("--link-gbps", type=_checked(float, functools.partial(plan.check_rate, "link_gbps")),
                   help="one-way link GB/s for every transfer (not the chip's figures)")
    p.set_defaults(run=_cmd_strategy)

    p = sub.add_parser("explain", help="what ring_attention would run for global shapes, and why (runs nothing)")
    p.add_argument("--shape", type=_shape, required=True,
                   help="global q shape BATCH,SEQ,HEADS,HEAD_DIM, e.g. 1,32768,32,128")
    p.add_argument("--kv-heads", type=_positive_int, help="default: HEADS")
    p.add_argument("--v-head-dim", type=_positive_int, help="v's head_dim (multi-head latent attention; default: "
                                                           "HEAD_DIM)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "float64"))
    p.add_argument("--precision", default="default", help="jax's matmul precision for float32 (default, highest)")
    p.add_argument("--device-kind", help='e.g. "NVIDIA H200" (default: this host\'s first device)')
    p.add_argument("--platform", choices=("gpu", "tpu", "cpu"), help="default: from --device-kind")
    p.add_argument("--devices", type=_positive_int, default=1, help="devices the sequence is split over")
    p.add_argument("--strategy", default="ring", choices=("ring", "all_gather", "ulysses", "auto"))
    p.add_argument("--implementation", default="auto")
    p.add_argument("--op", default="ring_attention")
    p.add_argument("--documents", type=_positive_int,
                   help="packed sequences: every row holds this many documents of equal length (implies "
                        "--segments); priced by the blocks they skip")
    _add_feature_flags(p)
    p.set_defaults(run=_cmd_explain, parser=p)

    p = sub.add_parser("calibrate", help="measure this device's kernel and collective rates (what 'auto' predicts "
                                         "from), or build them from benchmark results")
    p.add_argument("--from-results", nargs="+", metavar="JSONL", help="benchmarks/results files instead of measuring")
    p.add_argument("--candidates", action="store_true",
                   help="with --from-results: also every implementation that `coverage --candidates` timed")
    p.add_argument("--seqs", type=_positive_int, nargs="+", default=[8192, 32768], help="sequence lengths to time")
    p.add_argument("--repeats", type=_positive_int, default=5)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a quick check on a CPU)")
    p.add_argument("--shipped", action="store_true", help="write ringjax/configs/calibration/ instead of the user's")
    p.add_argument("--out", help="write this file instead")
    p.set_defaults(run=_cmd_calibrate)

    p = sub.add_parser("tune", help="autotune one problem (global shapes) and save the result")
    p.add_argument("--batch", type=_positive_int, required=True, help="per-device batch")
    p.add_argument("--seq", type=_positive_int, required=True, help="global sequence length (split over the ring)")
    p.add_argument("--heads", type=_positive_int, required=True, help="per-device query heads")
    p.add_argument("--kv-heads", type=_positive_int, help="per-device key/value heads (default: --heads)")
    p.add_argument("--head-dim", type=_positive_int, required=True)
    p.add_argument("--v-head-dim", type=_positive_int, help="v's head_dim (default: --head-dim)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--axis-size", type=_positive_int, default=1, help="ring size (devices on the sequence axis)")
    _add_feature_flags(p)
    p.add_argument("--implementation", default="auto")
    p.add_argument("--forward-only", action="store_true", help="time the forward pass only (inference)")
    p.add_argument("--repeats", type=_positive_int, default=5, help="timed runs per candidate and round")
    p.add_argument("--rounds", type=_positive_int, default=3,
                   help="rounds over all candidates in turn; the median of all runs is kept (default 3)")
    p.add_argument("--back-to-back", type=_positive_int, default=1,
                   help="calls per timed run without a host sync between them, as a training step runs them")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=_cmd_tune)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file that cannot be read or written: not a usage error, as for `cache import`
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
