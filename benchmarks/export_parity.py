"""Export parity of trained drafters on the real target (docs/EXPORT.md "Real drafters"): each drafter exported
for vLLM and SGLang, checked with the tests' PyTorch re-implementations of the peers' drafter forward
(tests/peer_eagle3.py, tests/peer_block.py) on real target features, then loaded back into specdec.

    python -m benchmarks.export_parity runs/compare/dspark runs/compare/eagle3 [--formats vllm sglang]
        [--prompts 4] [--new-tokens 64] [--config configs/benchmarks/base.yaml] [--out DIR]

For each drafter directory (a training run with drafter.json + checkpoints/, or drafter.json + params.npz) and
format:
1. `export_run` into a temporary directory; a `NotRepresentable` refusal (e.g. SGLang and a reduced draft
   vocabulary) is the row's result, not a failure.
2. Parity: the prompts of --config's `data:` section (default: the benchmarks' MT-Bench, GSM8K, HumanEval, in turn)
   plus the target's own greedy continuation; every position of the continuation is an anchor (prefix = prompt +
   continuation before it, root = the target's greedy token there). The target's hidden states of every layer,
   computed once per prompt, go to both the peer re-implementation (which loads config.json + model.safetensors and
   picks its layers by the engine's id semantics) and specdec's JAX drafter (the tests' drafting path). Reported:
   the largest relative L2 of the draft logits over anchors, argmax agreement over every drafted position, and
   whether the drafted target ids (the peer maps through the d2t offsets, specdec through its absolute ids) are
   equal.
3. Round trip: the export loaded back (`create_drafter(None, ..., path=export)`): the same drafted ids and draft
   logits (rtol / atol 1e-5, as the tests) as the original on the same anchors, and the engine's greedy output
   with it (greedy_chain) equal to AR greedy output on the first --greedy-prompts prompts.

Exit status 1 when any row FAILs (parity: relative L2 >= 1e-4, argmax < 100%, or ids differ; round trip or
greedy != AR), 2 on bad arguments. Correctness only: nothing here is timed. Writes
runs/benchmarks/export_parity/results.{json,md} (`--out`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import yaml

from benchmarks.common import REPO, Report, add_output_arg, load_config_prompts
from benchmarks.snapshot_drafter import snapshot
from drafters import create_drafter
from specdec.engine import speculative_generate
from specdec.export import FORMATS, META_FILE, NotRepresentable, export_run
from specdec.generate import generate, prefill
from specdec.sampling import GREEDY
from specdec.testing import drafter_state
from specdec.train import checkpoint as ckpt
from tests.peer_block import PeerBlockDrafter
from tests.peer_eagle3 import PeerEagle3
from tests.test_eagle3 import context, engine_round
from tests.test_export_block import block_round

REL_L2 = 1e-4  # the parity threshold of the export tests
ROUND_TRIP_TOL = 1e-5  # fc's input blocks are reordered on export, so the round trip is close, not bitwise


def target_name(run: Path) -> str | None:
    """The target a training run's config.yaml names (None: no config.yaml, e.g. a snapshot directory)."""
    cfg = yaml.safe_load((run / "config.yaml").read_text()) if (run / "config.yaml").is_file() else None
    return ((cfg or {}).get("model") or {}).get("name")


class Features:
    """One prompt + the target's greedy continuation, with every layer's hidden states over it [L+1, T, H]."""

    def __init__(self, target, prompt: list[int], continuation: list[int]):
        self.seq = list(prompt) + list(continuation)
        self.prompt_len = len(prompt)
        tokens = jnp.asarray([self.seq], jnp.int32)
        every = tuple(range(target.cfg.num_layers + 1))
        _, taps, _ = prefill(target.params, target.init_cache(1, len(self.seq) + 8), tokens,
                             jnp.asarray([len(self.seq)], jnp.int32), forward=target.forward, cfg=target.cfg,
                             taps=every)
        self.hidden = np.stack([np.asarray(taps[layer][0]) for layer in every])  # causal: a prefix's states too

    @property
    def anchors(self) -> list[int]:
        """Prefix lengths n: the prefix seq[:n] is verified, seq[n] (the target's greedy token) is the root."""
        return list(range(self.prompt_len, len(self.seq)))


def specdec_drafts(drafter, feats: Features) -> tuple[np.ndarray, np.ndarray]:
    """specdec's greedy drafts at every anchor, as the export tests draft them: the state from `init` after the
    prefix's prefill, then the engine's drafting path. Returns (draft logits [A, k, Vd], drafted ids [A, k])."""
    anchors = feats.anchors
    width = len(feats.seq)
    tokens = np.tile(np.asarray(feats.seq, np.int32), (len(anchors), 1))  # row a: seq[:n_a] verified
    taps = {t: np.broadcast_to(feats.hidden[t], (len(anchors), *feats.hidden[t].shape)) for t in drafter.taps}
    roots = np.asarray([feats.seq[n] for n in anchors], np.int32)
    state = drafter_state(drafter, tokens, anchors, roots, taps, capacity=width + 8)
    rows = [feats.seq[: n + 1] for n in anchors]  # prefix + root: the committed sequence of the first round
    if drafter.name == "eagle3":
        lg, drafted, _, _ = engine_round(drafter, drafter.params, state, context(rows, width + 1))
        return np.asarray(lg), np.asarray(drafted)
    lg, drafted, _ = block_round(drafter, state, rows, width + 1)
    return lg, drafted


def peer_drafts(peer, kind: str, feats: Features, k: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """The peer re-implementation's greedy drafts at every anchor: (target ids [A][k], logits [A] x [k, V])."""
    import torch

    ids, logits = [], []
    for n in feats.anchors:
        states = {layer: torch.from_numpy(np.array(feats.hidden[layer, :n])) for layer in peer.capture}
        if kind == "eagle3":
            tokens, full = peer.propose(feats.seq[:n], feats.seq[n], states, k)
        else:
            tokens, full, _ = peer.propose(feats.seq[n], states, k)
        ids.append(tokens)
        logits.append(full.numpy())
    return ids, logits


def make_peer(kind: str, export_dir: Path, target):
    import torch

    embed = torch.from_numpy(np.array(target.params["embed"]))
    if kind == "eagle3":
        return PeerEagle3(export_dir, embed)
    head = embed if target.cfg.tie_word_embeddings else torch.from_numpy(np.array(target.params["lm_head"]).T)
    return PeerBlockDrafter(export_dir, embed, head)


def draft_ids_of(drafter, vocab: int) -> np.ndarray:
    """specdec's draft id i is target id d2t[i] (absolute ids); the full vocabulary has no map."""
    return np.asarray(drafter.params["d2t"]) if "d2t" in drafter.params else np.arange(vocab)


def parity(drafter, peer, kind: str, features: list[Features], k: int, vocab: int) -> dict:
    d2t = draft_ids_of(drafter, vocab)
    rel, agree, positions, ids_equal, anchors, outside = 0.0, 0, 0, 0, 0, True
    for feats in features:
        lg, drafted = specdec_drafts(drafter, feats)
        ids, logits = peer_drafts(peer, kind, feats, k)
        for a in range(len(ids)):
            theirs = logits[a][:, d2t]  # the peer scattered to target ids through the d2t offsets
            outside &= bool(np.isinf(np.delete(logits[a], d2t, axis=1)).all())  # nothing off the draft vocab
            rel = max(rel, float(np.linalg.norm(theirs - lg[a]) / np.linalg.norm(lg[a])))
            agree += int((theirs.argmax(-1) == lg[a].argmax(-1)).sum())
            positions += k
            ids_equal += ids[a] == drafted[a].tolist()
            anchors += 1
    ok = rel < REL_L2 and agree == positions and ids_equal == anchors and outside
    return {"rel_l2": rel, "argmax_pct": 100.0 * agree / positions, "ids_equal": f"{ids_equal}/{anchors}",
            "off_vocab_inf": outside, "parity_ok": ok}


def round_trip(original, imported, features: list[Features]) -> dict:
    rel, equal = 0.0, True
    for feats in features:
        lg0, tok0 = specdec_drafts(original, feats)
        lg1, tok1 = specdec_drafts(imported, feats)
        equal &= bool((tok0 == tok1).all() and np.allclose(lg1, lg0, rtol=ROUND_TRIP_TOL, atol=ROUND_TRIP_TOL))
        rel = max(rel, float(np.linalg.norm(lg1 - lg0) / np.linalg.norm(lg0)))
    return {"round_trip_equal": equal, "round_trip_rel_l2": rel}


def check_drafter(run: Path, source: Path, info: dict, target, features: list[Features],
                  greedy: tuple[list[list[int]], list[list[int]], int], formats: list[str], model_name: str | None,
                  work: Path) -> list[dict]:
    """Rows (one per format) for the drafter of `run`, frozen as `source` (`snapshot`'s `info`); exports go under
    `work`. `greedy`: (prompts, their AR greedy outputs, new tokens)."""
    kind, step = info["drafter"], info["step"]
    rows = []
    for fmt in formats:
        row = {"drafter": str(run), "kind": kind, "step": step, "format": fmt}
        out = work / fmt
        try:
            export_run(source, out, fmt, target, model_name=model_name)
        except NotRepresentable as e:  # a documented outcome (docs/EXPORT.md), not a failure
            rows.append({**row, "status": f"refused: {e}"})
            print(format_row(rows[-1]), flush=True)
            continue
        k = json.loads((out / META_FILE).read_text())["num_draft_tokens"]  # what the engines would draft
        original = create_drafter(kind, target, k, path=str(source))
        row.update(k=k, **parity(original, make_peer(kind, out, target), kind, features, k, target.cfg.vocab_size))
        imported = create_drafter(None, target, k, path=str(out))  # the kind comes from config.json
        row.update(round_trip(original, imported, features))
        prompts, ar, new_tokens = greedy
        spec = speculative_generate(target, imported, prompts, policy="greedy_chain", max_new_tokens=new_tokens,
                                    sampling=GREEDY)
        row["greedy_eq_ar"] = spec.tokens == ar
        row["status"] = "ok" if row["parity_ok"] and row["round_trip_equal"] and row["greedy_eq_ar"] else "FAIL"
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


TABLE_HEADER = ["drafter", "format", "status", "rel L2 (max)", "argmax %", "ids equal", "round trip (rel L2)",
                "greedy == AR"]


def table_cells(row: dict) -> list:
    name = f"{Path(row['drafter']).name} ({row['kind']}, step {row['step']})"
    if "rel_l2" not in row:
        return [name, row["format"], row["status"], "", "", "", "", ""]
    yes = {True: "yes", False: "NO"}
    return [name, row["format"], row["status"], f"{row['rel_l2']:.1e}", f"{row['argmax_pct']:.2f}", row["ids_equal"],
            f"{yes[row['round_trip_equal']]} ({row['round_trip_rel_l2']:.0e})", yes[row["greedy_eq_ar"]]]


def format_row(row: dict) -> str:
    return "| " + " | ".join(map(str, table_cells(row))) + " |"


def real_prompts(target, n: int, config: Path) -> list[list[int]]:
    """n prompts of the `data:` section of `config` (loaded and chat-templated as `specdec run` does), taking its
    datasets in turn (MT-Bench, GSM8K, HumanEval for the benchmarks' base config)."""
    from specdec.config import load_config

    loaded = load_config_prompts(load_config(config), target)
    per = [[loaded.ids[p.key] for p in loaded.items if p.dataset == d] for d in loaded.datasets]
    return [p for group in itertools.zip_longest(*per) for p in group if p is not None][:n]


def run_checks(args, model_name: str, frozen: list[tuple[Path, Path, dict]]) -> list[dict]:
    from specdec.target import load_target

    print(f"loading target {model_name} ...", flush=True)
    target = load_target(model_name)
    prompts = real_prompts(target, args.prompts, args.config)
    ar = generate(target, prompts, max_new_tokens=args.new_tokens, sampling=GREEDY).tokens
    features = [Features(target, p, c) for p, c in zip(prompts, ar)]
    g = args.greedy_prompts
    greedy = (prompts[:g], generate(target, prompts[:g], max_new_tokens=args.new_tokens, sampling=GREEDY).tokens,
              args.new_tokens)
    print(f"{len(prompts)} prompts, {sum(len(f.anchors) for f in features)} anchors; greedy == AR on {g}",
          flush=True)
    rows = []
    for run, work, info in frozen:
        rows += check_drafter(run, work / "source", info, target, features, greedy, args.formats, model_name, work)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafters", nargs="+", type=Path, help="training run or drafter.json + params.npz directories")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--prompts", type=int, default=4, help="prompts for the parity anchors")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy continuation per prompt (= anchors)")
    ap.add_argument("--greedy-prompts", type=int, default=2, help="prompts of the greedy == AR check")
    ap.add_argument("--model", help="the target (default: model.name of the runs' config.yaml)")
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "benchmarks" / "base.yaml",
                    help="the experiment config whose data: section gives the prompts")
    add_output_arg(ap, __file__)
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.new_tokens < 2 or not 1 <= args.greedy_prompts <= args.prompts:
        ap.error("need --prompts >= 1, --new-tokens >= 2 and 1 <= --greedy-prompts <= --prompts")
    for d in args.drafters:
        if not (d / ckpt.DRAFTER_FILE).is_file():
            ap.error(f"{d} is not a drafter directory (no {ckpt.DRAFTER_FILE}): pass a training run "
                     "(output.dir/output.name) or a drafter.json + params.npz directory")
    names = {args.model} if args.model else {target_name(d) for d in args.drafters}
    if None in names:
        ap.error(f"{', '.join(str(d) for d in args.drafters if not target_name(d))}: no config.yaml naming the "
                 "target; pass --model")
    if len(names) > 1:
        ap.error(f"the drafters name different targets ({', '.join(sorted(names))}): run them separately")
    report = Report(__file__, argv, args.out)
    with tempfile.TemporaryDirectory(prefix="export_parity_") as work:
        frozen = []
        for i, d in enumerate(args.drafters):  # every drafter read now, before the (slow) target load
            try:
                # frozen: a run still training cannot move to a newer checkpoint between export and check
                frozen.append((d, Path(work) / str(i), snapshot(d, Path(work) / str(i) / "source")))
            except ckpt.CheckpointError as e:  # e.g. a run that has not written its first checkpoint yet
                ap.error(str(e))
        rows = run_checks(args, names.pop(), frozen)
    report.table("Export parity", TABLE_HEADER, [table_cells(row) for row in rows],
                 note=f"{args.prompts} prompts x {args.new_tokens} anchors; parity: rel L2 <= {REL_L2:g}")
    report.write({"rows": rows})
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
