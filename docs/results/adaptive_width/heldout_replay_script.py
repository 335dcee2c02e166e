"""The record of a one-off analysis (not part of the product): the adaptive width's knobs replayed on held-out
prompt sets they were not tuned on, with fixed round costs. Ran at commit 78473f9 (the scheduler's decisions are
the same after the refactor): cd <checkout of 78473f9> && PYTHONPATH=. python heldout_replay_script.py hybridB1 ngram1"""
import csv, dataclasses, json, os, random, sys, time
import numpy as np
from drafters import SHIPPED_DRAFTER, create_drafter
from specdec.adaptive import AdaptiveWidth
from specdec.engine import speculative_generate
from specdec.generate import generate
from specdec.sampling import GREEDY
from specdec.target import load_target

D = "/work/shared/data"
N = int(os.environ.get("N", 4))
MAX_NEW = 64


def sample(rows, seed=0):
    rows = list(rows); random.Random(seed).shuffle(rows); return rows[:N]


def heldout():
    mb = [json.loads(l) for l in open(f"{D}/mbpp/mbpp.jsonl")]
    mb = [r for r in mb if 11 <= r["task_id"] <= 510]
    sets = {"mbpp": [f"{r['text']}\nYour code should pass this test:\n{r['test_list'][0]}" for r in sample(mb)]}
    cg = json.load(open(f"{D}/gpteacher/codegen-instruct.json"))
    sets["gpteacher_code"] = [(r["instruction"] + ("\n\n" + r["input"] if r["input"] else "")) for r in sample(cg)]
    rp = json.load(open(f"{D}/gpteacher/roleplay-simple-deduped-roleplay-instruct.json"))
    sets["gpteacher_roleplay"] = [(r["instruction"] + ("\n\n" + r["input"] if r["input"] else "")) for r in sample(rp)]
    si = [json.loads(l) for l in open(f"{D}/self_instruct/seed_tasks.jsonl")]
    sets["self_instruct"] = [(r["instruction"] + ("\n\n" + r["instances"][0]["input"] if r["instances"][0]["input"] else "")) for r in sample(si)]
    ac = list(csv.DictReader(open(f"{D}/awesome_chatgpt_prompts/prompts.csv")))
    sets["awesome_prompts"] = [r["prompt"] for r in sample(ac)]
    return sets


C0 = 0.0245
COSTS = {  # (round cost per verify width, draft cost): ratios recorded on a 2-core VM of this kind
    ("ngram", 1): ((C0, C0 * 1.20, C0 * 1.21, C0 * 1.35), 1.6e-6),
    ("hybrid", 1): ((0.0245, 0.031115, 0.032095, 0.037485), 0.00392),
    ("suffix", 1): ((C0, C0 * 1.20, C0 * 1.21, C0 * 1.46, C0 * 1.50), 0.0025),
    ("ngram", 8): ((0.0521, 0.0602, 0.0953, 0.1264), 5.5e-6),  # a recorded batch-8 profile
}

B = {"tree_value": "nodes", "score_bins": (0.5,), "prior_depth": 0.9}  # hybrid_batch1.yaml's scheduler knobs
VARIANTS = {
    ("hybridB", 1): {"default": {}, "tree_value=nodes": {"tree_value": "nodes"},
                     "nodes+score_bins=0.5": {"tree_value": "nodes", "score_bins": (0.5,)},
                     "nodes+prior_depth=0.9": {"tree_value": "nodes", "prior_depth": 0.9},
                     "hybrid_batch1 (nodes+bins+0.9)": B},
    ("ngram", 1): {"default": {}, "prior_depth=1.0": {"prior_depth": 1.0}, "margin=0": {"margin": 0.0},
                   "explore_budget=0": {"explore_budget": 0.0}, "free_draft=0": {"free_draft": 0.0},
                   "calibration_min_batch=1": {"calibration_min_batch": 1}, "decay=0.8": {"decay": 0.8},
                   "explore_every=16": {"explore_every": 16}},
    ("ngram", 8): {"default": {}, "calibration_weight=0": {"calibration_weight": 0.0},
                   "free_draft_max_batch=8": {"free_draft_max_batch": 8},
                   "objective=throughput": {"objective": "throughput"}, "margin=0": {"margin": 0.0}},
    ("suffix", 1): {"default": {}, "tree_value=nodes": {"tree_value": "nodes"}},
}
COSTS[("hybridB", 1)] = COSTS[("hybrid", 1)]


def main():
    only = sys.argv[1:]
    target = load_target("smollm2-135m-instruct")
    sets = heldout()
    enc = {k: [target.tokenizer.encode_chat(t) for t in v] for k, v in sets.items()}
    out_path = "/tmp/knobs/results.json"
    results = json.load(open(out_path)) if os.path.exists(out_path) else {}
    ar_path = "/tmp/knobs/ar.json"
    ar_cache = {tuple(json.loads(k)): v for k, v in (json.load(open(ar_path)).items() if os.path.exists(ar_path) else [])}
    drafters = {
        "ngram": (lambda: create_drafter("ngram", target, 5, max_ngram=3), "greedy_chain"),
        "suffix": (lambda: create_drafter("suffix", target, 8), "greedy_tree"),
        "hybrid": (lambda: create_drafter("hybrid", target, 7, path=str(SHIPPED_DRAFTER), tree_top_k=4, tree_depth=3,
                                          min_match=2), "greedy_tree"),
        "hybridB": (lambda: create_drafter("hybrid", target, 7, path=str(SHIPPED_DRAFTER), tree_top_k=4, tree_depth=3,
                                           min_match=1, lookup_nodes=3, alone_match=4), "greedy_tree"),
    }
    for (name, batch), variants in VARIANTS.items():
        if only and f"{name}{batch}" not in only:
            continue
        make, policy = drafters[name]
        drafter = make()
        rc, dc = COSTS[(name, batch)]
        for label, opts in variants.items():
            key = f"{name}|B={batch}|{label}"
            if key in results:
                continue
            row = {}
            for sname, prompts in enc.items():
                groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
                spec_s = ar_s = 0.0; same = 0; new = rounds = 0
                if hasattr(drafter, "clear_global"):
                    drafter.clear_global()
                for g in groups:
                    gk = (sname, batch, g[0][-8:] and str(sum(map(sum, g))), len(g))
                    if gk not in ar_cache:
                        ar_cache[gk] = generate(target, g, max_new_tokens=MAX_NEW, sampling=GREEDY).tokens
                        json.dump({json.dumps(list(k)): v for k, v in ar_cache.items()}, open(ar_path, "w"))
                    ar = ar_cache[gk]
                    sched = AdaptiveWidth(costs=(rc, dc), **opts)
                    o = speculative_generate(target, drafter, g, policy=policy, max_new_tokens=MAX_NEW, scheduler=sched)
                    same += sum(a == b for a, b in zip(o.tokens, ar))
                    spec_s += o.metrics.predicted_seconds
                    ar_s += (max(len(t) for t in ar) - 1) * rc[0]
                    new += o.metrics.new_tokens - len(g); rounds += o.metrics.rounds
                print(f"  {key} {sname} done", flush=True)
                row[sname] = {"speedup": ar_s / spec_s, "tau": new / max(rounds, 1), "same": f"{same}/{len(prompts)}"}
            vals = [r["speedup"] for r in row.values()]
            row["_worst"], row["_geomean"] = min(vals), float(np.exp(np.mean(np.log(vals))))
            results[key] = row
            json.dump(results, open(out_path, "w"), indent=1)
            print(f"{key:45s} worst {row['_worst']:.3f} geomean {row['_geomean']:.3f}  " +
                  " ".join(f"{s}={r['speedup']:.3f}" for s, r in row.items() if not s.startswith("_")), flush=True)


if __name__ == "__main__":
    main()
