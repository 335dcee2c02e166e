"""Export trained drafters to the serving engines' layouts, and import such exports back (docs/EXPORT.md).

    specdec export <run dir> --format vllm|sglang <out dir>
    specdec export <run or drafter dir> --format inference <out dir>   specdec's own drafter directory holding only
                                                                      what decoding reads (what ships in git;
                                                                      `checkpoint.export_inference`)

for EAGLE-3 (specdec/export/eagle3.py) and DFlash / DSpark (specdec/export/block.py) writes into <out dir>:
    config.json            the engine's config (speculators `eagle3` / `dflash` / `dspark` for vLLM;
                           `LlamaForCausalLMEagle3` / `DFlashDraftModel` / `DSparkDraftModel` for SGLang)
    model.safetensors      the weights under the engine's names (written with the `safetensors` library)
    tokenizer.json, tokenizer_config.json   the target's tokenizer (when the target has one)
    README.md              model card: target, data, steps, held-out acceptance
    specdec_export.json    what specdec needs to load it back (format, source run, step, target shape)

`load_export(path)` reads such a directory, or any such peer checkpoint in those layouts (sharded ones through
model.safetensors.index.json), as `specdec.train.checkpoint.load_drafter` does a run directory, so
`drafter.path=<export dir>` and `specdec generate --drafter <export dir>` work. It lives in
specdec/train/checkpoint.py (re-exported here), which `export_run` reads runs with.

The drafter architectures come from drafters/, which specdec/ does not import: the drafter modules register them
(specdec/export/registry.py), so call `drafters.available()` before `export_run`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from specdec.export import block as B
from specdec.export import eagle3 as E
from specdec.export import registry
from specdec.export.eagle3 import FORMATS, NotRepresentable  # noqa: F401  (re-exported)
from specdec.train import checkpoint as ckpt
from specdec.train.checkpoint import export_kind, is_export, load_export, read_tensors  # noqa: F401  (re-exported)

CONFIG_FILE = ckpt.EXPORT_CONFIG
WEIGHTS_FILE = "model.safetensors"
META_FILE = ckpt.EXPORT_META
EXPORTABLE = ("eagle3", *B.KINDS)
INFERENCE = ckpt.INFERENCE


def verifier_of(target, model_name: str | None = None) -> dict:
    """{"name_or_path", "architectures"} of the target for speculators' `verifier` block."""
    from specdec.models.registry import REGISTRY

    cfg = target.cfg
    name = model_name or cfg.name
    entry = REGISTRY.get(name)
    if entry is not None and entry.hf_id:
        name = entry.hf_id
    arch = "Qwen3ForCausalLM" if cfg.qk_norm else "Qwen2ForCausalLM" if cfg.attention_bias else "LlamaForCausalLM"
    hf_config = Path(str(model_name or "")) / CONFIG_FILE
    if hf_config.is_file():  # a Hugging Face directory says what it is
        arch = (json.loads(hf_config.read_text()).get("architectures") or [arch])[0]
    return {"name_or_path": name, "architectures": [arch]}


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, fmt: str, target, *,
               model_name: str | None = None, num_draft_tokens: int | None = None, overwrite: bool = False) -> Path:
    """Export the trained drafter of `run_dir` (a training run or any drafter.json + params.npz directory) for
    `target` in `fmt` ("vllm" or "sglang") into `out_dir`. `model_name`: how the run named the target
    (registry name or Hugging Face directory; default: the run's config.yaml) for the verifier field and the
    tokenizer files. Raises NotRepresentable when the drafter has no exact equivalent in the peer format.
    `fmt` "inference": specdec's inference format (`checkpoint.export_inference`; `target` is not read)."""
    import yaml
    from safetensors.numpy import save_file

    if fmt == INFERENCE:
        return ckpt.export_inference(run_dir, out_dir, overwrite=overwrite)
    E._check_format(fmt)
    run = Path(run_dir)
    info = ckpt.load_drafter(run)
    # the peer writers index vocabulary tensors by target id; an inference-format drafter holds the read ones
    info["params"] = ckpt.widen_draft_vocab(info, target.cfg.vocab_size)
    kind = info["drafter"]
    if kind not in EXPORTABLE:
        raise NotRepresentable(f"{run} holds a {kind!r} drafter; export supports {', '.join(EXPORTABLE)}")
    ckpt.check_target(info, target, str(run))
    run_cfg = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").is_file() else {}
    run_cfg = run_cfg or {}
    model_name = model_name or (run_cfg.get("model") or {}).get("name")
    verifier = verifier_of(target, model_name)
    notes: list[str] = []
    arch = registry.arch_from_checkpoint(kind, target, info["config"])
    if kind == "eagle3":
        k = num_draft_tokens or (run_cfg.get("drafter") or {}).get("num_draft_tokens") or 3
        config, tensors = E.to_peer(arch, info["params"], info["buffers"], target.cfg, fmt, num_draft_tokens=int(k),
                                    verifier=verifier)
    else:
        # the engines draft a whole block by default (vLLM: num_speculative_tokens; SGLang: block_size - 1)
        k = num_draft_tokens or arch.drafts
        config, tensors, notes = B.to_peer(kind, arch, info["params"], info["buffers"], target.cfg, fmt,
                                           embed=target.params["embed"], head=target.output_projection(),
                                           num_draft_tokens=int(k), verifier=verifier)
    out = Path(out_dir)
    ckpt.make_export_dir(out, overwrite)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    tmp = out / "model.partial.safetensors"
    save_file(tensors, str(tmp), metadata={"format": "pt"})  # "pt": what transformers / vLLM expect in the header
    os.replace(tmp, out / WEIGHTS_FILE)
    os.chmod(out / WEIGHTS_FILE, 0o644)  # safetensors writes 0600; the serving side is often another user
    tokenizer_files = write_tokenizer(target, out, model_name)
    meta = {"format": fmt, "drafter": kind, "config": info["config"], "source": str(run.absolute()),
            "step": info["step"], "target": info["target"] or ckpt.target_info(target),
            "num_draft_tokens": int(k), "not_carried": notes, "own_embedding": "embed_tokens.weight" in tensors,
            # what the peer format drops but a re-import into specdec should keep (DSpark's calibration)
            "buffers": {name: np.asarray(v).tolist() for name, v in info["buffers"].items()
                        if name.startswith("conf_temperature")}}
    (out / META_FILE).write_text(json.dumps(meta, indent=2))
    (out / "README.md").write_text(model_card(run, run_cfg, meta, config, target, tokenizer_files))
    return out


def write_tokenizer(target, out: Path, model_name: str | None) -> list[str]:
    """Copy a Hugging Face directory's tokenizer files, or write the target's tokenizer (e.g. built from a
    GGUF) as tokenizer.json + tokenizer_config.json. Returns the files written (none: the target has no
    tokenizer, e.g. a random test model)."""
    src = Path(str(model_name)) if model_name else None
    if src is not None and (src / "tokenizer.json").is_file():
        names = [n for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                             "chat_template.jinja", "vocab.json", "merges.txt") if (src / n).is_file()]
        for n in names:
            shutil.copy2(src / n, out / n)
        return names
    tok = getattr(target, "tokenizer", None)
    backend = getattr(tok, "backend", None)
    if backend is None:
        return []
    backend.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
           "pad_token": tok.pad_token, "model_max_length": target.cfg.max_position_embeddings}
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return ["tokenizer.json", "tokenizer_config.json"]


def model_card(run: Path, run_cfg: dict, meta: dict, config: dict, target, tokenizer_files: list[str]) -> str:
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else {}
    train = run_cfg.get("train") or {}
    data = run_cfg.get("data") or {}
    datasets = ", ".join(f"{d.get('name')}" + (f" (limit {d['limit']})" if d.get("limit") else "")
                         for d in data.get("datasets") or []) or "not recorded"
    data_dir = train.get("data_dir")
    data_summary = Path(data_dir) / "summary.json" if data_dir else None
    examples = ""
    if data_summary is not None and data_summary.is_file():
        ds = json.loads(data_summary.read_text())
        examples = f"; {ds.get('examples')} examples, {ds.get('response_tokens')} response tokens"
    fmt, kind = meta["format"], meta["drafter"]
    ids = (config.get("eagle_aux_hidden_state_layer_ids") or config.get("aux_hidden_state_layer_ids")
           or config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
           or config.get("dflash_config", {}).get("target_layer_ids"))
    final = summary.get("final_eval") or {}
    verifier = verifier_of(target, (run_cfg.get("model") or {}).get("name"))["name_or_path"]
    where = f" (`{data_dir}`{examples})" if data_dir else ""
    title = {"eagle3": "EAGLE-3", "dflash": "DFlash", "dspark": "DSpark"}[kind]
    lines = [
        f"# {title} drafter for {verifier} ({fmt} layout)",
        "",
        "Exported by specdec (`specdec export`) from a trained run; docs/EXPORT.md in specdec describes every field.",
        "",
        "| | |", "|---|---|",
        f"| target | {verifier} ({target.cfg.num_layers} layers, hidden {target.cfg.hidden_size}, vocabulary "
        f"{target.cfg.vocab_size}) |",
        f"| target layers read (specdec taps) | {sorted(meta['config']['taps'])}; in this file's numbering: {ids} |",
        f"| draft vocabulary | {config.get('draft_vocab_size')} |",
        *([f"| block | {meta['config']['block_size']} slots: [anchor, mask x {meta['config']['block_size'] - 1}], "
           f"slot j predicts the token at anchor + j (`sample_from_anchor: false`); mask token "
           f"{meta['config']['mask_token_id']} |"] if kind != "eagle3" else []),
        f"| training data | {datasets}{where} |",
        f"| steps | {meta['step']} (status: {summary.get('status', 'unknown')}) |",
        f"| source run | `{meta['source']}` |",
    ]
    if final:
        lines += [f"| held-out expected tau (k={final.get('draft_len')}, T=1, teacher-forced) | "
                  f"{final.get('expected_tau'):.3f} |",
                  f"| held-out greedy tau | {final.get('greedy_tau'):.3f} |",
                  f"| acceptance by draft position | {final.get('acceptance_by_step')} |"]
    else:
        lines.append("| held-out tau | not measured (the run has no final evaluation) |")
    lines += ["", "Tau by dataset is not measured by training; `specdec run` / `specdec sweep` with this drafter "
              "measure it per dataset.", ""]
    if meta.get("not_carried"):
        lines += ["## Not carried by this format", ""] + [f"- {n}" for n in meta["not_carried"]] + [""]
    lines += ["## Serving", ""]
    if fmt == "vllm":
        spec = json.dumps({"method": kind, "model": "<this dir>",
                           "num_speculative_tokens": meta["num_draft_tokens"]})
        lines += ["```", f"vllm serve <target> --speculative-config '{spec}'", "```"]
    elif kind != "eagle3":
        lines += ["```", f"python -m sglang.launch_server --model <target> --speculative-algorithm {kind.upper()} "
                  "--speculative-draft-model-path <this dir>", "```"]
    else:
        lines += ["```", "python -m sglang.launch_server --model <target> --speculative-algorithm EAGLE3 "
                  "--speculative-draft-model-path <this dir> --speculative-num-steps "
                  f"{meta['num_draft_tokens']} --speculative-eagle-topk 1 --speculative-num-draft-tokens "
                  f"{meta['num_draft_tokens'] + 1}", "```"]
    lines += ["", "`embed_tokens` / `lm_head`: the target's, written out because SGLang's DSpark model owns them "
              "(specdec's drafter shares the target's)." if meta["own_embedding"] else
              "No `embed_tokens`: the engine shares the target's embedding, as specdec's drafter does.",
              "Tokenizer files: " + (", ".join(tokenizer_files) if tokenizer_files else
                                     "none (the target has no tokenizer)") + "."]
    return "\n".join(lines) + "\n"
