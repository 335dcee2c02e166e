"""Engine tau of a trained drafter on held-out prompts of its own distillation data (greedy, batch 1), to tell
distribution shift from a train/inference mismatch: compare with the run's teacher-forced acceptance.

    SPECDEC_CACHE=... python -m benchmarks.drafter_heldout_tau runs/train/eagle3 runs/data/smollm2_300 --name eagle3
"""

import argparse

from drafters import create_drafter
from specdec.engine import speculative_generate
from specdec.sampling import GREEDY
from specdec.target import load_target
from specdec.train.data import load_distill_data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("data_dir")
    ap.add_argument("--name", default="eagle3")
    ap.add_argument("--eval-examples", type=int, default=24, help="train.eval_examples of the training run")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 3])
    args = ap.parse_args()
    target = load_target("smollm2-135m-instruct")
    data = load_distill_data(args.data_dir)
    _, eval_idx = data.split_indices(args.eval_examples)
    prompts = [data.input_ids[i][: data.prompt_lens[i]].tolist() for i in eval_idx[: args.prompts]]
    for k in args.k:
        drafter = create_drafter(args.name, target, k, path=args.run_dir)
        m = speculative_generate(target, drafter, prompts, policy="greedy_chain", max_new_tokens=args.new_tokens,
                                 sampling=GREEDY, seed=0).metrics
        print(f"k={k}: tau {m.tau:.3f}, acceptance by position {m.acceptance_by_position()}", flush=True)


if __name__ == "__main__":
    main()
