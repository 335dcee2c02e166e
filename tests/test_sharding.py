"""Sharding (specdec/sharding.py): tensor-parallel target, data-parallel drafter training, checkpoints across meshes.

The multi-device checks need 8 devices, and XLA fixes the device count when JAX starts; so they run in ONE child
process started here with XLA_FLAGS=--xla_force_host_platform_device_count=8 (`python -m tests.test_sharding`),
which runs every check, reports each result as JSON, and the tests below assert one check each. This process,
and so the rest of the suite, keeps its normal single default device (test_this_process_has_one_device).

What the child proves, on CPU with 8 simulated devices:
- target logits, hidden states, taps and the written KV cache on 2x4, 4x2 and 8x1 (data x model) meshes equal
  the unsharded ones (reference backend on every mesh, scan backend on 4x2), and the weights and cache really are
  split (heads over `model`, KV heads of the cache over `model`);
- greedy speculative decoding in the compiled loop (n-gram lookup chains on 2x4; self-speculation trees, drafted
  with the target's own sharded first layer and verified with cache compaction, on 4x2) and AR decoding with a
  sharded target give token for token the unsharded AR output;
- data-parallel training through `train()` (Medusa on the tiny target: batch over `data`, target tensor-parallel
  over `model`) takes the same step as one device on the same global batch (same loss, same Adam moments, so the
  same gradients), and a run killed on a 4x2 mesh resumes from its orbax checkpoint on 8x1 and ends where the
  one-device run ends;
- a training state saved on a 4x2 mesh (matrices split over `model`) restores on 8x1 and on one device with the
  requested shardings and bitwise-equal values.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest

from specdec.testing import child_result

ROOT = Path(__file__).resolve().parents[1]
NUM_DEVICES = 8
TP_CFG = dict(num_heads=8, num_kv_heads=4, head_dim=8, vocab_size=256)  # heads, KV heads, vocab split 1/2/4 ways
MESHES = ((2, 4), (4, 2), (8, 1))  # (data, model)
TRAIN_TASK, TRAIN_OPTIONS, TRAIN_LR = "medusa", {"num_heads": 2}, 3e-3  # the cheapest drafter to compile


# ------------------------------------------------------------------------------------------------------------
# Single-device checks (this process)
# ------------------------------------------------------------------------------------------------------------

def test_this_process_has_one_device():
    import jax

    assert jax.device_count() == 1, "the multi-device checks must not change the suite's own device count"


def test_kv_head_axis_follows_the_cache_layout():
    import jax

    from specdec.models import transformer
    from specdec.models.config import tiny_config
    from specdec.sharding import kv_head_axis

    cfg = tiny_config(num_kv_heads=2, num_heads=6, head_dim=6, num_layers=3)
    for stacked in (False, True):
        cache = jax.eval_shape(lambda: transformer.init_cache(cfg, batch_size=5, capacity=7, stacked=stacked))
        leaf = jax.tree.leaves(cache.k)[0]
        assert leaf.shape[kv_head_axis(leaf.ndim)] == cfg.num_kv_heads
        assert leaf.shape[leaf.ndim - 4] == 5  # the batch axis cache_specs splits over `data`


def test_mesh_larger_than_the_devices_is_a_clear_error():
    from specdec.sharding import ShardingError, make_mesh

    with pytest.raises(ShardingError, match=r"data=4 x model=2 needs 8 devices, but JAX sees 1.*"
                                            r"xla_force_host_platform_device_count=8"):
        make_mesh(SimpleNamespace(data=4, model=2))
    with pytest.raises(ShardingError, match=r"mesh.devices=3 must equal"):
        make_mesh(SimpleNamespace(data=1, model=1, devices=3))


def test_model_axis_must_divide_heads_and_names_the_allowed_sizes():
    from specdec.models.config import ModelConfig
    from specdec.sharding import ShardingError, check_model_axis

    # SmolLM2-135M's shape: 9 heads, 3 KV heads
    smol = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                       num_kv_heads=3, head_dim=64, name="smollm2-135m-instruct")
    with pytest.raises(ShardingError) as e:
        check_model_axis(smol, 2)
    msg = str(e.value)
    assert "mesh.model=2" in msg and "num_heads=9" in msg and "num_kv_heads=3" in msg
    assert "Allowed mesh.model sizes for this model: 1, 3" in msg
    check_model_axis(smol, 3)  # 3 divides everything


def test_partition_specs():
    import jax
    from jax.sharding import PartitionSpec as P

    from specdec.models import transformer
    from specdec.models.config import tiny_config
    from specdec.sharding import MODEL, param_specs

    cfg = tiny_config(tie_word_embeddings=False, attention_bias=True, qk_norm=True)
    stacked = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
    specs = param_specs(stacked)
    assert specs["embed"] == P(MODEL, None) and specs["lm_head"] == P(None, MODEL)
    assert specs["final_norm"] == P()
    layers = specs["layers"]
    for name in ("wq", "wk", "wv", "w_gate", "w_up"):  # column-parallel, behind the replicated layer axis
        assert layers[name] == P(None, None, MODEL), name
    for name in ("wo", "w_down"):  # row-parallel
        assert layers[name] == P(None, MODEL, None), name
    assert layers["bq"] == P(None, MODEL) and layers["q_norm"] == P() and layers["attn_norm"] == P()
    per_layer = param_specs(jax.eval_shape(lambda: transformer.unstack_layers(
        transformer.init_params(cfg, jax.random.PRNGKey(0)))))["layers"]
    assert per_layer[0]["wq"] == P(None, MODEL) and per_layer[1]["wo"] == P(MODEL, None)


def test_to_host_and_no_mesh_are_no_ops():
    import jax.numpy as jnp
    import numpy as np

    from specdec.sharding import check_batch, mesh_of, place_batch, place_drafter_state, to_host

    x = jnp.arange(6).reshape(2, 3)
    assert isinstance(to_host(x), np.ndarray) and to_host(x).tolist() == [[0, 1, 2], [3, 4, 5]]
    tree = {"a": x}
    assert place_batch(tree, None) is tree and place_drafter_state(tree, None) is tree
    check_batch(3, None, "train.batch_size")  # no mesh: any batch size
    assert mesh_of(object()) is None


def test_run_config_checks():
    from experiments.build import check_supported
    from specdec.config import load_config

    tiny = ROOT / "configs" / "experiments" / "tiny.yaml"
    check_supported(load_config(tiny, ["mesh.data=2", "mesh.model=4", "generation.batch_size=4"]))  # honoured
    bad = load_config(tiny, ["mesh.data=2", "generation.batch_size=3"])
    with pytest.raises(ValueError, match=r"generation.batch_size=3 is not divisible by mesh.data=2"):
        check_supported(bad)


# ------------------------------------------------------------------------------------------------------------
# Multi-device checks (the child process)
# ------------------------------------------------------------------------------------------------------------

CHECKS = ("logits", "speculative", "train_step", "checkpoint")


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """Run every multi-device check once in a child with 8 simulated CPU devices; {check: "ok" | error text}."""
    work = tmp_path_factory.mktemp("sharding")
    env = {"JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                         f" --xla_force_host_platform_device_count={NUM_DEVICES}").strip()}
    return child_result("tests.test_sharding", str(work), env=env)


@pytest.mark.parametrize("check", CHECKS)
def test_on_8_devices(child, check):
    assert child.get(check) == "ok", f"{check} on {NUM_DEVICES} simulated devices:\n{child.get(check)}"


def _mesh(data, model):
    from specdec.sharding import make_mesh

    return make_mesh(SimpleNamespace(data=data, model=model))


def _specs(x):
    import jax

    return [tuple(a.sharding.spec) for a in jax.tree.leaves(x)]


def check_logits(work):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specdec.models.config import tiny_config
    from specdec.sharding import MODEL, ShardedTarget, kv_head_axis, shard_target
    from specdec.target import random_target

    cfg = tiny_config(**TP_CFG)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (4, 8)), jnp.int32)
    step = jax.jit(lambda fwd, p, c, x: fwd(p, cfg, c, x, taps=(0, 1, 2)), static_argnums=0)
    for backend, meshes in (("reference", MESHES), ("scan", MESHES[1:2])):  # the scan backend: stacked layers
        plain = random_target(cfg, seed=0, backend=backend, scale=0.35)
        want = step(plain.forward, plain.params, plain.init_cache(4, 32), tokens)
        for data, model in meshes:
            target = shard_target(plain, _mesh(data, model))
            assert isinstance(target, ShardedTarget)
            cache = target.init_cache(4, 32)
            if model > 1:  # the layout really is split: heads over `model`, and the cache by KV heads
                wq = jax.tree.leaves(target.params["layers"][0]["wq"] if backend == "reference"
                                     else target.params["layers"]["wq"])[0]
                assert wq.sharding.spec[-1] == MODEL and wq.addressable_shards[0].data.shape[-1] == cfg.q_size // model
                leaf = jax.tree.leaves(cache.k)[0]
                assert leaf.addressable_shards[0].data.shape[kv_head_axis(leaf.ndim)] == cfg.num_kv_heads // model
            got = step(target.forward, target.params, cache, tokens)
            where = f"{backend} mesh {data}x{model}"
            # the all-reduce order of a 2x4 mesh moves the logits' last bits: 1.5e-5 absolute (2.7e-4 relative on a
            # near-zero logit) on this project's 2-core VMs of 2026-12-01, where 1e-5 had passed before
            np.testing.assert_allclose(got.logits, want.logits, rtol=1e-4, atol=3e-5, err_msg=where)
            # the residual stream is O(1) here (peaky weights): all-reduce order moves its last bits (1.1e-4 on
            # one tap of 6,144 on one VM, where 1e-4 had passed on others)
            np.testing.assert_allclose(got.hidden, want.hidden, rtol=1e-4, atol=2e-4, err_msg=where)
            np.testing.assert_allclose(got.taps, want.taps, rtol=1e-4, atol=2e-4, err_msg=where)
            for a, b in zip(jax.tree.leaves(got.cache), jax.tree.leaves(want.cache)):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=where + " cache")


def check_speculative(work):
    from drafters import create_drafter
    from specdec.engine import speculative_generate
    from specdec.generate import generate
    from specdec.models.config import tiny_config
    from specdec.sharding import place_drafter_state, shard_target
    from specdec.target import random_target

    cfg = tiny_config(**TP_CFG)
    plain = random_target(cfg, seed=0, backend="reference", scale=0.35)  # peaky logits: no near-ties
    # a repeated prompt: its rows are prefilled once and copied into rows on other data shards
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [3, 4], [20, 21, 20, 21, 20, 21, 20, 21, 20, 21, 20], [3, 4]]
    ar = generate(plain, prompts, max_new_tokens=20).tokens  # unsharded AR == unsharded speculative: test_engine
    cases = [  # (mesh, drafter, settings, policy), all in the compiled loop
        ((2, 4), "ngram", {"max_ngram": 3}, "greedy_chain"),
        # drafts a tree with the target's own (sharded) first layer; verification compacts the sharded cache
        ((4, 2), "self_spec", {"num_layers": 1, "tree_top_k": 2, "tree_depth": 2}, "greedy_tree"),
    ]
    for (data, model), name, settings, policy in cases:
        target = shard_target(plain, _mesh(data, model))
        drafter = create_drafter(name, target, 4, **settings)
        if drafter.params is not None:
            drafter.params = place_drafter_state(drafter.params, target.mesh)
        out = speculative_generate(target, drafter, prompts, policy=policy, max_new_tokens=20)
        assert out.tokens == ar, f"{name} on mesh {data}x{model}: {out.tokens} != AR {ar}"
        assert out.metrics.accepted_draft_tokens > 0, f"{name}: nothing accepted, the check would be vacuous"
    assert generate(shard_target(plain, _mesh(2, 4)), prompts, max_new_tokens=20).tokens == ar, "sharded AR"


class _Kill(Exception):
    pass


def _train_run(run: Path, mesh, steps: int = 2, kill_at: int | None = None) -> dict | None:
    """`train()` of TRAIN_TASK on the tiny target (optionally on `mesh`); synthetic data, checkpoint every step."""
    import numpy as np

    import drafters
    from specdec.config import TrainConfig
    from specdec.sharding import shard_target
    from specdec.testing import peaky_target
    from specdec.train.data import DistillData
    from specdec.train.loop import train
    from specdec.train.tasks import make_task

    drafters.available()
    target = peaky_target(0)
    if mesh is not None:
        target = shard_target(target, mesh)
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, 256, int(n)).astype(np.int32) for n in rng.integers(12, 30, 24)]
    data = DistillData([f"ex{i}" for i in range(len(ids))], ids, [(np.arange(len(x)) >= 4).astype(np.int8) for x in ids],
                       [4] * len(ids), [False] * len(ids), {})
    cfg = TrainConfig(steps=steps, batch_size=8, seq_len=32, lr=TRAIN_LR, warmup_frac=0.0, checkpoint_every=1,
                      keep_checkpoints=steps, eval_every=100, log_every=1, eval_examples=0)  # no eval compile

    def hook(step, metrics):
        if step == kill_at:
            raise _Kill

    task = make_task(TRAIN_TASK, target, TRAIN_OPTIONS)
    try:
        return train(task, target, data, cfg, run, progress=False, hook=hook, log=lambda *a, **k: None)
    except _Kill:
        return None


def _restore(run: Path, step: int) -> dict:
    """The checkpointed training state of `run` at `step`, flat: {path: host array}."""
    import jax
    import numpy as np

    from specdec.train.checkpoint import CheckpointStore

    store = CheckpointStore(run / "checkpoints", create=False)
    state = store.restore(step)[0]
    store.close()
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def _same_update(got: dict, want: dict, lr: float, where: str, moment_atol: float = 1e-4) -> None:
    """Equal training states up to float reassociation. Gradients are compared through Adam's moments (mu, nu:
    linear / quadratic in the gradients, so well conditioned) at a tight tolerance; parameters to within 2 lr:
    Adam's first step is about lr * g / (|g| + eps), which turns the reassociation noise of a component whose
    gradient is ~0 into a change of up to lr either way."""
    import numpy as np

    assert got.keys() == want.keys(), where
    moments = [k for k in want if "mu" in k or "nu" in k]
    assert moments, f"no Adam moments in the state: {list(want)}"
    for k in want:
        if k in moments:
            scale = float(np.max(np.abs(want[k]))) or 1.0
            np.testing.assert_allclose(got[k], want[k], rtol=1e-3, atol=moment_atol * scale, err_msg=f"{where} {k}")
        elif "params" in k:
            # each run's step is +-lr on such a component, so the two may differ by 2 lr where the sign flips
            # (seen on one VM: 0.00303 against lr 0.003)
            np.testing.assert_allclose(got[k], want[k], rtol=0, atol=2 * lr, err_msg=f"{where} {k}")
        else:  # step counter, rng key, buffers
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{where} {k}")


def check_train_step(work):
    """Data parallel == one device: the same global batch gives the same loss, gradients and update.
    Run A on one device; run B on a 4x2 mesh (batch over `data`, target tensor-parallel over `model`), killed
    after step 1, then resumed from its 4x2 checkpoint on an 8x1 mesh (pure data parallelism). Step 1 of B
    equals step 1 of A, and B ends (step 2) where A ends."""
    import numpy as np

    a, b = Path(work) / "single", Path(work) / "sharded"
    assert _train_run(a, None)["steps"] == 2
    assert _train_run(b, _mesh(4, 2), kill_at=1) is None
    _same_update(_restore(b, 1), _restore(a, 1), TRAIN_LR, "step 1, 4x2 mesh vs one device")
    losses = {n: [json.loads(l)["loss"] for l in (r / "metrics.jsonl").read_text().splitlines()
                  if json.loads(l)["kind"] == "train"] for n, r in (("single", a), ("sharded", b))}
    np.testing.assert_allclose(losses["sharded"][0], losses["single"][0], rtol=1e-5)

    summary = _train_run(b, _mesh(8, 1))
    assert summary["resumed_from"] == 1 and summary["steps"] == 2
    # step 2's moments to 1e-3 of the largest: a parameter whose step-1 update flipped sign (see _same_update)
    # moves its own gradient slightly (one VM: 3.0e-7 against a largest mu of 2.5e-3); a wrong reduction is off
    # by far more
    _same_update(_restore(b, 2), _restore(a, 2), TRAIN_LR, "step 2 after resuming on 8x1 vs one device",
                 moment_atol=1e-3)


def check_checkpoint(work):
    """A training state saved on a 4x2 mesh (matrices split over `model`) restores on 8x1 and on one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import drafters
    from specdec.models.config import tiny_config
    from specdec.sharding import MODEL, place_drafter_state
    from specdec.target import random_target
    from specdec.train.checkpoint import CheckpointStore
    from specdec.train.loop import Hyper, make_optimizer
    from specdec.train.tasks import make_task

    drafters.available()
    task = make_task(TRAIN_TASK, random_target(tiny_config(), seed=0), TRAIN_OPTIONS)
    params, buffers = task.init(jax.random.PRNGKey(0), np.ones(256, np.int64))
    opt_state = make_optimizer(Hyper(10, 1e-3, 1, 0.0, 1.0)).init(params)
    opt_state = jax.tree.map(lambda x: x + 0.5, opt_state)  # non-zero moments, so the values are checked too
    state = {"params": params, "buffers": buffers, "opt_state": opt_state, "step": jnp.int32(7),
             "key": jax.random.PRNGKey(1)}
    saved = place_drafter_state(state, _mesh(4, 2))
    split = [x for x in jax.tree.leaves(saved) if MODEL in tuple(x.sharding.spec)]
    assert split and split[0].addressable_shards[0].data.shape != split[0].shape, "nothing split on the 4x2 mesh"
    store = CheckpointStore(Path(work) / "ckpt")
    store.save(7, saved, {"step": 7})
    for data, model in ((8, 1), (1, 1)):
        like = place_drafter_state(state, _mesh(data, model)) if data * model > 1 else jax.device_put(state)
        restored, meta = store.restore(7, like=like)
        assert meta == {"step": 7}
        for r, l, s in zip(jax.tree.leaves(restored), jax.tree.leaves(like), jax.tree.leaves(state)):
            assert r.sharding.is_equivalent_to(l.sharding, r.ndim), f"{data}x{model}: {r.sharding} != {l.sharding}"
            np.testing.assert_array_equal(np.asarray(r), np.asarray(s))
    store.close()


def _child_main(work: str) -> None:
    import jax

    assert jax.device_count() == NUM_DEVICES, f"expected {NUM_DEVICES} devices, got {jax.device_count()}"
    import time

    results = {}
    for name in CHECKS:
        t0 = time.perf_counter()
        try:
            globals()[f"check_{name}"](work)
            results[name] = "ok"
        except Exception:  # report every check, not just the first failure
            results[name] = traceback.format_exc()[-3000:]
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    _child_main(sys.argv[1])
