"""specdec against its peers on the same weights and the same chat-templated prompts, in ONE run.

    python -m benchmarks.bench_peers CONFIG.yaml [CONFIG.yaml ...] [section.key=value ...] [--repeats R]

Greedy, batch 1, the prompts of the configs' `data:` section (loaded as `specdec run` loads them), each decoded by:
  * specdec AR (`specdec.generate.generate`) and specdec speculative decoding, one method per config (as in
    bench_speculative.py: the configs must agree on model, data, generation and sampling), compile excluded by a
    warm-up;
  * transformers (same GGUF, float32): plain greedy `generate` and prompt lookup (`prompt_lookup_num_tokens`);
  * llama.cpp through llama-cpp-python (optional: `pip install llama-cpp-python`, builds from source in a few
    minutes), on a float32 GGUF written from the model's own GGUF with the `gguf` package (every tensor
    dequantized; the same float32 weights specdec runs), plain and with its prompt-lookup draft model
    (`LlamaPromptLookupDecoding`), `--threads` threads (default: all cores).

Peers time their whole call, prefill included, so every tok/s here is new tokens / (prefill + decode); the
ratios printed at the end (specdec / peer) are from this one run on this machine. The methods are interleaved
prompt by prompt (every method decodes prompt 1, then every method prompt 2, ...; in the reverse order on odd
passes), so each pass compares them over the same minute of the machine; with --repeats R there are R such passes, and each figure is the median over
the passes (of tok/s, and of each per-pass ratio; with R >= 5 the specdec / peer ratios also print a
distribution-free 90% interval of that median, `benchmarks.common.median_interval`). Greedy outputs are compared
token for token with specdec's AR (transformers and llama.cpp accumulate float32 differently, so a long
output may drift at a near-tie; the count of identical prompts is printed).

    python -m benchmarks.bench_peers configs/benchmarks/ngram.yaml configs/benchmarks/suffix.yaml --repeats 3
    python -m benchmarks.bench_peers configs/benchmarks/ngram.yaml data.datasets.0.limit=1 \
        generation.max_new_tokens=8 --skip-llama-cpp                 # a smoke test
Writes runs/benchmarks/bench_peers/results.{json,md} (`--out`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (Report, add_output_arg, build_methods, decode_ar, decode_method, hf_model,
                               interval_text, load_config_prompts, median_interval, method_configs_of,
                               run_hf_prompt_lookup)
from experiments.build import build_target
from specdec.models import registry


def write_f32_gguf(src: Path, dst: Path) -> Path:
    """The GGUF `src` with every tensor dequantized to float32 (metadata copied), for llama.cpp."""
    import gguf

    if dst.is_file():
        return dst
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst) + ".partial", arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name == "general.file_type":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, vtype)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        data = gguf.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]),
                          raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(dst) + ".partial", dst)
    return dst


def llama_cpp_decoder(gguf_path: Path, max_new: int, eos, threads: int, lookup: int = 0):
    """A llama.cpp greedy decoder of one token-id prompt (`decode(prompt) -> new tokens`), loaded and warmed up;
    lookup > 0: prompt-lookup drafting of that many tokens."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False, draft_model=draft, logits_all=bool(lookup))

    def decode(p):
        llm.reset()
        out = []
        for tok in llm.generate(p, temp=0.0, top_k=1, reset=True):
            out.append(int(tok))
            if tok in eos or len(out) >= max_new:
                break
        return out

    decode([1, 2, 3, 4, 5, 6, 7, 8])  # warm-up
    return decode


def run_hf_plain(gguf_path: str, prompts, max_new: int, eos):
    import torch

    model = hf_model(gguf_path)
    kwargs = dict(do_sample=False, num_beams=1, max_new_tokens=max_new, eos_token_id=list(eos) or None,
                  pad_token_id=eos[0] if eos else 0)
    outputs, seconds = [], 0.0
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            seconds += time.perf_counter() - t0
            outputs.append(out[0, ids.shape[1]:].tolist())
    tokens = sum(len(o) for o in outputs)
    return outputs, {"new_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("items", nargs="+", metavar="CONFIG.yaml | section.key=value",
                    help="experiment configs (one specdec method each; a sweep file: one per run) and overrides "
                         "applied to every one; their model, data and generation sections are the run's")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="prompt-lookup draft length of the peers")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeats", type=int, default=1, help="passes over every method, interleaved (medians)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    add_output_arg(ap, __file__)
    args = ap.parse_args(argv)
    method_configs = method_configs_of(ap, args.items)
    cfg = method_configs[0][1]
    if cfg.generation.batch_size != 1 or cfg.sampling.temperature != 0:
        ap.error("the peers decode greedily at batch 1: set generation.batch_size=1 and sampling.temperature=0")
    gguf_path = registry.resolve(cfg.model.name)
    if gguf_path.suffix != ".gguf":
        ap.error(f"the peers need a .gguf model, got {gguf_path}")

    report = Report(__file__, argv, args.out)
    target = build_target(cfg.model, cfg.mesh)
    eos = tuple(target.eos_token_ids)
    max_new = cfg.generation.max_new_tokens
    loaded = load_config_prompts(cfg, target)
    items = loaded.items
    prompts = [loaded.ids[p.key] for p in items]
    print(f"# {target.cfg.name}; {len(prompts)} prompts ({', '.join(loaded.datasets)}), greedy, batch 1, {max_new} "
          f"new tokens; {os.cpu_count()} CPUs, load avg {report.meta['load_avg_start']}", flush=True)
    # name -> run(i): (output of prompt i, new tokens, seconds, prefill included), compile excluded
    methods = {}

    def specdec_ar(i):
        tokens, m = decode_ar(cfg, target, [prompts[i]], cfg.sampling.seed + i)
        return tokens[0], m.new_tokens, m.decode_seconds + m.prefill_seconds

    methods["specdec AR"] = specdec_ar
    for method in build_methods(method_configs, target):
        def specdec_spec(i, method=method):
            # suffix decoding's global corpus starts empty at each dataset of each pass and grows over its prompts
            if i == 0 or items[i].dataset != items[i - 1].dataset:
                method.reset()
            tokens, m = decode_method(method, target, [prompts[i]], cfg.sampling.seed + i)
            return tokens[0], m.new_tokens, m.decode_seconds + m.prefill_seconds

        methods[f"specdec {method.name}"] = specdec_spec
    if not args.skip_transformers:
        def hf(i, run, *extra):
            out, r = run(str(gguf_path), [prompts[i]], max_new, eos, *extra)
            return out[0], r["new_tokens"], r["seconds"]

        methods["transformers greedy"] = lambda i: hf(i, run_hf_plain)
        methods[f"transformers prompt lookup ({args.lookup_tokens})"] = lambda i: hf(i, run_hf_prompt_lookup,
                                                                                     args.lookup_tokens)
    if not args.skip_llama_cpp:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python is not installed (pip install llama-cpp-python): llama.cpp skipped")
        else:
            f32 = write_f32_gguf(gguf_path, gguf_path.with_name(gguf_path.stem + ".f32.gguf"))
            for lookup in (0, args.lookup_tokens):
                decode = llama_cpp_decoder(f32, max_new, eos, args.threads, lookup)

                def llama(i, decode=decode):
                    t0 = time.perf_counter()
                    out = decode(prompts[i])
                    return out, len(out), time.perf_counter() - t0

                methods[f"llama.cpp f32 prompt lookup ({lookup})" if lookup else "llama.cpp f32 greedy"] = llama

    # A shared machine's speed drifts by 10-30% over minutes: methods run one after the other over all prompts
    # compare different machines. So every method decodes a prompt before any moves to the next, and the passes
    # repeat that; the tables report the median over passes of each method's tok/s and of each per-pass ratio.
    passes = {name: [] for name in methods}
    ref = None
    for p in range(args.repeats):
        outputs = {name: [] for name in methods}
        totals = {name: [0, 0.0] for name in methods}  # new tokens, seconds
        for i in range(len(prompts)):
            for name, run in (methods.items() if p % 2 == 0 else reversed(methods.items())):
                out, new_tokens, seconds = run(i)
                outputs[name].append(out)
                totals[name][0] += new_tokens
                totals[name][1] += seconds
        ref = outputs["specdec AR"] if ref is None else ref
        for name in methods:
            new_tokens, seconds = totals[name]
            same = sum(a == b for a, b in zip(outputs[name], ref))
            passes[name].append({"tok_s": new_tokens / seconds, "new_tokens": new_tokens, "seconds": seconds,
                                 "same": same})
            print(f"  pass {p + 1}/{args.repeats}  {name:45s} {new_tokens / seconds:6.1f} tok/s (incl. prefill)  "
                  f"same as specdec AR {same}/{len(ref)}", flush=True)
    report.finish()
    rows = []
    for name, runs in passes.items():
        ratio = np.median([r["tok_s"] / a["tok_s"] for r, a in zip(runs, passes["specdec AR"])])
        rows.append({"method": name, "tok_s": float(np.median([r["tok_s"] for r in runs])),
                     "x_specdec_ar": float(ratio), "passes": runs,
                     "same_as_specdec_ar": f"{min(r['same'] for r in runs)}/{len(ref)}"})
    report.table("specdec and its peers", ["method", f"tok/s incl. prefill (median of {args.repeats})",
                                           "x specdec AR (median per pass)", "same as specdec AR"],
                 [[r["method"], f"{r['tok_s']:.1f}", f"{r['x_specdec_ar']:.2f}x", r["same_as_specdec_ar"]]
                  for r in rows],
                 note=f"greedy, batch 1, {max_new} new tokens, {len(prompts)} prompts; peers time their whole call")
    peers = [r for r in rows if not r["method"].startswith("specdec")]
    ours = [r for r in rows if r["method"].startswith("specdec")]
    ratios = []
    if peers:
        best = max(ours, key=lambda r: r["tok_s"])
        for peer in peers:
            def ratio(mine):
                per_pass = [m["tok_s"] / q["tok_s"] for m, q in zip(mine["passes"], peer["passes"])]
                # the median, with its 90% distribution-free interval from 5 passes on
                return f"{np.median(per_pass):.2f}" + interval_text(median_interval(per_pass))
            ratios.append([peer["method"], ratio(ours[0]), f"{ratio(best)} ({best['method']})"])
        report.table("specdec / peer", ["peer", "specdec AR / peer", "best specdec / peer"], ratios,
                     note="median over passes of the per-pass tok/s ratios (90% interval from 5 passes on)")
    report.write({"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
