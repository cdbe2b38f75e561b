"""One-shot GPU check of the Mosaic GPU split-K decode kernel (issue 27): is it right, and does it read the
KV cache at the HBM rate?

    python3 benchmarks/decode_kernel_check.py --out decode.jsonl

Cases: batch 1, 32 query / 8 KV heads, head_dim 128, bf16, a cache of 128K and 1M tokens (1M where the
GPU's memory allows), t = 1 and 4 query tokens at the end of the cache (causal). For each case, in one
process: the HBM copy rate (a jnp copy of a 4 GiB array, bytes read + written / time), every
DecodeConfig variant of `decode.partials` checked against a float32 reference and timed, the kernel
alone (no XLA before and after) at the default config, and jax.nn.dot_product_attention (implementation
None, "xla", "cudnn"; no mask, the same K/V bytes) timed beside it. GB/s counts the K and V bytes of the
cache read once per call. Times: median of --iters calls each waited for, and the mean of --iters calls
dispatched back to back (the GPU's time when Python's dispatch hides behind it).

Robust by construction: each case runs in a child process; an item that raises is recorded and skipped,
and a child that crashes or hangs (no progress for --item-timeout s) is killed and restarted on the items
left. Rows go to --out as JSON lines as they finish; a summary table ends the output. `--tiny` runs small
shapes in jax's Mosaic GPU interpreter (CPU) to check the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

START, DONE = "@@start ", "@@done "
# errors after which a process's CUDA context is not trusted: the parent restarts the child on the items left
_FATAL = ("CUDA_ERROR", "cudaError", "illegal", "ILLEGAL", "misaligned", "INTERNAL:")
JNN = ("jnn:default", "jnn:xla", "jnn:cudnn")
FIRST_PASS = 3 + len(JNN)  # a case's first items (copy, default config, kernel alone, jax.nn) run before any variant


# --------------------------------------------------------------------------- the case a child runs


@dataclasses.dataclass(frozen=True)
class Case:
    slots: int
    tokens: int
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128

    @property
    def name(self) -> str:
        size = next((f"{self.slots >> b}{u}" for b, u in ((20, "M"), (10, "K")) if self.slots >= 1 << b), self.slots)
        return f"b{self.batch}_cache{size}_t{self.tokens}"

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.slots * self.kv_heads * self.head_dim * 2  # K and V, bf16


def variants(case: Case, default) -> list:
    """DecodeConfig variants around the default: block sizes, pipeline depths, split counts."""
    from ringjax.backends.pallas_mosaic_gpu.config import SMEM_LIMIT, DecodeConfig

    p = default.num_splits
    out = [default]
    for block_k, splits, stages in ((128, p, 3), (128, p, 2), (128, p, 4), (64, p, 4), (64, p, 3), (64, 2 * p, 2),
                                    (128, 2 * p, 3), (128, max(p // 2, 1), 3), (128, 4 * p, 3), (64, 4 * p, 4)):
        try:
            cfg = DecodeConfig(block_k=block_k, num_splits=splits, num_stages=stages)
        except ValueError:
            continue
        rows = -(-case.tokens * case.heads // case.kv_heads // 64) * 64
        fits = cfg.smem_bytes(rows, case.head_dim, case.head_dim) <= SMEM_LIMIT - 1024
        if cfg not in out and case.slots % block_k == 0 and fits:
            out.append(cfg)
    return out


def _timed(fn, args, iters: int, warmup: int) -> dict:
    """Median of `iters` waited-for calls after `warmup`, and the mean of `iters` calls dispatched back to back."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn(*args)  # the previous result is freed as the next is dispatched: one stream, in order
    jax.block_until_ready(out)
    pipelined = (time.perf_counter() - start) / iters
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "pipelined_ms": 1e3 * pipelined}


def _rates(timing: dict, nbytes: int, copy_gbps: float | None) -> dict:
    out = {}
    for key in ("median", "pipelined"):
        gbps = nbytes / (timing[f"{key}_ms"] * 1e-3) / 1e9
        out[f"gbps_{key}"] = round(gbps, 1)
        if copy_gbps:
            out[f"of_copy_{key}"] = round(gbps / copy_gbps, 3)
    return out


def _reference(q, k, v, q_pos, k_pos, k_len, scale):
    """float32 (out [B, t, H, D], lse [B, t, H]) with causal positions and k_len, K/V heads grouped (no repeat)."""
    import jax
    import jax.numpy as jnp

    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    valid = (k_pos[None, :] < k_len[:, None])[:, None, :] & (k_pos[None, None, :] <= q_pos[:, :, None])  # [B, t, S]
    s = jnp.where(valid[:, None, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, KVH, G, t]
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32), precision="highest")
    return out.reshape(b, t, h, -1), lse.transpose(0, 3, 1, 2).reshape(b, t, h)


def _errors(got, ref) -> dict:
    import jax.numpy as jnp

    out, lse = got
    ref_out, ref_lse = ref
    rel = float(jnp.linalg.norm((out - ref_out).ravel()) / jnp.linalg.norm(ref_out.ravel()))
    lse_err = float(jnp.max(jnp.abs(lse - ref_lse)))
    finite = bool(jnp.isfinite(out).all() & jnp.isfinite(lse).all())
    return {"out_rel_err": rel, "lse_max_err": lse_err, "finite": finite,
            "ok": finite and rel < 2e-2 and lse_err < 2e-2}


def _copy_rate(gib: float, iters: int, warmup: int) -> dict:
    """HBM copy rate: a jnp copy of a `gib` GiB float32 array, bytes read + written / time."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((int(gib * (1 << 30)) // 4,), jnp.float32)
    rows = {}
    for name, fn in (("copy", jax.jit(jnp.copy)), ("x+1", jax.jit(lambda a: a + 1.0))):
        timing = _timed(fn, (x,), iters, warmup)
        gbps = 2 * x.nbytes / (timing["pipelined_ms"] * 1e-3) / 1e9
        rows[name] = {**timing, "gbps_pipelined": round(gbps, 1),
                      "gbps_median": round(2 * x.nbytes / (timing["median_ms"] * 1e-3) / 1e9, 1)}
    del x
    # an elided copy (returned as is) would look infinitely fast: then the elementwise kernel's rate stands
    best = rows["copy"] if rows["copy"]["gbps_pipelined"] < 20000 else rows["x+1"]
    return {"copy_gbps": best["gbps_pipelined"], "copy_gbps_median": best["gbps_median"], "detail": rows,
            "bytes": 2 * int(gib * (1 << 30))}


def default_config(case: Case, interpret: bool):
    """`decode.default_config` for the case on this process's first device."""
    import jax
    import jax.numpy as jnp

    from ringjax.backends.pallas_mosaic_gpu.decode import default_config as heuristic

    c = case
    q, kv = (c.batch, c.tokens, c.heads, c.head_dim), (c.batch, c.slots, c.kv_heads, c.head_dim)
    return heuristic(q, kv, kv, jnp.bfloat16, None if interpret else jax.devices()[0])


def items(case: Case, interpret: bool, max_variants: int) -> list[str]:
    """Every item of a case, in the order of importance: the copy rate, the default config, the kernel alone,
    jax.nn, then the other config variants."""
    from ringjax.core.problem import config_to_json

    cfgs = variants(case, default_config(case, interpret))[:max_variants]
    first = [f"cfg:{json.dumps(config_to_json(cfgs[0]))}", "kernel_only"]
    out = ["copy", *first, *JNN, *[f"cfg:{json.dumps(config_to_json(c))}" for c in cfgs[1:]]]
    assert len(out) >= FIRST_PASS
    return out


class Worker:
    """One case's data and the items run on it, in a child process."""

    def __init__(self, case: Case, args):
        import jax
        import jax.numpy as jnp

        from ringjax.options import AttentionOptions

        self.case, self.args = case, args
        self.device = jax.devices()[0]
        self.interpret = args.tiny
        why = _memory_refusal(self.device, case, args.copy_gib)
        if why:
            raise MemoryError(f"{case.name} skipped: {why}")
        keys = jax.random.split(jax.random.key(case.slots + case.tokens), 3)
        c = case
        self.q = jax.random.normal(keys[0], (c.batch, c.tokens, c.heads, c.head_dim), jnp.bfloat16)
        self.k = jax.random.normal(keys[1], (c.batch, c.slots, c.kv_heads, c.head_dim), jnp.bfloat16)
        self.v = jax.random.normal(keys[2], (c.batch, c.slots, c.kv_heads, c.head_dim), jnp.bfloat16)
        self.k_pos = jnp.arange(c.slots, dtype=jnp.int32)
        self.k_len = jnp.full((c.batch,), c.slots, jnp.int32)
        self.q_pos = jnp.broadcast_to(jnp.arange(c.slots - c.tokens, c.slots, dtype=jnp.int32), (c.batch, c.tokens))
        self.opts = AttentionOptions(causal=True, softmax_scale=c.head_dim ** -0.5)
        self.copy_gbps = None
        self._ref = None

    @property
    def ref(self):
        if self._ref is None:
            import jax

            fn = jax.jit(_reference, static_argnums=6)
            self._ref = jax.block_until_ready(fn(self.q, self.k, self.v, self.q_pos, self.k_pos, self.k_len,
                                                 self.opts.softmax_scale))
        return self._ref

    def default_config(self):
        return default_config(self.case, self.interpret)

    def run(self, item: str) -> dict:
        if item == "copy":
            row = _copy_rate(self.args.copy_gib, self.args.iters, self.args.warmup)
            self.copy_gbps = row["copy_gbps"]
            return row
        if item.startswith("cfg:"):
            return self._partials(json.loads(item[4:]))
        if item == "kernel_only":
            return self._kernel_only()
        if item.startswith("jnn:"):
            return self._jax_nn(item[4:])
        raise ValueError(f"unknown item {item!r}")

    def _partials(self, fields: dict) -> dict:
        import jax

        from ringjax.backends.pallas_mosaic_gpu.config import DecodeConfig
        from ringjax.backends.pallas_mosaic_gpu.decode import partials
        from ringjax.core.problem import config_from_json

        cfg = config_from_json(DecodeConfig, fields)
        opts, interpret = self.opts, self.interpret

        def call(q, k, v, q_pos, k_pos, k_len):
            return partials(q, k, v, q_pos, k_pos, k_len, opts, cfg, interpret=interpret)

        fn = call if interpret else jax.jit(call)  # the interpreter runs eagerly
        args = (self.q, self.k, self.v, self.q_pos, self.k_pos, self.k_len)
        start = time.perf_counter()
        got = jax.block_until_ready(fn(*args))
        first_s = time.perf_counter() - start
        row = {"impl": "ringjax decode.partials", "config": fields, "first_call_s": round(first_s, 2),
               **_errors(got, self.ref)}
        row.update(_timed(fn, args, self.args.iters, self.args.warmup))
        row.update(_rates(row, self.case.kv_bytes, self.copy_gbps))
        return row

    def _kernel_only(self) -> dict:
        """The kernel alone at the default config: its inputs made beforehand, its split outputs not merged."""
        import jax

        from ringjax.backends.pallas_mosaic_gpu.decode import launch, query_rows, visit_table

        cfg = self.default_config()
        splits = min(cfg.num_splits, self.case.slots // cfg.block_k)
        q_rows, row_pos = query_rows(self.q, self.q_pos, self.case.kv_heads)
        table = visit_table(self.opts, self.q_pos, self.k_pos, self.k_len, cfg.block_k)
        opts, interpret = self.opts, self.interpret

        real = self.case.tokens * self.case.heads // self.case.kv_heads

        def call(q_rows, k, v, k_pos, row_pos, table, k_len):
            return launch(q_rows, k, v, k_pos, row_pos, table, k_len, opts, cfg, splits, real, interpret)

        fn = call if interpret else jax.jit(call)
        args = (q_rows, self.k, self.v, self.k_pos, row_pos, table, self.k_len)
        row = {"impl": "ringjax decode kernel alone", "config": dataclasses.asdict(cfg)}
        row.update(_timed(fn, args, self.args.iters, self.args.warmup))
        row.update(_rates(row, self.case.kv_bytes, self.copy_gbps))
        return row

    def _jax_nn(self, which: str) -> dict:
        """jax.nn.dot_product_attention on the same q, K, V without a mask: the same bytes to read."""
        import jax

        impl = None if which == "default" else which
        q, k, v = self.q, self.k, self.v

        fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=impl))
        jax.block_until_ready(fn(q, k, v))
        row = {"impl": f"jax.nn.dot_product_attention implementation={impl!r}"}
        row.update(_timed(fn, (q, k, v), self.args.iters, self.args.warmup))
        row.update(_rates(row, self.case.kv_bytes, self.copy_gbps))
        return row


def _memory_refusal(device, case: Case, copy_gib: float) -> str | None:
    """Why this case may not fit the GPU (K/V, the float32 reference's V and scores, the copy's two arrays)."""
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - no statistics: try anyway
        return None
    need = 3 * case.kv_bytes + 2 * copy_gib * (1 << 30)
    if limit and need > limit:
        return f"needs about {need / 2**30:.0f} GiB of GPU memory, the allocator has {limit / 2**30:.0f} GiB"
    return None


def _device_info() -> dict:
    import jax

    d = jax.devices()[0]
    return {"device": str(d.device_kind), "platform": d.platform, "jax": jax.__version__,
            "sm_count": getattr(d, "core_count", None), "compute_capability": getattr(d, "compute_capability", None)}


def worker_main(args) -> int:
    """Child: run the items of one case, announcing each, appending one JSON row per item to --out."""
    if args.list_items:  # --case holds a list of cases: their items by case name
        cases = [Case(**c) for c in json.loads(args.case)]
        print(json.dumps({c.name: items(c, args.tiny, args.max_variants) for c in cases}))
        return 0
    case = Case(**json.loads(args.case))
    info = _device_info()
    worker = Worker(case, args)
    todo = args.items.split("\n")
    with open(args.out, "a") as out:
        for item in todo:
            if item == "copy" and worker.copy_gbps is not None:
                continue
            if worker.copy_gbps is None and item != "copy" and not args.tiny:
                try:  # GB/s are read against this process's copy rate
                    worker.run("copy")
                except Exception:  # noqa: BLE001 - reported by the copy item itself
                    pass
            print(START + item, flush=True)
            start = time.perf_counter()
            row = {"case": case.name, **dataclasses.asdict(case), **info, "item": item}
            try:
                row.update(worker.run(item))
                row["error"] = None
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the rest go on
                row.update(error=f"{type(e).__name__}: {e}"[:2000], ok=False)
                traceback.print_exc()
            row["item_s"] = round(time.perf_counter() - start, 2)
            if worker.copy_gbps:
                row.setdefault("copy_gbps", worker.copy_gbps)
            out.write(json.dumps(row, default=str) + "\n")
            out.flush()
            print(_line(row), flush=True)
            print(DONE + item, flush=True)
            if row["error"] and any(w in row["error"] for w in _FATAL):
                print("!! the GPU context may be broken: a fresh process takes the items left", flush=True)
                return 3
    return 0


# --------------------------------------------------------------------------- the parent


def _line(row: dict) -> str:
    what = row.get("impl", row["item"])
    cfg = row.get("config")
    if cfg:
        what += f" block_k={cfg['block_k']} splits={cfg['num_splits']} stages={cfg['num_stages']}"
    if row.get("error"):
        return f"  {row['case']:<16} {what:<68} FAILED: {row['error'][:300]}"
    if row["item"] == "copy":
        return f"  {row['case']:<16} {'HBM copy (read + write)':<68} {row['copy_gbps']:8.1f} GB/s"
    check = ""
    if "ok" in row:
        verdict = "ok" if row["ok"] else "WRONG"
        check = f" check {verdict} (out rel {row['out_rel_err']:.1e}, lse {row['lse_max_err']:.1e})"
    frac = f" = {100 * row['of_copy_pipelined']:5.1f}% of copy" if row.get("of_copy_pipelined") else ""
    return (f"  {row['case']:<16} {what:<68} {row['pipelined_ms']:8.3f} ms {row['gbps_pipelined']:8.1f} GB/s{frac}"
            f" (median {row['median_ms']:.3f} ms, {row['gbps_median']:.1f} GB/s){check}")


def _child(args, case: Case, items: list[str] | None, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-u", __file__, "--worker", "--case", json.dumps(dataclasses.asdict(case)), "--out",
           args.out, "--iters", str(args.iters), "--warmup", str(args.warmup), "--copy-gib", str(args.copy_gib),
           *extra]
    if items is not None:
        cmd += ["--items", "\n".join(items)]
    if args.tiny:
        cmd.append("--tiny")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)


def _pump(proc, lines: queue.Queue):
    for line in proc.stdout:
        lines.put(line)
    lines.put(None)


def _record(path: str, case: Case, item: str, error: str) -> None:
    with open(path, "a") as out:
        out.write(json.dumps({"case": case.name, **dataclasses.asdict(case), "item": item, "error": error,
                              "ok": False}) + "\n")


def run_case(args, case: Case, items: list[str], deadline: float) -> None:
    """Run `items` of `case` in children until each is done, failed, or the deadline passes."""
    left = list(items)
    stalled = 0  # restarts in a row that finished no item
    while left and time.monotonic() < deadline:
        before = len(left)
        proc = _child(args, case, left, [])
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
        current, since, killed, started, tail = None, time.monotonic(), None, False, []
        while True:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                line = ""
            if line is None:
                break
            now = time.monotonic()
            if line.startswith(START):
                current, since, started = line[len(START):].rstrip("\n"), now, True
            elif line.startswith(DONE):
                done = line[len(DONE):].rstrip("\n")
                if done in left:
                    left.remove(done)
                current, since = None, now
            elif line:
                sys.stdout.write(line)
                tail = (tail + [line.rstrip()])[-15:]
            limit = args.item_timeout if started else args.item_timeout + 120  # startup: data made on the GPU
            if now - since > limit or now > deadline:
                killed = "timed out" if now - since > limit else "stopped at the time budget"
                proc.kill()
                break
        proc.wait()
        if killed is None and proc.returncode == 0:
            break
        why = killed or f"the child exited with code {proc.returncode}"
        if current is None and not started:  # it died before its first item: the case cannot run here
            print(f"!! {case.name}: {why} before its first item; skipping the case", flush=True)
            _record(args.out, case, "setup", f"{why}: {tail[-1] if tail else ''}")
            return
        stalled = 0 if len(left) < before else stalled + 1
        if current is None and stalled < 2:  # it stopped between items (a broken context): restart, blame none
            print(f"!! {case.name}: {why} between items; restarting on the {len(left)} left", flush=True)
            continue
        culprit = current or left[0]
        print(f"!! {case.name}: {why} during {culprit!r}; going on without it", flush=True)
        _record(args.out, case, culprit, f"{why} (no result): {tail[-1] if tail else ''}")
        if culprit in left:
            left.remove(culprit)


def summary(path: str) -> None:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    print("\n=== summary (GB/s of K+V read per call, dispatched back to back; % of the same process's HBM copy rate)")
    order = list(dict.fromkeys(row.get("case") for row in rows))
    for row in sorted(rows, key=lambda r: order.index(r.get("case"))):  # stable: each case's rows in run order
        if "case" in row and "item" in row:
            print(_line(row))
    best = {}
    for row in rows:
        if row.get("impl", "").startswith("ringjax") and row.get("ok") and row.get("gbps_pipelined"):
            if row["gbps_pipelined"] > best.get(row["case"], {}).get("gbps_pipelined", 0):
                best[row["case"]] = row
    print("\n=== best checked ringjax decode.partials config per case")
    for name, row in best.items():
        print(_line(row))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="decode_kernel_check.jsonl", help="JSON lines file (rewritten)")
    parser.add_argument("--cache", default="131072,1048576", help="cache lengths, comma-separated")
    parser.add_argument("--tokens", default="1,4", help="query tokens t, comma-separated")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--copy-gib", type=float, default=4.0)
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop starting work after this many seconds")
    parser.add_argument("--item-timeout", type=float, default=150.0, help="kill a child stuck this long on one item")
    parser.add_argument("--max-variants", type=int, default=12, help="DecodeConfig variants per case, default first")
    parser.add_argument("--tiny", action="store_true", help="small shapes in the interpreter (CPU): checks the script")
    # internal: a child process running one case
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--items", help=argparse.SUPPRESS)
    parser.add_argument("--list-items", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = str(Path(args.out).resolve())
    if args.worker:
        return worker_main(args)

    deadline = time.monotonic() + args.budget_s
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.tiny:
        cases = [Case(slots=s, tokens=t, heads=4, kv_heads=2, head_dim=64) for s in (512,) for t in tokens]
        args.iters, args.warmup, args.copy_gib, args.max_variants = 1, 0, 0.01, 2
    else:
        cases = [Case(slots=int(s), tokens=t) for s in args.cache.split(",") for t in tokens]
    # the parent never starts jax (its allocator would hold the GPU's memory): children list and run the items
    print(json.dumps({"command": sys.argv, "python": sys.executable}), flush=True)
    Path(args.out).write_text("")  # children append their rows
    output, code = "", None
    try:
        child = subprocess.run([sys.executable, __file__, "--worker", "--list-items", "--out", args.out,
                                "--case", json.dumps([dataclasses.asdict(c) for c in cases]),
                                "--max-variants", str(args.max_variants)] + (["--tiny"] if args.tiny else []),
                               capture_output=True, text=True, timeout=300)
        output, code = child.stdout + child.stderr, child.returncode
        listed = json.loads(child.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError, subprocess.TimeoutExpired) as e:
        tail = "\n".join(output.splitlines()[-20:]) if not isinstance(e, subprocess.TimeoutExpired) else str(e)
        print(f"!! the cases' items could not be listed:\n{tail}", flush=True)
        for case in cases:
            _record(args.out, case, "setup", tail.splitlines()[-1] if tail else f"exit code {code}")
        return 1
    plans = {case: listed[case.name] for case in cases}
    # first pass: the copy rate, the default config, the kernel alone and jax.nn for every case; then the variants
    for first in (True, False):
        for case, todo in plans.items():
            part = todo[:FIRST_PASS] if first else todo[FIRST_PASS:]
            if part and time.monotonic() < deadline:
                print(f"=== {case.name}: {len(part)} item(s)", flush=True)
                run_case(args, case, part if first else ["copy", *part], deadline)
    if time.monotonic() >= deadline:
        print(f"!! stopped at the time budget ({args.budget_s:.0f} s): items not started are missing", flush=True)
    if Path(args.out).exists():
        summary(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
