"""Tree sampling modes on tests/test_dspark.py's two-phrase toy language, at temperature 1.

The toy DSpark of that test (trained 120 steps on the bigram language where a marker is followed by one of two
fixed phrases) drafts a 16-node tree (top_k 2, depth 8) three ways, over three seeds, on the test's prompts:
the top-k tree (tree_accept 0: picks, verified as one-hot drafts), the fixed sampled shape (`sample_tree`,
tree_accept 0.5) and the dynamic sampled tree (`tree_sampling: dynamic`). Prints the engine tau of each.

    python -m benchmarks.toy_tree_sampling        # ~2 min on 2 cores
"""

import tempfile

import numpy as np

import drafters.dspark as dspark
from drafters import create_drafter
from specdec.config import TrainConfig
from specdec.engine import speculative_generate
from specdec.sampling import SamplingParams
from specdec.train.loop import train
from tests.test_dspark import BLOCK, MARKER, two_phrase_data, two_phrase_target

MODES = {"top-k tree": {"tree_accept": 0.0}, "fixed sampled shape": {"tree_accept": 0.5},
         "dynamic sampled tree": {"tree_sampling": "dynamic"}}


def main():
    target, logp = two_phrase_target()
    cfg = TrainConfig(steps=120, batch_size=8, seq_len=32, lr=5e-3, warmup_frac=0.05, weight_decay=0.0,
                      checkpoint_every=10_000, eval_every=10_000, log_every=10_000, eval_examples=8)
    run = tempfile.mkdtemp()
    task = dspark.make_task(target, num_layers=1, block_size=BLOCK, taps=[1], num_anchors=12, markov_rank=8,
                            draft_vocab_size=16)
    train(task, target, two_phrase_data(logp, 192, 32), cfg, run, progress=False, eval_draft_len=BLOCK,
          log=lambda m: None)
    chain = create_drafter("dspark", target, BLOCK, path=run)
    prompts = [[MARKER], [4], [7, 8], [MARKER, 4, 5, 6]] * 4
    for name, mode in MODES.items():
        tree = dspark.DSparkDrafter(chain.arch, chain.params, 2 * BLOCK, tree_top_k=2, tree_depth=BLOCK, **mode)
        taus = [speculative_generate(target, tree, prompts, policy="multidraft_tree", max_new_tokens=40,
                                     sampling=SamplingParams(temperature=1.0), seed=s).metrics.tau for s in range(3)]
        print(f"{name:22s} tau by seed {np.round(taus, 2).tolist()}  mean {np.mean(taus):.2f}")


if __name__ == "__main__":
    main()
