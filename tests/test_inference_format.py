"""The inference format of a trained drafter (`checkpoint.export_inference`, `specdec export --format inference`):
only the tensors decoding reads, weight matrices float16; what ships in git (docs/TRAINING.md).

- parity: a DSpark in the inference format (its Markov W2 cut to the draft vocabulary's columns) drafts, in its
  first round after the target's prefill, the same tokens with the same q and confidences as the full format
  holding the same float16 weights (chain and tree, greedy and sampled), and its greedy output equals AR through
  the engine; W2 cut by a wrong id map (the negative control) drafts differently, so the parity check can fail;
- the file is smaller by exactly the cut columns; W1, read at any previous token, is kept whole;
- `train.init_from` refuses it, naming the tensors it lacks, and so does a snapshot; a missing, reshaped or
  unreadable tensor is a clear error; the vLLM export of it equals the full format's; DFlash (nothing to cut) goes
  through the same path.

The drafter directories are written with the training loop's writers from random weights (every head active)."""

import functools
import json
import shutil

import jax
import numpy as np
import pytest

from drafters import SHIPPED_DRAFTER, create_drafter, dflash, dspark
from experiments import cli
from specdec.engine import speculative_generate
from specdec.export import export_run
from specdec.generate import generate
from specdec.models.config import tiny_config
from specdec.sampling import SamplingParams
from specdec.target import random_target
from specdec.testing import prefill_for_drafter
from specdec.train import checkpoint as ckpt
from specdec.train.loop import initial_weights
from tests.test_eagle3 import context

G = 4  # block size: 4 drafts per block
RANK = 8  # Markov rank
DRAFT_VOCAB = 40  # of the tiny target's 256 ids
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12], [20, 21, 20, 21, 20, 21, 20, 21, 20, 21, 20]]
SAMPLINGS = (SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=50))
TREE = {"tree_top_k": 2, "tree_depth": 3}


@pytest.fixture(scope="module")
def target():
    return random_target(tiny_config(), seed=3, scale=0.35)


def token_counts(target):
    return np.random.default_rng(0).integers(0, 1000, target.cfg.vocab_size)


def trained(target, kind="dspark", seed=0, **options):
    """(task, params, buffers) of a drafter with random weights, every head active (nonzero W2, calibrated-looking
    confidence temperatures)."""
    module = dspark if kind == "dspark" else dflash
    opts = {"num_layers": 1, "block_size": G, "draft_vocab_size": DRAFT_VOCAB,
            **({"markov_rank": RANK} if kind == "dspark" else {}), **options}
    task = module.make_task(target, **opts)
    params, buffers = task.init(jax.random.PRNGKey(seed), token_counts(target))
    rng = np.random.default_rng(seed + 1)
    params = jax.tree.map(lambda w: np.asarray(w) + 0.05 * rng.standard_normal(np.shape(w)).astype(np.float32),
                          params)
    if kind == "dspark":
        params["markov"]["w2"] = rng.standard_normal(params["markov"]["w2"].shape).astype(np.float32)
        buffers = {**buffers, "conf_temperature": np.linspace(0.5, 2.0, task.arch.drafts, dtype=np.float32)}
    return task, params, buffers


def write_full(path, target, task, params, buffers, float16=False):
    """A full-format drafter directory as `specdec train` leaves it (float16: as the shipped one is stored)."""
    ckpt.write_drafter_config(path, task.name, task.config(), ckpt.target_info(target))
    ckpt.export_params(path, ckpt.float16_matrices(params) if float16 else params, buffers, step=7)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, target):
    """{"full32": as trained, "full16": the same with float16 matrices, "inference": exported from full32}."""
    root = tmp_path_factory.mktemp("drafters")
    task, params, buffers = trained(target)
    out = {"full32": write_full(root / "full32", target, task, params, buffers),
           "full16": write_full(root / "full16", target, task, params, buffers, float16=True)}
    out["inference"] = export_run(out["full32"], root / "inference", "inference", None)
    return out


@functools.partial(jax.jit, static_argnums=(0, 4))
def propose(drafter, params, state, ctx, sampling, key):
    return drafter.propose(params, state, ctx, sampling, key)


def first_drafts(target, drafter):
    """The drafter's first round after the target's prefill of PROMPTS, as the engine runs it (block forward,
    heads, sampling with the target's noise): per sampling, every array of the Draft (tokens, parents, q,
    validity, scores) and the drafter's new state (a chain's confidences)."""
    _, _, root, state, _ = prefill_for_drafter(target, drafter, PROMPTS)
    ctx = context([p + [int(r)] for p, r in zip(PROMPTS, root)])
    return [jax.tree.leaves(propose(drafter, drafter.params, state, ctx, s, jax.random.PRNGKey(2)))
            for s in SAMPLINGS]


def assert_same_drafts(want, got):
    for a, b in zip(want, got, strict=True):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            x, y = np.asarray(x), np.asarray(y)
            if np.issubdtype(x.dtype, np.floating):
                np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-7)
            else:
                np.testing.assert_array_equal(y, x)


def test_inference_format_drafts_what_the_full_format_drafts(dirs, target, tmp_path):
    full = create_drafter(None, target, G, path=str(dirs["full16"]))
    mine = create_drafter(None, target, G, path=str(dirs["inference"]))
    assert mine.name == "dspark" and mine.params["params"]["markov"]["w2"].shape == (RANK, DRAFT_VOCAB)
    want = first_drafts(target, full)
    assert_same_drafts(want, first_drafts(target, mine))
    tree = [create_drafter(None, target, 6, path=str(dirs[d]), **TREE) for d in ("full16", "inference")]
    assert_same_drafts(first_drafts(target, tree[0]), first_drafts(target, tree[1]))

    # negative control: W2 cut by a wrong id map (each column one draft id off) loads (same shapes and dtypes)
    # but drafts differently
    wrong = tmp_path / "wrong"
    shutil.copytree(dirs["inference"], wrong)
    with np.load(dirs["full16"] / ckpt.PARAMS_FILE) as z:
        w2, d2t = z["params/markov/w2"], z["buffers/d2t"]
    with np.load(wrong / ckpt.PARAMS_FILE) as z:
        flat = {k: z[k] for k in z.files}
    flat["params/markov/w2"] = w2[:, np.roll(d2t, 1)]
    np.savez(wrong / ckpt.PARAMS_FILE, **flat)
    with pytest.raises(AssertionError):
        assert_same_drafts(want, first_drafts(target, create_drafter(None, target, G, path=str(wrong))))


def test_inference_format_greedy_output_equals_ar(dirs, target):
    ar = generate(target, PROMPTS, 12).tokens
    chain = create_drafter(None, target, G, path=str(dirs["inference"]))
    assert speculative_generate(target, chain, PROMPTS, max_new_tokens=12).tokens == ar
    tree = create_drafter(None, target, 6, path=str(dirs["inference"]), **TREE)
    assert speculative_generate(target, tree, PROMPTS, policy="greedy_tree", max_new_tokens=12).tokens == ar


def test_the_file_is_smaller_by_the_cut_columns(dirs, target):
    vocab = target.cfg.vocab_size
    meta = json.loads((dirs["inference"] / ckpt.DRAFTER_FILE).read_text())
    assert meta["format"] == "inference"
    assert meta["draft_vocab_cut"] == {"markov/w2": {"axis": 1, "full": vocab}}
    listed = meta["tensors"]
    assert listed["params/markov/w2"] == {"shape": [RANK, DRAFT_VOCAB], "dtype": "float16"}
    assert listed["params/markov/w1"] == {"shape": [vocab, RANK], "dtype": "float16"}  # read at any previous id
    assert listed["params/backbone/layers/wq"]["dtype"] == "float16"
    assert listed["params/conf/w"]["dtype"] == "float32"  # vectors and buffers as trained
    size = {name: (d / ckpt.PARAMS_FILE).stat().st_size for name, d in dirs.items()}
    cut = RANK * (vocab - DRAFT_VOCAB) * 2  # W2's float16 columns outside the draft vocabulary
    assert abs(size["full16"] - size["inference"] - cut) <= 64  # .npy headers are padded to 64 bytes
    assert size["inference"] < size["full16"] < size["full32"]


def test_init_from_refuses_the_inference_format_naming_what_it_lacks(dirs, target):
    task, _, _ = trained(target)
    fresh = task.init(jax.random.PRNGKey(1), token_counts(target))
    with pytest.raises(ckpt.CheckpointError, match=r"is an inference-format drafter .* lacks the training tensors "
                       r"params/markov/w2 \(all but the draft vocabulary's 40 of its 256 entries on axis 1\)"):
        initial_weights(str(dirs["inference"]), task, target, *fresh)
    params, _ = initial_weights(str(dirs["full16"]), task, target, *fresh)  # the full format continues
    assert params["markov"]["w2"].shape == (RANK, target.cfg.vocab_size)


def test_snapshot_refuses_the_inference_format(dirs, tmp_path, target):
    """A snapshot of an inference-format directory would write a full-format drafter.json over cut tensors."""
    with pytest.raises(ckpt.CheckpointError, match="is an inference-format drafter .* not a training run"):
        ckpt.snapshot(dirs["inference"], tmp_path / "snap")
    assert not (tmp_path / "snap").exists()
    ckpt.snapshot(dirs["full32"], tmp_path / "full", float16=True)  # the full format is frozen as before
    frozen = ckpt.load_drafter(tmp_path / "full")
    assert frozen["format"] == ckpt.FULL and frozen["params"]["markov"]["w2"].shape == (RANK, target.cfg.vocab_size)


def edited(src, dst, tensors=None, meta=None):
    """A copy of the drafter directory `src` at `dst` with `tensors(params.npz dict)` / `meta(drafter.json dict)`
    applied in place."""
    shutil.copytree(src, dst)
    if tensors is not None:
        with np.load(dst / ckpt.PARAMS_FILE) as z:
            flat = {k: z[k] for k in z.files}
        tensors(flat)
        np.savez(dst / ckpt.PARAMS_FILE, **flat)
    if meta is not None:
        info = json.loads((dst / ckpt.DRAFTER_FILE).read_text())
        meta(info)
        (dst / ckpt.DRAFTER_FILE).write_text(json.dumps(info))
    return dst


def test_a_missing_reshaped_or_unreadable_tensor_is_a_clear_error(dirs, tmp_path, target):
    src = dirs["inference"]
    missing = edited(src, tmp_path / "missing", tensors=lambda f: f.pop("params/markov/w2"))
    with pytest.raises(ckpt.CheckpointError, match="is not the inference-format drafter .* describes: missing "
                       "params/markov/w2"):
        create_drafter(None, target, G, path=str(missing))
    full_width = edited(src, tmp_path / "wide", tensors=lambda f: f.update(
        {"params/markov/w2": np.zeros((RANK, target.cfg.vocab_size), np.float16)}))
    with pytest.raises(ckpt.CheckpointError, match=r"params/markov/w2 is float16 \[8, 256\], drafter.json says "
                       r"float16 \[8, 40\]"):
        ckpt.load_drafter(full_width)
    extra = edited(src, tmp_path / "extra", tensors=lambda f: f.update({"params/markov/w3": np.zeros(2)}))
    with pytest.raises(ckpt.CheckpointError, match="not listed in drafter.json: params/markov/w3"):
        ckpt.load_drafter(extra)
    miscut = edited(src, tmp_path / "miscut", meta=lambda m: m["draft_vocab_cut"].update(
        {"markov/w1": {"axis": 0, "full": 256}}))
    with pytest.raises(ckpt.CheckpointError, match=r"params/markov/w1 \[256, 8\] is listed as cut to the draft "
                       r"vocabulary on axis 0, which does not match buffers/d2t \[40\]"):
        ckpt.load_drafter(miscut)
    unlisted = edited(src, tmp_path / "unlisted", meta=lambda m: m.pop("tensors"))
    with pytest.raises(ckpt.CheckpointError, match="drafter.json is corrupt: an inference-format drafter lists"):
        ckpt.load_drafter(unlisted)
    unknown = edited(src, tmp_path / "unknown", meta=lambda m: m.update(format="compact"))
    with pytest.raises(ckpt.CheckpointError, match="has format 'compact'; known: full, inference"):
        ckpt.load_drafter(unknown)
    truncated = edited(src, tmp_path / "truncated")
    data = (truncated / ckpt.PARAMS_FILE).read_bytes()
    (truncated / ckpt.PARAMS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(ckpt.CheckpointError, match="params.npz cannot be read"):
        ckpt.load_drafter(truncated)
    gone = edited(src, tmp_path / "gone")
    (gone / ckpt.PARAMS_FILE).unlink()
    with pytest.raises(ckpt.CheckpointError, match="is an inference-format drafter without its params.npz"):
        ckpt.load_drafter(gone)


def test_export_command_writes_the_inference_format(dirs, tmp_path, capsys):
    out = tmp_path / "shipped"
    assert cli.main(["export", str(dirs["full32"]), "--format", "inference", str(out)]) == 0
    assert "params.npz" in capsys.readouterr().out
    want = ckpt.flatten(ckpt.load_drafter(dirs["inference"])["params"])
    for again in (out, ckpt.export_inference(dirs["inference"], tmp_path / "again")):  # from either format
        info = ckpt.load_drafter(again)
        assert info["format"] == "inference" and info["draft_vocab_cut"] == {"markov/w2": {"axis": 1, "full": 256}}
        got = ckpt.flatten(info["params"])
        assert sorted(got) == sorted(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        cli.main(["export", str(dirs["full32"]), "--format", "inference", str(out)])
    (out / "README.md").write_text("the card of the drafter this export replaces")
    assert cli.main(["export", str(dirs["full32"]), "--format", "inference", str(out), "--overwrite"]) == 0
    assert not (out / "README.md").exists()  # the source has no card: none describes the new weights
    medusa = tmp_path / "medusa"  # a kind that declares no inference format
    ckpt.write_drafter_config(medusa, "medusa", {}, {})
    ckpt.export_params(medusa, {"w": np.zeros((2, 2))}, {}, 1)
    assert cli.main(["export", str(medusa), "--format", "inference", str(tmp_path / "m")]) == 2
    assert "no inference format for 'medusa' drafters" in capsys.readouterr().err
    # the shipped drafter is a full-format directory (its drafter.json names no format) and loads as one
    shipped = ckpt.load_drafter(SHIPPED_DRAFTER)
    assert shipped["format"] == ckpt.FULL and shipped["draft_vocab_cut"] == {}
    assert shipped["params"]["markov"]["w2"].shape == (64, shipped["target"]["vocab_size"])


def test_vllm_export_of_the_inference_format_equals_the_full_formats(tmp_path):
    from safetensors.numpy import load_file

    target = random_target(tiny_config(num_layers=4), seed=3, scale=0.35)
    task, params, buffers = trained(target, taps=[3, 1], block_size=5, block_layout="peer", qk_norm=True)
    full = write_full(tmp_path / "full16", target, task, params, buffers, float16=True)
    small = export_run(full, tmp_path / "inference", "inference", None)
    a, b = (load_file(str(export_run(d, tmp_path / f"vllm_{d.name}", "vllm", target) / "model.safetensors"))
            for d in (full, small))
    assert sorted(a) == sorted(b) and "markov_head.markov_w2.weight" in a
    for name in a:
        np.testing.assert_array_equal(b[name], a[name])


def test_dflash_has_nothing_to_cut_and_drafts_the_same(tmp_path, target):
    task, params, buffers = trained(target, kind="dflash")
    full = write_full(tmp_path / "full16", target, task, params, buffers, float16=True)
    small = export_run(write_full(tmp_path / "full32", target, task, params, buffers), tmp_path / "inference",
                       "inference", None)
    info = ckpt.load_drafter(small)
    assert info["format"] == "inference" and info["draft_vocab_cut"] == {}
    assert_same_drafts(first_drafts(target, create_drafter(None, target, G, path=str(full))),
                       first_drafts(target, create_drafter(None, target, G, path=str(small))))
    fresh = task.init(jax.random.PRNGKey(1), token_counts(target))
    initial_weights(str(small), task, target, *fresh)  # nothing was cut: training may continue from it
