"""Export of trained EAGLE-3 drafters to vLLM (speculators) and SGLang layouts (specdec/export, docs/EXPORT.md).

- parity: an independent PyTorch drafter written from the engines' code (tests/peer_eagle3.py) loads each export
  and drafts the same tokens with the same logits as specdec's JAX drafter on the same target hidden states
  (the aux-layer numbering, fc's tap order, the d2t offsets and the position shift all enter);
- round trip: export, load the export back as a specdec drafter, identical draft logits and greedy output;
- what the peer format cannot express is refused with the reason, as are bad imports;
- the vLLM config validates against the speculators package's schema when that package is importable.

The run directories are written with the training loop's own writers (drafter.json + params.npz) from random
weights on a 4-layer tiny target: a target needs >= 4 layers to have three capturable taps (1..L-1)."""

import json

import jax
import numpy as np
import pytest
import torch

from drafters import create_drafter, eagle3
from experiments import cli
from experiments.build import build_drafter, build_target
from specdec.config import load_config
from specdec.engine import speculative_generate
from specdec.export import NotRepresentable, export_run, load_export
from specdec.export import eagle3 as E
from specdec.generate import generate
from specdec.models.config import tiny_config
from specdec.target import random_target
from specdec.testing import edited_export, peaky_target, prefill_for_drafter
from specdec.train import checkpoint as ckpt
from tests.peer_eagle3 import PeerEagle3
from tests.test_eagle3 import context, engine_round, noisy

LAYERS = 4
TAPS = [3, 1, 2]  # out of order on purpose: fc's input blocks must be reordered to the engines' layer order
DRAFT_VOCAB = 64
K = 4
PROMPTS = [[5, 9, 14, 3, 77, 31, 8, 60], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def target():
    return peaky_target(3, num_layers=LAYERS)


def write_run(path, target, taps=TAPS, draft_vocab=DRAFT_VOCAB, seed=1):
    """A run directory as `specdec train` leaves it (drafter.json + params.npz), with random weights."""
    task = eagle3.make_task(target, taps=taps, draft_vocab_size=draft_vocab, ttt_steps=2)
    counts = np.bincount(np.arange(target.cfg.vocab_size) * 7 % 101, minlength=target.cfg.vocab_size)
    params, buffers = task.init(jax.random.PRNGKey(0), counts)
    params = noisy(params, seed, scale=0.1)
    ckpt.write_drafter_config(path, task.name, task.config(), ckpt.target_info(target))
    ckpt.export_params(path, params, buffers, step=7)
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, target):
    return write_run(tmp_path_factory.mktemp("run") / "eagle3", target)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, run_dir, target):
    root = tmp_path_factory.mktemp("export")
    return {fmt: export_run(run_dir, root / fmt, fmt, target) for fmt in E.FORMATS}


def first_round(target, drafter, rows=PROMPTS):
    """specdec's drafting after the target's prefill: logits [B, K, Vd], drafted target ids [B, K], the root
    tokens, and the target's hidden states of every layer [L+1, B, T, H]."""
    _, _, root, state, taps = prefill_for_drafter(target, drafter, rows)
    ctx = context([p + [int(r)] for p, r in zip(rows, root)])
    lg, drafted, _, _ = engine_round(drafter, drafter.params, state, ctx)
    return np.asarray(lg), np.asarray(drafted), root, np.array(taps)  # a writable copy: torch.from_numpy wants one


@pytest.mark.parametrize("fmt", E.FORMATS)
def test_peer_reimplementation_drafts_what_specdec_drafts(exports, run_dir, target, fmt):
    drafter = create_drafter(None, target, K, path=str(run_dir))  # the kind comes from drafter.json
    lg, drafted, root, hs = first_round(target, drafter)
    d2t = np.asarray(drafter.params["d2t"])
    peer = PeerEagle3(exports[fmt], torch.from_numpy(np.array(target.params["embed"])))
    assert peer.capture == sorted(TAPS)  # the engine's ids land on specdec's taps
    for b, prompt in enumerate(PROMPTS):
        n = len(prompt)
        states = [torch.from_numpy(hs[layer, b, :n]) for layer in range(LAYERS + 1)]
        tokens, full = peer.propose(prompt, int(root[b]), states, K)
        assert tokens == drafted[b].tolist(), f"row {b}: peer drafted {tokens}, specdec {drafted[b].tolist()}"
        # specdec's draft id i is target id d2t[i]; the peer scattered its logits to targets via d2t offsets
        theirs = full.numpy()[:, d2t]
        assert np.isinf(np.delete(full.numpy(), d2t, axis=1)).all()  # nothing outside the draft vocabulary
        rel = np.linalg.norm(theirs - lg[b]) / np.linalg.norm(lg[b])
        assert rel < 1e-4, f"row {b}: relative L2 {rel:.2e}"


def test_full_vocabulary_export(tmp_path, target):
    """No reduced vocabulary: identity d2t / t2d (what older SGLang needs), same drafts, same logits back."""
    run = write_run(tmp_path / "run", target, draft_vocab=0, seed=2)
    out = export_run(run, tmp_path / "sglang", "sglang", target)
    from safetensors.numpy import load_file

    w = load_file(str(out / "model.safetensors"))
    assert not w["d2t"].any() and w["t2d"].all() and w["lm_head.weight"].shape == (256, 64)
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 256
    original = create_drafter(None, target, K, path=str(run))
    lg, drafted, root, hs = first_round(target, original)
    peer = PeerEagle3(out, torch.from_numpy(np.array(target.params["embed"])))
    n = len(PROMPTS[0])
    states = [torch.from_numpy(hs[i, 0, :n]) for i in range(LAYERS + 1)]
    tokens, full = peer.propose(PROMPTS[0], int(root[0]), states, K)
    assert tokens == drafted[0].tolist()
    assert np.linalg.norm(full.numpy() - lg[0]) / np.linalg.norm(lg[0]) < 1e-4
    imported = create_drafter(None, target, K, path=str(out))
    assert "d2t" not in imported.params  # the identity map is no map
    np.testing.assert_allclose(first_round(target, imported)[0], lg, rtol=1e-5, atol=1e-5)


def test_config_fields(exports, target):
    v = json.loads((exports["vllm"] / "config.json").read_text())
    assert v["speculators_model_type"] == "eagle3" and v["norm_before_residual"] is False
    assert v["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM numbering = specdec taps
    assert v["draft_vocab_size"] == DRAFT_VOCAB and v["target_hidden_size"] == 64
    layer = v["transformer_layer_config"]
    assert layer["vocab_size"] == 256 and layer["num_hidden_layers"] == 1 and layer["tie_word_embeddings"] is False
    s = json.loads((exports["sglang"] / "config.json").read_text())
    assert s["architectures"] == ["LlamaForCausalLMEagle3"] and s["num_hidden_layers"] == 1
    assert s["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang: output of layer id
    assert s["tie_word_embeddings"] is False  # the tiny target ties its embeddings; the draft head must not
    from safetensors.numpy import load_file

    w = load_file(str(exports["vllm"] / "model.safetensors"))
    assert w["d2t"].dtype == np.int64 and w["t2d"].dtype == bool and int(w["t2d"].sum()) == DRAFT_VOCAB
    assert w["lm_head.weight"].shape == (DRAFT_VOCAB, 64) and w["fc.weight"].shape == (64, 192)
    assert "embed_tokens.weight" not in w  # the engines share the target's embedding
    assert "layers.0.self_attn.q_proj.weight" in w  # speculators' names for vLLM, SGLang's below
    assert "midlayer.self_attn.q_proj.weight" in load_file(str(exports["sglang"] / "model.safetensors"))
    card = (exports["vllm"] / "README.md").read_text()
    assert "steps | 7" in card and "[1, 2, 3]" in card


def test_d2t_is_written_as_offsets():
    ids = np.array([3, 7, 9, 250])
    arch = eagle3.Eagle3Arch.build(tiny_config(num_layers=4), [1, 2, 3], 4)
    c = arch.cfg
    params = {k: {"kernel": np.zeros(s, np.float32)} for k, s in
              {"wq": (128, 64), "wk": (128, 32), "wv": (128, 32), "wo": (64, 64), "w_gate": (64, 128),
               "w_up": (64, 128), "w_down": (128, 64), "fc": (192, 64), "lm_head": (64, 4)}.items()}
    params.update({k: {"scale": np.ones(c.hidden_size, np.float32)} for k in E.NORMS})
    _, t = E.to_peer(arch, params, {"d2t": ids}, tiny_config(num_layers=4), "vllm")
    np.testing.assert_array_equal(t["d2t"], [3, 6, 7, 247])  # target = draft + d2t[draft]
    np.testing.assert_array_equal(np.flatnonzero(t["t2d"]), ids)


@pytest.mark.parametrize("fmt", E.FORMATS)
def test_round_trip_same_logits_and_greedy_output(exports, run_dir, target, fmt):
    original = create_drafter("eagle3", target, K, path=str(run_dir))
    imported = create_drafter(None, target, K, path=str(exports[fmt]))  # the kind comes from config.json
    assert imported.taps == tuple(sorted(TAPS))
    lg0, tok0, _, _ = first_round(target, original)
    lg1, tok1, _, _ = first_round(target, imported)
    np.testing.assert_array_equal(tok1, tok0)
    np.testing.assert_allclose(lg1, lg0, rtol=1e-5, atol=1e-5)  # fc's columns were reordered, so not bitwise
    # greedy output: the original's equals AR (tests/test_train.py), and so must the imported drafter's in the
    # engine's compiled loop; the logits above are what shows it is the same drafter
    prompts = [p[:6] for p in PROMPTS]
    out = speculative_generate(target, imported, prompts, policy="greedy_chain", max_new_tokens=12)
    assert out.tokens == generate(target, prompts, max_new_tokens=12).tokens


def test_drafter_name_auto_reads_the_kind_from_the_path(exports, run_dir, target):
    for path in (run_dir, exports["sglang"]):
        cfg = load_config({"drafter": {"name": "auto", "path": str(path), "num_draft_tokens": K}})
        drafter, _ = build_drafter(cfg, target)
        assert drafter.name == "eagle3" and drafter.num_draft_tokens == K
    with pytest.raises(ValueError, match="'auto' reads the drafter kind from drafter.path"):
        build_drafter(load_config({"drafter": {"name": "auto"}}), target)
    with pytest.raises(ValueError, match="needs a drafter name, or path="):
        create_drafter(None, target, K)


@pytest.mark.parametrize("taps, why", [
    ([0, 1, 2], "tap 0 is the embedding output"), ([1, 2, 4], "never capture"),
    ([1, 2], "exactly 3 target layers"), ([1, 2, 2], "repeat a layer")])
def test_unrepresentable_taps_are_refused_with_the_reason(tmp_path, target, taps, why):
    run = write_run(tmp_path / "run", target, taps=taps)
    with pytest.raises(NotRepresentable, match=why):
        export_run(run, tmp_path / "out", "vllm", target)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_bad_export_requests_are_clear_errors(tmp_path, run_dir, target, exports):
    with pytest.raises(ValueError, match="unknown export format 'onnx'"):
        export_run(run_dir, tmp_path / "x", "onnx", target)
    with pytest.raises(FileExistsError, match="not empty"):
        export_run(run_dir, exports["vllm"], "vllm", target)
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="is a file"):
        export_run(run_dir, tmp_path / "file", "vllm", target)
    other = random_target(tiny_config(num_layers=3), seed=0)
    with pytest.raises(ckpt.CheckpointError, match="num_layers=4"):
        export_run(run_dir, tmp_path / "y", "vllm", other)
    medusa = tmp_path / "medusa"
    ckpt.write_drafter_config(medusa, "medusa", {"num_heads": 2}, ckpt.target_info(target))
    ckpt.export_params(medusa, {"w": np.zeros(2)}, {}, 1)
    with pytest.raises(NotRepresentable, match="'medusa' drafter; export supports eagle3"):
        export_run(medusa, tmp_path / "z", "vllm", target)


def test_export_command(tmp_path, run_dir, target, monkeypatch, capsys):
    # the tiny 2-layer model of configs/train/tiny.yaml: its default taps (2, 1, 0) have no engine equivalent
    tiny = build_target(load_config({"model": {"name": "tiny"}}).model)
    two_layer_run = write_run(tmp_path / "tiny_run", tiny, taps=None, draft_vocab=0)
    assert cli.main(["export", str(two_layer_run), "--format", "sglang", str(tmp_path / "a"), "--model", "tiny"]) == 2
    assert "taps [0, 2] cannot be captured by the engines" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "missing"), "--format", "vllm", str(tmp_path / "b")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert cli.main(["export", str(run_dir), "--format", "vllm", str(tmp_path / "c")]) == 2
    assert "has no config.yaml naming its target; pass --model" in capsys.readouterr().err
    monkeypatch.setattr("experiments.build.build_target", lambda model, mesh=None: target)
    out = tmp_path / "d"
    assert cli.main(["export", str(run_dir), "--format", "vllm", str(out), "--model", "tiny4", "-k", "5"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert "model.safetensors" in capsys.readouterr().out


def test_generate_command_takes_a_drafter_directory(exports, target, monkeypatch, capsys):
    """`specdec generate --drafter <export dir>` builds the drafter the directory holds (the decode itself is
    stubbed: the engine is tested above)."""
    import dataclasses
    import types

    from specdec.models.tokenizer import ByteCodec

    seen = {}

    def fake_generate(target_, drafter, prompts, **kwargs):
        seen["drafter"] = drafter
        metrics = types.SimpleNamespace(summary=lambda: {"tau": 1.0})
        return types.SimpleNamespace(tokens=[[72, 105]] * len(prompts), metrics=metrics)

    with_codec = dataclasses.replace(target, tokenizer=ByteCodec())  # text <-> ids for the tokenizer-less model
    monkeypatch.setattr("specdec.target.load_target", lambda *a, **k: with_codec)
    monkeypatch.setattr("specdec.engine.speculative_generate", fake_generate)
    assert cli.main(["generate", "Hi", "--drafter", str(exports["sglang"]), "-k", "3", "--raw"]) == 0
    assert seen["drafter"].name == "eagle3" and seen["drafter"].taps == (1, 2, 3)
    assert seen["drafter"].num_draft_tokens == 3 and "Hi" in capsys.readouterr().out


# Exports specdec must refuse to import: (case, edit of config.json, edit of the tensors, error, message).
IMPORT_REFUSALS = [
    ("norm_before_residual", lambda c: c.pop("norm_before_residual"), None,  # vLLM's default is True
     NotRepresentable, "norm_before_residual"),
    ("qwen3_layer", lambda c: c["transformer_layer_config"].update(model_type="qwen3"), None,
     NotRepresentable, "model_type 'qwen3'"),
    ("d2t_out_of_range", None, lambda t: t.update(d2t=t["d2t"] + 300), ValueError, "d2t offsets map to ids outside"),
    ("own_embed_tokens", None, lambda t: t.update({"embed_tokens.weight": np.ones((256, 64), np.float32)}),
     ckpt.CheckpointError, "own embed_tokens, which differ"),
]


@pytest.mark.parametrize("case,edit_config,edit_tensors,error,message", IMPORT_REFUSALS,
                         ids=[c[0] for c in IMPORT_REFUSALS])
def test_imports_refuse_what_specdec_cannot_run(tmp_path, exports, target, case, edit_config, edit_tensors, error,
                                                message):
    edited = edited_export(exports["vllm"], tmp_path / case, edit_config, edit_tensors)
    with pytest.raises(error, match=message):
        create_drafter(None, target, K, path=str(edited))


def test_imports_refuse_another_target_or_no_export(tmp_path, exports, target):
    wide = random_target(tiny_config(num_layers=LAYERS, num_heads=8, num_kv_heads=2, head_dim=8), seed=0)
    with pytest.raises(ckpt.CheckpointError, match="num_heads=4"):
        create_drafter(None, wide, K, path=str(exports["vllm"]))
    (tmp_path / "none").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="no drafter.json and no EAGLE-3 / DFlash / DSpark config.json"):
        create_drafter(None, target, K, path=str(tmp_path / "none"))


def test_sharded_checkpoints_load_through_the_index(tmp_path, exports, target):
    from safetensors.numpy import load_file, save_file

    src, dst = exports["sglang"], tmp_path / "sharded"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(dst / shard))
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: s for s, keys in shards.items() for k in keys}}))
    a, b = load_export(src), load_export(dst)
    for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(b["params"])):
        np.testing.assert_array_equal(x, y)
    (dst / "b.safetensors").unlink()
    with pytest.raises(ckpt.CheckpointError, match="b.safetensors is missing"):
        load_export(dst)


def test_vllm_config_validates_against_the_speculators_schema(exports):
    speculators = pytest.importorskip("speculators.models.eagle3", reason="the speculators package is not installed")
    config = json.loads((exports["vllm"] / "config.json").read_text())
    parsed = speculators.Eagle3SpeculatorConfig.model_validate(config)
    assert parsed.draft_vocab_size == DRAFT_VOCAB and parsed.norm_before_residual is False
    assert parsed.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    assert parsed.transformer_layer_config.vocab_size == 256
    assert parsed.speculators_config.verifier.name_or_path == "tiny"
    # and the weights fit speculators' own EAGLE-3 module, name for name and shape for shape
    from safetensors.torch import load_file

    from speculators.models.eagle3.core import Eagle3DraftModel

    model = Eagle3DraftModel(parsed)
    result = model.load_state_dict(load_file(str(exports["vllm"] / "model.safetensors")), strict=False)
    assert result.unexpected_keys == []
    assert set(result.missing_keys) <= {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
