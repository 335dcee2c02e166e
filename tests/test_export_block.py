"""Export of DFlash / DSpark drafters to vLLM (speculators) and SGLang (z-lab DFlash) layouts (specdec/export/block.py,
docs/EXPORT.md).

- parity: an independent PyTorch drafter written from the peers' code (tests/peer_block.py) loads each export and,
  on the same target hidden states, drafts the same tokens with the same logits (relative L2 < 1e-4) and, for
  DSpark, the same confidences as specdec's JAX drafter (the layer numbering, fc's tap order, the block layout,
  q/k norms, the Markov head and the d2t offsets all enter);
- round trip: export, load back as a specdec drafter: the same draft logits, greedy output equal to AR;
- what the peers cannot run is refused with the option to train with; what they drop is in the model card.

The run directories are written with the training loop's writers from random weights on a 4-layer tiny target
(Llama-style: the drafter's q/k norms come from its `qk_norm: true` option, as on SmolLM2)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from drafters import create_drafter, dflash, dspark
from experiments import cli
from specdec.engine import speculative_generate
from specdec.export import NotRepresentable, export_run
from specdec.generate import generate
from specdec.models.config import tiny_config
from specdec.sampling import SamplingParams
from specdec.target import random_target
from specdec.testing import edited_export, prefill_for_drafter
from specdec.train import checkpoint as ckpt
from tests.peer_block import PeerBlockDrafter
from tests.test_eagle3 import context

LAYERS = 4
TAPS = [3, 1]  # out of order on purpose: fc's input blocks must be written in the engines' layer order
G = 5  # block size: G - 1 = 4 drafts in the peer layout
DRAFT_VOCAB = 64
PROMPTS = [[5, 9, 14, 3, 77, 31, 8, 60], [40, 41, 42, 43, 44]]
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def target():
    return random_target(tiny_config(num_layers=LAYERS), seed=3, scale=0.35)


def noisy(params, seed, scale=0.1):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x + jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype), params)


def write_run(path, target, kind, draft_vocab=DRAFT_VOCAB, seed=1, **options):
    """A run directory as `specdec train` leaves it (drafter.json + params.npz), with random weights."""
    module = dflash if kind == "dflash" else dspark
    opts = {"num_layers": 2, "taps": TAPS, "block_size": G, "draft_vocab_size": draft_vocab, "block_layout": "peer",
            "qk_norm": True, **({"markov_rank": 8} if kind == "dspark" else {}), **options}
    task = module.make_task(target, **opts)
    counts = np.bincount(np.arange(target.cfg.vocab_size) * 7 % 101, minlength=target.cfg.vocab_size)
    params, buffers = task.init(jax.random.PRNGKey(0), counts)
    params = noisy(params, seed)
    if kind == "dspark":  # a calibrated run: the temperatures the peer format has no field for
        buffers = {**buffers, "conf_temperature": jnp.linspace(0.5, 2.0, task.arch.drafts)}
    ckpt.write_drafter_config(path, task.name, task.config(), ckpt.target_info(target))
    ckpt.export_params(path, params, buffers, step=7)
    return path


# (kind, format, draft vocabulary): SGLang's block drafters have no d2t, so a reduced vocabulary goes to vLLM only
CASES = [("dflash", "vllm", DRAFT_VOCAB), ("dflash", "sglang", 0), ("dspark", "vllm", DRAFT_VOCAB),
         ("dspark", "sglang", 0)]


@pytest.fixture(scope="module")
def exports(tmp_path_factory, target):
    out = {}
    for kind, fmt, vocab in CASES:
        root = tmp_path_factory.mktemp(f"{kind}-{fmt}")
        run = write_run(root / "run", target, kind, draft_vocab=vocab)
        out[kind, fmt] = (run, export_run(run, root / "export", fmt, target))
    return out


def first_round(target, drafter, rows=PROMPTS):
    """specdec's greedy drafting after the target's prefill (`block_round`), the roots, and the target's hidden
    states of every layer [L+1, B, T, H]."""
    _, _, root, state, taps = prefill_for_drafter(target, drafter, rows)
    lg, drafted, conf = block_round(drafter, state, [p + [int(r)] for p, r in zip(rows, root)])
    return lg, drafted, conf, root, np.array(taps)


def block_round(drafter, state, rows, cap=64):
    """specdec's greedy drafting from `state` (the drafter's after the prefill) at the end of each row (prompt +
    root): draft logits [B, k, Vd] (DSpark: Markov head included, previous token = the drafted one), drafted
    target ids [B, k], prefix confidences [B, k]."""
    params = drafter.params
    hidden, r = drafter.block(params, state, context(rows, cap))
    drafted, _, conf = drafter.draw(params, hidden, r, GREEDY, jax.random.PRNGKey(0))
    lg = drafter.head_logits(params, hidden)[:, :drafter.num_draft_tokens]
    if drafter.name == "dspark":
        prev = jnp.concatenate([r[:, None], drafted[:, :-1]], axis=1)
        lg = lg + dspark.markov_bias(params["params"], prev)[0]  # W2 already cut to the draft vocabulary
    return np.asarray(lg), np.asarray(drafted), np.asarray(conf)


@pytest.mark.parametrize("kind, fmt, vocab", CASES)
def test_peer_reimplementation_drafts_what_specdec_drafts(exports, target, kind, fmt, vocab):
    run, out = exports[kind, fmt]
    drafter = create_drafter(None, target, G - 1, path=str(run))  # the kind comes from drafter.json
    lg, drafted, conf, root, hs = first_round(target, drafter)
    head = target.params["embed"] if target.cfg.tie_word_embeddings else jnp.asarray(target.params["lm_head"]).T
    peer = PeerBlockDrafter(out, torch.from_numpy(np.array(target.params["embed"])), torch.from_numpy(np.array(head)))
    assert peer.capture == sorted(TAPS)  # the engine's ids land on specdec's taps
    d2t = np.asarray(drafter.params["d2t"]) if vocab else np.arange(target.cfg.vocab_size)
    for b, prompt in enumerate(PROMPTS):
        n = len(prompt)
        states = [torch.from_numpy(hs[layer, b, :n]) for layer in range(LAYERS + 1)]
        tokens, full, peer_conf = peer.propose(int(root[b]), states, G - 1)
        assert tokens == drafted[b].tolist(), f"row {b}: peer drafted {tokens}, specdec {drafted[b].tolist()}"
        assert set(tokens) <= set(d2t.tolist())
        theirs = full.numpy()[:, d2t]  # specdec's draft id i is target id d2t[i]; the peer mapped via offsets
        assert np.isinf(np.delete(full.numpy(), d2t, axis=1)).all()
        rel = np.linalg.norm(theirs - lg[b]) / np.linalg.norm(lg[b])
        assert rel < 1e-4, f"row {b}: relative L2 {rel:.2e}"
        assert (theirs.argmax(-1) == lg[b].argmax(-1)).all()
        if kind == "dspark":  # the engines' confidence is uncalibrated (temperature 1): compare with that
            raw = create_drafter(None, target, G - 1, path=str(out))  # the import carries the temperatures back
            assert raw.params["conf_temperature"].shape == (G - 1,)
            plain = dspark.DSparkDrafter(raw.arch, {k: v for k, v in raw.params.items()
                                                    if not k.startswith("conf_temperature")}, G - 1)
            np.testing.assert_allclose(np.cumprod(peer_conf.numpy()), first_round(target, plain)[2][b],
                                       rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind, fmt, vocab", CASES)
def test_round_trip_same_logits(exports, target, kind, fmt, vocab):
    run, out = exports[kind, fmt]
    original = create_drafter(kind, target, G - 1, path=str(run))
    imported = create_drafter(None, target, G - 1, path=str(out))  # the kind comes from config.json
    assert imported.name == kind and imported.taps == tuple(sorted(TAPS)) and imported.arch.layout == "peer"
    lg0, tok0, conf0, _, _ = first_round(target, original)
    lg1, tok1, conf1, _, _ = first_round(target, imported)
    np.testing.assert_array_equal(tok1, tok0)
    np.testing.assert_allclose(lg1, lg0, rtol=1e-5, atol=1e-5)  # fc's columns were reordered: not bitwise
    np.testing.assert_allclose(conf1, conf0, rtol=1e-5, atol=1e-6)  # temperatures back from specdec_export.json


def test_round_trip_greedy_output_equals_ar(exports, target):
    imported = create_drafter(None, target, G - 1, path=str(exports["dspark", "vllm"][1]))
    prompts = [p[:6] for p in PROMPTS]
    out = speculative_generate(target, imported, prompts, policy="greedy_chain", max_new_tokens=12)
    assert out.tokens == generate(target, prompts, max_new_tokens=12).tokens


def test_config_fields_and_model_card(exports):
    from safetensors.numpy import load_file

    v = json.loads((exports["dspark", "vllm"][1] / "config.json").read_text())
    assert v["speculators_model_type"] == "dspark" and v["sample_from_anchor"] is False
    assert v["aux_hidden_state_layer_ids"] == [1, 3]  # vLLM numbering = specdec taps
    assert v["block_size"] == G and v["mask_token_id"] == 255 and v["draft_vocab_size"] == DRAFT_VOCAB
    assert v["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == G - 1
    assert v["transformer_layer_config"]["model_type"] == "qwen3"
    assert v["markov_rank"] == 8 and v["enable_confidence_head"] and v["confidence_head_with_markov"]
    w = load_file(str(exports["dspark", "vllm"][1] / "model.safetensors"))
    assert w["markov_head.markov_w1.weight"].shape == (256, 8)  # [V, r]: the previous token is a target id
    assert w["markov_head.markov_w2.weight"].shape == (DRAFT_VOCAB, 8)  # [Vd, r]
    assert w["confidence_head.proj.weight"].shape == (1, 64 + 8) and w["confidence_head.proj.bias"].shape == (1,)
    assert w["d2t"].dtype == np.int64 and w["t2d"].dtype == bool and int(w["t2d"].sum()) == DRAFT_VOCAB
    assert w["lm_head.weight"].shape == (DRAFT_VOCAB, 64) and w["fc.weight"].shape == (64, 128)
    assert w["layers.1.self_attn.k_norm.weight"].shape == (16,) and "embed_tokens.weight" not in w
    s = json.loads((exports["dflash", "sglang"][1] / "config.json").read_text())
    assert s["architectures"] == ["DFlashDraftModel"] and s["num_hidden_layers"] == 2
    assert s["dflash_config"] == {"mask_token_id": 255, "target_layer_ids": [0, 2]}  # SGLang: output of layer id
    assert s["block_size"] == G and s["tie_word_embeddings"] is False
    ws = load_file(str(exports["dflash", "sglang"][1] / "model.safetensors"))
    assert not any(k.startswith(("lm_head", "d2t", "markov")) for k in ws)  # the target's head, full vocabulary
    card = (exports["dspark", "vllm"][1] / "README.md").read_text()
    assert "DSpark drafter" in card and "conf_temperature" in card and "steps | 7" in card
    assert "[anchor, mask x 4]" in card and '"method": "dspark"' in card


def test_what_the_peers_cannot_run_is_refused_with_the_option_to_train(tmp_path, target):
    specdec_layout = write_run(tmp_path / "a", target, "dspark", block_layout="specdec")
    with pytest.raises(NotRepresentable, match="Train with the drafter option `block_layout: peer`"):
        export_run(specdec_layout, tmp_path / "out", "vllm", target)
    assert not (tmp_path / "out").exists()  # nothing half-written
    no_qk = write_run(tmp_path / "b", target, "dflash", qk_norm=None)  # the Llama-style target has none
    with pytest.raises(NotRepresentable, match="`qk_norm: true`"):
        export_run(no_qk, tmp_path / "out", "sglang", target)
    reduced = write_run(tmp_path / "c", target, "dflash")
    with pytest.raises(NotRepresentable, match="SGLang's DFlash / DSpark draft models have no d2t"):
        export_run(reduced, tmp_path / "out", "sglang", target)
    last = write_run(tmp_path / "d", target, "dflash", taps=[1, LAYERS])
    with pytest.raises(NotRepresentable, match="never capture"):
        export_run(last, tmp_path / "out", "vllm", target)
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in \[1, 4\]"):
        export_run(reduced, tmp_path / "out", "vllm", target, num_draft_tokens=G)


# DFlash exports specdec must refuse: (case, edit of config.json, edit of the tensors, drafter name, error, message).
IMPORT_REFUSALS = [
    ("sample_from_anchor", lambda c: c.update(sample_from_anchor=True), None, None,
     NotRepresentable, "sample_from_anchor is true"),
    ("sliding_window", lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention"] * 2), None,
     None, NotRepresentable, "causal or sliding-window"),
    ("missing_tensor", None, lambda t: t.pop("layers.0.self_attn.q_norm.weight"), None, ValueError, "lacks tensors"),
    ("own_lm_head", None, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1.0}), None,
     ckpt.CheckpointError, "own lm_head, which differs from the target's"),
    ("other_kind", None, None, "dspark", ckpt.CheckpointError, "holds a 'dflash' drafter, not 'dspark'"),
]


@pytest.mark.parametrize("case,edit_config,edit_tensors,name,error,message", IMPORT_REFUSALS,
                         ids=[c[0] for c in IMPORT_REFUSALS])
def test_imports_refuse_what_specdec_cannot_run(tmp_path, exports, target, case, edit_config, edit_tensors, name,
                                                error, message):
    edited = edited_export(exports["dflash", "vllm"][1], tmp_path / case, edit_config, edit_tensors)
    with pytest.raises(error, match=message):
        create_drafter(name, target, G - 1, path=str(edited))


def test_export_command_warns_what_the_format_drops(tmp_path, exports, target, monkeypatch, capsys):
    monkeypatch.setattr("experiments.build.build_target", lambda model, mesh=None: target)
    run = exports["dspark", "sglang"][0]
    out = tmp_path / "cli"
    assert cli.main(["export", str(run), "--format", "sglang", str(out), "--model", "tiny4"]) == 0
    err = capsys.readouterr().err
    assert "warning: not carried by the sglang format: `conf_temperature`" in err
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["markov_rank"] == 8
    assert "`embed_tokens` / `lm_head`: the target's, written out" in (out / "README.md").read_text()


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_vllm_config_validates_against_the_speculators_schema(exports, kind):
    """Where `speculators` is importable (docs/EXPORT.md: installed beside the project without its pins): the
    config parses as speculators' own DFlash / DSpark config, and the tensors load into its draft model with no
    unexpected key."""
    models = pytest.importorskip(f"speculators.models.{kind}", reason="the speculators package is not installed")
    from safetensors.torch import load_file

    out = exports[kind, "vllm"][1]
    config = json.loads((out / "config.json").read_text())
    parsed = getattr(models, f"{'DFlash' if kind == 'dflash' else 'DSpark'}SpeculatorConfig").model_validate(config)
    assert parsed.block_size == G and parsed.mask_token_id == 255 and parsed.aux_hidden_state_layer_ids == [1, 3]
    assert parsed.draft_vocab_size == DRAFT_VOCAB and parsed.transformer_layer_config.num_hidden_layers == 2
    if kind == "dspark":
        assert parsed.sample_from_anchor is False and parsed.markov_rank == 8 and parsed.enable_confidence_head
    model = getattr(models, f"{'DFlash' if kind == 'dflash' else 'DSpark'}DraftModel")(parsed)
    result = model.load_state_dict(load_file(str(out / "model.safetensors")), strict=False)
    assert result.unexpected_keys == []
    assert not [k for k in result.missing_keys if k.startswith(("layers.", "fc.", "hidden_norm", "norm", "markov",
                                                                "confidence"))], result.missing_keys
