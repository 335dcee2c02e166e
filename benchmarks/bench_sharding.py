"""Collectives per step of the sharded target, read from the compiled HLO, against the Megatron-TP count.

On a simulated CPU mesh (8 devices by default: the device count is fixed when JAX starts, so this script sets
XLA_FLAGS itself) it compiles the two steps a speculative run repeats, with the target placed by
`specdec.sharding`:
  decode  one new token per row through `target.forward`, then greedy sampling (`specdec.sampling.sample`);
  verify  the engine's own `verify_and_commit` on a chain of k draft tokens (greedy_chain policy);
and counts all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute instructions and the bytes
they move, per device, in the compiled module. The reference backend walks the layers unrolled, so an
instruction in the text runs exactly once per step.

Expected for Megatron-style tensor parallelism over `model` (m > 1), per step:
  all-reduce  2 per layer (the row-parallel wo and w_down outputs) + 1 (the vocabulary-parallel embedding
              lookup), each B x T x hidden floats;
  logits      one more collective for the vocabulary-parallel logits (all-gather of B x T x V, or the
              cross-shard max/argmax reductions a sampler needs, which are smaller);
  data axis   nothing: rows are independent.

    python -m benchmarks.bench_sharding                    # 1x8, 2x4, 4x2 and 8x1 (data x model) meshes
    python -m benchmarks.bench_sharding --meshes 2x4 --layers 8 --batch 8
"""

from __future__ import annotations

import argparse
import os
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1, "s64": 8, "f64": 8}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--meshes", default="1x8,2x4,4x2,8x1", help="data x model meshes, comma separated")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--draft", type=int, default=4, help="draft tokens per verify step (T = draft + 1)")
    p.add_argument("--out", default=None, help="where results.json and results.md go "
                                               "(default runs/benchmarks/bench_sharding)")
    return p.parse_args(argv)


def hlo_collectives(hlo: str) -> list[tuple[str, int, str]]:
    """(collective, bytes of its result per device, the JAX op it was partitioned from) for every collective
    instruction in compiled HLO text."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", line)
        if not m:
            continue
        nbytes = 0
        for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            nbytes += n * DTYPE_BYTES.get(dtype, 4)
        op = re.search(r'op_name="[^"]*/([^"/]+)"', line)
        found.append((m.group(2), nbytes, op.group(1) if op else "?"))
    return found


def main(argv=None) -> int:
    args = parse_args(argv)
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from drafters import create_drafter
    from specdec import engine
    from specdec.drafter import Draft
    from specdec.generate import prefill
    from specdec.models.config import tiny_config
    from specdec.sampling import GREEDY, sample
    from specdec.sharding import make_mesh, shard_target
    from specdec.target import random_target
    from specdec.verify import get_policy

    from types import SimpleNamespace

    from benchmarks.common import DEFAULT_OUT, Report  # after XLA_FLAGS: the report reads the backend

    report = Report(__file__, argv, args.out or DEFAULT_OUT / "bench_sharding")
    cfg = tiny_config(num_layers=args.layers, num_heads=16, num_kv_heads=8, head_dim=16, hidden_size=256,
                      intermediate_size=512, vocab_size=1024)
    plain = random_target(cfg, seed=0, backend="reference")
    b, k, h, L = args.batch, args.draft, cfg.hidden_size, cfg.num_layers
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, 16)), jnp.int32)
    lengths = jnp.full((b,), 16, jnp.int32)
    drafter = create_drafter("ngram", plain, k)

    def decode_step(params, cache, token):
        out = plain.forward(params, cfg, cache, token[:, None])
        return sample(jax.random.PRNGKey(0), out.logits[:, 0], GREEDY), out.cache.advance(1)

    print(f"model: {L} layers, hidden {h}, {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, vocab "
          f"{cfg.vocab_size}; batch {b}; decode T=1, verify T={k + 1} (chain of {k}); reference backend; "
          f"{jax.device_count()} simulated {jax.devices()[0].platform} devices; jax {jax.__version__}")
    print("Collectives per step in the compiled HLO: count (KiB per device). `by op`: the JAX operation each was "
          "partitioned from\n(dot_general = row-parallel matmul, gather = embedding lookup, scatter = KV-cache write, "
          "reduce/argmax = the sampler or policy over vocabulary-sharded logits).\n")
    header = f"{'mesh':>4} {'step':>6} " + " ".join(f"{c:>18}" for c in COLLECTIVES)
    print(header + "   expected all-reduce (Megatron TP)   by op")
    table = []
    for spec_text in args.meshes.split(","):
        data, model = (int(x) for x in spec_text.lower().split("x"))
        target = shard_target(plain, make_mesh(SimpleNamespace(data=data, model=model)))
        cache = target.init_cache(b, 64)
        _, _, cache = prefill(target.params, cache, prompt, lengths, forward=target.forward, cfg=cfg)
        spec = engine.LoopSpec(cfg=cfg, forward=target.forward, drafter=drafter, policy=get_policy("greedy_chain"),
                               sampling=GREEDY, eos_ids=cfg.eos_token_ids)
        first = jnp.zeros((b, cfg.vocab_size), jnp.float32)
        _, state = engine._initial_state(spec, prompt, lengths, first, cache, jax.random.PRNGKey(0), 32, capacity=64)
        draft = Draft(tokens=jnp.asarray(rng.integers(3, cfg.vocab_size, (b, k)), jnp.int32),
                      parents=jnp.broadcast_to(jnp.arange(-1, k - 1, dtype=jnp.int32), (b, k)), probs=None,
                      valid=jnp.ones((b, k), bool))
        steps = {
            "decode": (jax.jit(decode_step).lower(target.params, cache, prompt[:, 0]), 1),
            "verify": (jax.jit(engine.verify_and_commit, static_argnums=0).lower(spec, target.params, state, draft),
                       k + 1),
        }
        for name, (lowered, t) in steps.items():
            found = hlo_collectives(lowered.compile().as_text())
            cells = []
            for c in COLLECTIVES:
                mine = [nb for kind, nb, _ in found if kind == c]
                cells.append(f"{len(mine):>5d} ({sum(mine) / 1024:7.1f})" if mine else f"{'0':>18}")
            by_op: dict[str, int] = {}
            for kind, _, op in found:
                by_op[f"{kind}:{op}"] = by_op.get(f"{kind}:{op}", 0) + 1
            rows = b // data if b % data == 0 else b  # rows per device (a batch that does not divide is replicated)
            expected = (f"{2 * L + 1:>5d} ({(2 * L + 1) * rows * t * h * 4 / 1024:7.1f})" if model > 1
                        else f"{'0':>18}")
            ops = ", ".join(f"{n} {op}" for op, n in sorted(by_op.items()))
            print(f"{spec_text:>4} {name:>6} {' '.join(cells)}   {expected:>33}   {ops}")
            table.append([spec_text, name, *(re.sub(r"\(\s+", "(", c.strip()) for c in (*cells, expected)), ops])
    writes = cache_write_table(args, cfg, make_mesh, SimpleNamespace)
    report.finish()
    report.table("Collectives per step of the sharded target", ["mesh", "step", *COLLECTIVES,
                                                                "expected all-reduce (Megatron TP)", "by op"], table,
                 note=f"count (KiB per device); {L} layers, hidden {h}, batch {b}, verify T={k + 1}; "
                      f"{jax.device_count()} simulated devices", echo=False)
    if writes:
        report.table(f"KV-cache write alone (one layer, B={b}, T={k + 1})",
                     ["mesh", "transformer.write_rows", "scatter batched over rows and KV heads", "values"], writes,
                     echo=False)
    report.write({"steps": table, "cache_writes": writes})
    return 0


def cache_write_table(args, cfg, make_mesh, namespace) -> list[list[str]]:
    """The KV-cache write alone, on each mesh: `transformer.write_rows` (one scatter indexed by explicit
    (row, KV head, slot) triples) against the same write as a scatter batched over rows and KV heads (vmap), whose
    batch dimensions XLA's partitioner keeps local. Same values; only the collectives differ."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specdec import sharding
    from specdec.models import transformer

    def batched_write(cache_layer, new, lengths):
        t = new.shape[1]
        seq = sharding.kv_head_axis(cache_layer.ndim) + 1  # [B, KVH, S, HD]: the sequence follows the heads
        start = jnp.clip(lengths, 0, cache_layer.shape[seq] - t)
        one = lambda c, n, s: c.at[s + jnp.arange(t)].set(n, mode="promise_in_bounds", unique_indices=True)
        return jax.vmap(jax.vmap(one, (0, 0, None)))(cache_layer, jnp.swapaxes(new, 1, 2), start)

    b, t = args.batch, args.draft + 1
    leaf = jax.eval_shape(lambda: transformer.init_cache(cfg, b, 64)).k[0]
    if sharding.kv_head_axis(leaf.ndim) != 1:
        print("\n(cache-write comparison skipped: it assumes the [B, KVH, S, HD] cache layout)")
        return []
    print(f"\nKV-cache write alone (one layer, B={b}, T={t}): collectives in the compiled write")
    print(f"{'mesh':>4} {'transformer.write_rows':>40} {'scatter batched over rows and KV heads':>40}")
    rng = np.random.default_rng(0)
    new_np = rng.standard_normal((b, t, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
    lengths = jnp.asarray(rng.integers(0, 32, b), jnp.int32)
    rows = []
    for spec_text in args.meshes.split(","):
        data, model = (int(x) for x in spec_text.lower().split("x"))
        mesh = make_mesh(namespace(data=data, model=model))
        cache = jax.device_put(jnp.zeros(leaf.shape, leaf.dtype),
                               sharding.named(mesh, sharding.cache_specs(mesh, transformer.KVCache(
                                   k=(leaf,), v=(leaf,), lengths=lengths)).k[0]))
        new = jax.device_put(new_np, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
            sharding.DATA if b % data == 0 else None, None, sharding.MODEL)))
        cells, values = [], []
        for fn in (transformer.write_rows, batched_write):
            compiled = jax.jit(fn).lower(cache, new, lengths).compile()
            found = hlo_collectives(compiled.as_text())
            cells.append(", ".join(f"{sum(1 for k, _, _ in found if k == c)} {c} "
                                   f"({sum(nb for k, nb, _ in found if k == c) / 1024:.1f} KiB)"
                                   for c in COLLECTIVES if any(k == c for k, _, _ in found)) or "none")
            values.append(np.asarray(compiled(cache, new, lengths)))
        same = "same values" if np.array_equal(*values) else "VALUES DIFFER"
        print(f"{spec_text:>4} {cells[0]:>40} {cells[1]:>40}   {same}")
        rows.append([spec_text, cells[0], cells[1], same])
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
