"""Autoregressive decode benchmark: the jitted single-token step against the memory-bandwidth floor.

Measured in ONE run on the current machine (numbers from different runs or machines are not comparable):
  * memory bandwidth: a large jitted matrix-vector product and a large jitted copy (the best of the two is
    used, which gives the lowest, i.e. the most demanding, floor);
  * floor = parameter bytes / bandwidth (what one decode step must at least cost: every weight is read once),
    also shown with the KV cache bytes the step reads added;
  * the jitted single-token step (`target.forward`, donated KV cache, fed its own argmax) at batch 1 and 8,
    median over --steps steps after warm-up, for the reference (unrolled) and scan backends;
  * the same step over T = 1, 2, 4, 8 tokens per row (--widths, at --width-batches): what a round verifying
    k drafts costs against one decode step, the cost model every speculative speedup on this machine obeys;
  * end-to-end greedy tokens/s of `specdec.generate.generate` on chat prompts at B=1 and B=8;
  * transformers' greedy tokens/s on the same prompts (B=1), same GGUF, float32;
  * the compiled step's HLO, checked for copies / transposes of cache-sized buffers (each would cost a full
    cache copy per step);
  * on an NVIDIA GPU, if JAX sees one: the step there against that GPU's floor (peak HBM bandwidth).

    SPECDEC_CACHE=... python -m benchmarks.bench_decode [--steps 300] [--out DIR]
    SPECDEC_CACHE=... python -m benchmarks.bench_decode --sections widths     # bandwidth + step cost by width only
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import Report, add_output_arg, hf_model, median_seconds
from specdec.generate import generate
from specdec.models import registry
from specdec.models.loading import load_checkpoint
from specdec.sampling import GREEDY
from specdec.target import Target

PROMPTS = [
    "What is the capital of France? Answer in one sentence, then tell me one fact about it.",
    "Write a Python function that reverses a linked list, with comments.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three tips for staying focused while studying.",
]

# Peak HBM bandwidth (bytes/s) by device kind; the floor on a GPU uses the datasheet figure (and the
# measured copy bandwidth is printed next to it).
GPU_PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "L4": 0.3e12}
DEFAULT_GPU_PEAK = 4.8e12  # H200

START = 128  # cache length the timed steps start from
SECTIONS = ("steps", "widths", "generate", "transformers", "gpu")


# ----------------------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------------------

def measure_bandwidth(device, nbytes: int = 512 << 20, reps: int = 15) -> dict:
    """GB/s of a jitted matrix-vector product (reads the matrix once) and of a jitted in-place scale (reads and
    writes the array once; the buffer is donated, so no fresh memory is faulted in on each call)."""
    cols = 8192
    rows = nbytes // 4 // cols
    size = rows * cols * 4
    with jax.default_device(device):
        a = jax.jit(lambda: jnp.full((rows, cols), 0.5, jnp.float32))()
        v = jnp.ones((cols,), jnp.float32)
        matvec = jax.jit(lambda a, v: a @ v)
        scale = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
        t_mv = median_seconds(lambda: matvec(a, v), reps)  # after a warm-up call
        a = scale(a)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            a = scale(a)
            a.block_until_ready()
            times.append(time.perf_counter() - t0)
        t_cp = statistics.median(times)
    del a
    mv, cp = size / t_mv, 2 * size / t_cp
    return {"matvec_GBps": mv / 1e9, "copy_GBps": cp / 1e9, "GBps": max(mv, cp) / 1e9}


def param_bytes(params) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(params)))


def cache_bytes(cache) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves((cache.k, cache.v))))


def make_step(forward, cfg):
    """One step over T tokens per row (T = 1: a decode step; T = k + 1: a chain verify step), jitted with the cache
    donated; feeds back its own argmax (no host round trip) and advances by T (back to START near the end)."""

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, tokens):
        width = tokens.shape[1]
        out = forward(params, cfg, cache, tokens)
        cache = out.cache.advance(width)
        cache = cache.with_lengths(jnp.where(cache.lengths >= cache.capacity - width, START, cache.lengths))
        nxt = jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        return jnp.broadcast_to(nxt, tokens.shape), cache

    return step


def cache_copies_in_hlo(compiled, cache, entry: bool = True) -> tuple[int, list[str]]:
    """Copies and transposes in the compiled program whose result is as large as one layer's cache (or larger):
    each re-materialises a cache (a fused `copy(transpose)` counts once).

    entry=False skips the ENTRY computation (in a while-loop program that is the once-per-call part, so what
    is left is what every step pays)."""
    leaf = jax.tree.leaves(cache.k)[0]
    layer_elems = int(np.prod(leaf.shape[-4:]))  # one layer's [B, KVH, S, HD], per-layer or stacked cache
    hits, in_entry = [], False
    for line in compiled.as_text().splitlines():
        if line.rstrip().endswith("{") and not line.startswith(" "):
            in_entry = line.startswith("ENTRY")
        m = re.search(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+(copy|transpose)\((%?[\w.-]*)", line)
        if m and m.group(2) and (entry or not in_entry):
            if m.group(3) == "copy" and m.group(4).lstrip("%").startswith("transpose"):
                continue  # the transpose it copies was counted
            elems = int(np.prod([int(d) for d in m.group(2).split(",")]))
            if elems >= layer_elems:
                hits.append(line.strip()[:160])
    return len(hits), hits


def decode_loop_copies(target: Target, batch: int, capacity: int, new_tokens: int) -> dict:
    """Cache-sized copies in specdec.generate's compiled decode loop: per step (in the loop) and per call."""
    import inspect

    from specdec import generate as gen

    cache = target.init_cache(batch, capacity)
    args = [target.params, cache, jnp.zeros((batch, target.cfg.vocab_size), jnp.float32), jax.random.PRNGKey(0)]
    if "limit" in inspect.signature(gen.decode_loop).parameters:
        args.append(jnp.int32(new_tokens))
    try:
        compiled = gen.decode_loop.lower(*args, forward=target.forward, cfg=target.cfg, sampling=GREEDY,
                                         max_new_tokens=new_tokens,
                                         eos_ids=tuple(target.eos_token_ids)).compile()
    except TypeError as e:  # the loop's signature changed: report, don't fail the benchmark
        return {"error": str(e)}
    per_step, examples = cache_copies_in_hlo(compiled, cache, entry=False)
    total, _ = cache_copies_in_hlo(compiled, cache)
    return {"batch": batch, "per_step": per_step, "per_call": total - per_step, "examples": examples[:2]}


def time_step(target: Target, batch: int, steps: int, capacity: int, device, warmup: int = 10,
              width: int = 1) -> dict:
    params = jax.device_put(target.params, device)
    with jax.default_device(device):
        cache = target.init_cache(batch, capacity).with_lengths(jnp.full((batch,), START, jnp.int32))
        tokens = jnp.full((batch, width), 1, jnp.int32)
    cache = jax.device_put(cache, device)
    tokens = jax.device_put(tokens, device)
    step = make_step(target.forward, target.cfg).lower(params, cache, tokens).compile()
    n_copies, copies = cache_copies_in_hlo(step, cache)  # one step: everything in it runs every step
    kv_bytes = cache_bytes(cache)
    for _ in range(warmup):
        tokens, cache = step(params, cache, tokens)
    jax.block_until_ready(tokens)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens, cache = step(params, cache, tokens)
        tokens.block_until_ready()
        times.append(time.perf_counter() - t0)
    times_ms = np.array(times) * 1e3
    return {"backend": target.backend.name, "batch": batch, "width": width, "capacity": capacity,
            "median_ms": float(np.median(times_ms)), "p10_ms": float(np.percentile(times_ms, 10)),
            "p90_ms": float(np.percentile(times_ms, 90)), "kv_bytes": kv_bytes,
            "hlo_cache_sized_copies": n_copies, "hlo_copy_examples": copies[:3]}


def no_eos(target: Target) -> Target:
    return dataclasses.replace(target, cfg=target.cfg.replace(eos_token_ids=()))


def time_generate(target: Target, prompts: list[list[int]], batch: int, new_tokens: int) -> dict:
    """Greedy tok/s of specdec.generate; every row decodes new_tokens (EOS ignored, so rows are comparable)."""
    target = no_eos(target)
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)] if batch == 1 else \
        [(prompts * batch)[:batch]]
    for g in groups:  # compile every shape first
        generate(target, g, new_tokens, GREEDY)
    tokens = prefill = decode = 0.0
    for g in groups:
        out = generate(target, g, new_tokens, GREEDY)
        tokens += out.num_new_tokens
        prefill += out.prefill_seconds
        decode += out.decode_seconds
    return {"batch": batch, "rows": sum(len(g) for g in groups), "new_tokens": int(tokens),
            "decode_tok_s": tokens / decode, "end_to_end_tok_s": tokens / (prefill + decode),
            "decode_ms_per_step": 1e3 * decode / (tokens / batch)}


def time_transformers(gguf_path, prompts: list[list[int]], new_tokens: int, threads: int) -> dict:
    import torch
    import transformers

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = hf_model(str(gguf_path))
        with torch.no_grad():
            warm = torch.tensor([prompts[0]])
            model.generate(warm, attention_mask=torch.ones_like(warm), do_sample=False, max_new_tokens=4,
                           eos_token_id=None, pad_token_id=0)
            tokens, seconds = 0, 0.0
            for p in prompts:
                ids = torch.tensor([p])
                t0 = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                     max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
                seconds += time.perf_counter() - t0
                tokens += out.shape[1] - ids.shape[1]
    finally:
        torch.set_num_threads(before)
    return {"threads": threads, "new_tokens": tokens, "end_to_end_tok_s": tokens / seconds,
            "transformers": transformers.__version__, "torch": torch.__version__}


def gpu_peak(device) -> float:
    kind = getattr(device, "device_kind", "")
    for name, bw in GPU_PEAK_BANDWIDTH.items():
        if name.lower() in kind.lower():
            return bw
    return DEFAULT_GPU_PEAK


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=registry.DEFAULT_MODEL, help="registry name, .gguf path or HF directory")
    ap.add_argument("--steps", type=int, default=300, help="timed decode steps per configuration (median)")
    ap.add_argument("--capacity", type=int, default=512, help="KV cache slots (attention reads all of them)")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens per prompt in the end-to-end runs")
    ap.add_argument("--torch-threads", default="auto",
                    help="torch threads for transformers: a number, or 'auto' = measure 1 and torch's default")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-scan", action="store_true")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="tokens per row of the timed verify-width steps (the cost of a round of k drafts is the "
                         "step over k + 1 tokens)")
    ap.add_argument("--width-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="what to measure (default: everything)")
    add_output_arg(ap, __file__)
    args = ap.parse_args(argv)
    if "transformers" not in args.sections:
        args.skip_transformers = True

    report = Report(__file__, argv, args.out)
    cpu = jax.devices("cpu")[0]
    cfg, np_params, tokenizer = load_checkpoint(args.model)
    reference = Target.from_params(cfg, np_params, tokenizer, backend="reference")
    p_bytes = param_bytes(reference.params)
    prompts = [tokenizer.encode_chat(p) for p in PROMPTS]
    summary = {"model": args.model, "param_bytes": p_bytes, "num_parameters": cfg.num_parameters(), "timed_steps": args.steps,
               "capacity": args.capacity, "new_tokens": args.new_tokens}
    print(f"# {cfg.name}: {cfg.num_parameters() / 1e6:.1f}M params, {p_bytes / 1e6:.0f} MB {cfg.dtype}; "
          f"jax {jax.__version__}, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f}", flush=True)

    bw = measure_bandwidth(cpu)
    floor_ms = 1e3 * p_bytes / (bw["GBps"] * 1e9)
    summary["cpu_bandwidth"] = bw
    summary["cpu_floor_ms"] = floor_ms
    print(f"bandwidth: matvec {bw['matvec_GBps']:.1f} GB/s, copy {bw['copy_GBps']:.1f} GB/s -> "
          f"floor {floor_ms:.2f} ms/step ({1e3 / floor_ms:.0f} tok/s at B=1)", flush=True)

    # -- jitted single-token step ------------------------------------------------------------------------
    targets = [reference]
    if not args.skip_scan and "steps" in args.sections:  # only the single-token step compares backends
        targets.append(Target.from_params(cfg, np_params, tokenizer, backend="scan"))
    steps = []
    for target in targets if "steps" in args.sections else []:
        for batch in (1, 8):
            r = time_step(target, batch, args.steps, args.capacity, cpu)
            r["floor_ms"] = floor_ms
            r["floor_with_kv_ms"] = 1e3 * (p_bytes + r["kv_bytes"]) / (bw["GBps"] * 1e9)
            r["ratio_to_floor"] = r["median_ms"] / floor_ms
            steps.append(r)
            print(f"step {r['backend']:9s} B={batch}: {r['median_ms']:.2f} ms (p10 {r['p10_ms']:.2f}, "
                  f"p90 {r['p90_ms']:.2f}) = {r['ratio_to_floor']:.2f}x floor; "
                  f"cache-sized HLO copies: {r['hlo_cache_sized_copies']}", flush=True)
    summary["steps"] = steps

    # -- step cost by tokens per row (the price of verifying k drafts) ------------------------------------
    widths = []
    for batch in args.width_batches if "widths" in args.sections else []:
        for width in args.widths:
            r = time_step(reference, batch, max(20, args.steps // 10), args.capacity, cpu, warmup=3, width=width)
            widths.append(r)
            base = next((w["median_ms"] for w in widths if w["batch"] == batch and w["width"] == 1), None)
            r["ratio_to_width_1"] = r["median_ms"] / base if base else None  # None: width 1 not measured
            print(f"step B={batch} x {width} tokens: {r['median_ms']:.2f} ms (p10 {r['p10_ms']:.2f}, p90 "
                  f"{r['p90_ms']:.2f})" + (f" = {r['ratio_to_width_1']:.2f}x one token" if base else ""), flush=True)
    summary["widths"] = widths

    # -- end-to-end greedy -------------------------------------------------------------------------------
    e2e = [time_generate(reference, prompts, b, args.new_tokens) for b in (1, 8)] if "generate" in args.sections else []
    for r in e2e:
        print(f"generate B={r['batch']}: {r['decode_tok_s']:.1f} tok/s decode, {r['end_to_end_tok_s']:.1f} "
              f"tok/s with prefill ({r['decode_ms_per_step']:.2f} ms/step)", flush=True)
    summary["generate"] = e2e
    loops = [decode_loop_copies(reference, b, args.capacity, args.new_tokens) for b in (1, 8)
             if "generate" in args.sections]
    for r in loops:
        if "error" not in r:
            print(f"generate decode_loop B={r['batch']}: cache-sized HLO copies {r['per_step']} per step, "
                  f"{r['per_call']} once per call", flush=True)
    summary["decode_loop_hlo"] = loops

    # -- transformers ------------------------------------------------------------------------------------
    hf = []
    if not args.skip_transformers:
        try:
            import torch
        except ImportError:
            print("transformers/torch not installed: skipped (pip install -e '.[parity]')")
        else:
            if args.torch_threads == "auto":
                threads = sorted({1, torch.get_num_threads()})
            else:
                threads = [int(args.torch_threads)]
            gguf_path = registry.resolve(args.model)
            if gguf_path.suffix == ".gguf":
                for n in threads:
                    r = time_transformers(gguf_path, prompts, args.new_tokens, n)
                    hf.append(r)
                    print(f"transformers B=1 ({n} thread{'s' if n > 1 else ''}): {r['end_to_end_tok_s']:.1f} "
                          "tok/s with prefill", flush=True)
            else:
                print("transformers comparison needs a .gguf model: skipped")
    summary["transformers"] = hf

    # -- GPU (if JAX sees one) ---------------------------------------------------------------------------
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    gpu = []
    if gpus and "gpu" in args.sections:
        dev = gpus[0]
        peak = gpu_peak(dev)
        gbw = measure_bandwidth(dev, nbytes=2 << 30, reps=30)
        gfloor = 1e3 * p_bytes / peak
        for batch in (1, 8):
            r = time_step(reference, batch, args.steps, args.capacity, dev)
            r.update(device=dev.device_kind, peak_GBps=peak / 1e9, measured_GBps=gbw["GBps"], floor_ms=gfloor,
                     ratio_to_floor=r["median_ms"] / gfloor)
            gpu.append(r)
            print(f"GPU {dev.device_kind} step B={batch}: {r['median_ms']:.3f} ms = {r['ratio_to_floor']:.2f}x floor "
                  f"({p_bytes / 1e6:.0f} MB / {peak / 1e12:.2f} TB/s = {gfloor:.3f} ms; copy measured "
                  f"{gbw['GBps']:.0f} GB/s)", flush=True)
    summary["gpu"] = gpu

    report.finish()
    add_tables(report, summary)
    report.write(summary)
    return summary


def add_tables(report: Report, s: dict) -> None:
    """The summary's tables, in the shared result schema."""
    bw = s["cpu_bandwidth"]
    report.table("Weights and the bandwidth floor", ["measurement", "value"], [
        ["weights", f"{s['param_bytes'] / 1e6:.0f} MB ({s['num_parameters'] / 1e6:.1f}M params)"],
        ["bandwidth (matvec / copy)", f"{bw['matvec_GBps']:.1f} / {bw['copy_GBps']:.1f} GB/s"],
        ["floor = weights / bandwidth", f"{s['cpu_floor_ms']:.2f} ms"]])
    if s["steps"]:
        report.table("The jitted single-token step", ["step", "B", "median ms", "p10-p90 ms", "x floor",
                                                      "floor incl. KV", "ms/token", "cache-sized copies"],
                     [[r["backend"], r["batch"], f"{r['median_ms']:.2f}", f"{r['p10_ms']:.2f}-{r['p90_ms']:.2f}",
                       f"{r['ratio_to_floor']:.2f}", f"{r['floor_with_kv_ms']:.2f}",
                       f"{r['median_ms'] / r['batch']:.2f}", r["hlo_cache_sized_copies"]] for r in s["steps"]],
                     note=f"median of {s['timed_steps']} steps, {s['capacity']} cache slots")
    if s.get("widths"):
        report.table("The step over T tokens per row (a round verifying T - 1 drafts)",
                     ["backend", "B", "T", "median ms", "p10-p90 ms", "x one token (same B)"],
                     [["reference", r["batch"], r["width"], f"{r['median_ms']:.2f}",
                       f"{r['p10_ms']:.2f}-{r['p90_ms']:.2f}",
                       "-" if r["ratio_to_width_1"] is None else f"{r['ratio_to_width_1']:.2f}"] for r in s["widths"]])
    if s["generate"] or s["transformers"]:
        rows = [[f"specdec.generate B={r['batch']}", f"{r['decode_tok_s']:.1f}", f"{r['end_to_end_tok_s']:.1f}"]
                for r in s["generate"]]
        rows += [[f"transformers B=1, {r['threads']} torch thread(s)", "-", f"{r['end_to_end_tok_s']:.1f}"]
                 for r in s["transformers"]]
        report.table(f"Greedy decoding, {s['new_tokens']} new tokens per prompt",
                     ["method", "tok/s (decode only)", "tok/s (incl. prefill)"], rows)
    loops = [r for r in s.get("decode_loop_hlo", []) if "error" not in r]
    if loops:
        report.table("generate's compiled decode loop", ["B", "cache-sized copies per step", "once per call"],
                     [[r["batch"], r["per_step"], r["per_call"]] for r in loops])
    if s["gpu"]:
        report.table("GPU step", ["device", "B", "median ms", "floor ms (weights / peak HBM)", "x floor"],
                     [[r["device"], r["batch"], f"{r['median_ms']:.3f}", f"{r['floor_ms']:.3f}",
                       f"{r['ratio_to_floor']:.2f}"] for r in s["gpu"]])


if __name__ == "__main__":
    main()
