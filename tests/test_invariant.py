"""Drafter-invariant sampling: at temperature > 0 the invariant policies commit exactly AR's sampled tokens for the
same seed, for every drafter, at any verify width and batch; and the keyed noise behind every draw is uniform and
independent across seeds, rows, positions and tokens.

Tree drafters draw each node's children with the target's noise at their position, so the first child is the
coupled draw: an oracle draft LM's tree has the target's sample as every first child.

Negative controls: a weak mixer fails the noise checks, another seed gives other tokens, a policy that draws
the target's sample one position off fails the equality, and the oracle's uncoupled top-k tree misses the target's
sample as a first child."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import drafters
from drafters import create_drafter
from drafters.draft_lm import DraftLMDrafter, DraftLMTreeDrafter
from drafters.eagle3 import Eagle3TreeDrafter
from drafters.hybrid import HybridDrafter
from drafters.ngram import NgramDrafter
from specdec import sampling as S
from specdec.adaptive import AdaptiveWidth
from specdec.drafter import Draft
from specdec.engine import speculative_generate
from specdec.generate import generate
from specdec.sampling import SamplingParams, sample, sample_key
from specdec.testing import PROMPTS, draft_fit, peaky_target
from specdec.verify import Policy, get_policy
from specdec.verify.invariant import invariant_chain, invariant_tree

P_VALUE_MIN = 1e-3
HOT = SamplingParams(temperature=1.0)
NUCLEUS = SamplingParams(temperature=0.7, top_p=0.95)
NEW_TOKENS = 13


# ---------------------------------------------------------------------------------------------------------
# The noise
# ---------------------------------------------------------------------------------------------------------

def grid_uniforms(seed=0, rows=16, positions=32, tokens=256, stream=S.SAMPLE_STREAM) -> np.ndarray:
    """Uniforms [rows, positions + 1, tokens + 1] of one seed on a grid of consecutive rows, positions and ids."""
    r = jnp.arange(rows)[:, None, None]
    t = jnp.arange(positions + 1)[None, :, None]
    x = jnp.arange(tokens + 1)[None, None, :]
    return np.asarray(S.bits_to_uniform(S.noise_bits(jnp.uint32(seed), r, t, x, stream)), np.float64)


def noise_p_values(u: np.ndarray, other_seed: np.ndarray) -> dict[str, float]:
    """KS against U(0, 1), a 64-bin chi-square, and chi-square independence tests (8 x 8 cells) of each value
    with its neighbour in token id, position, row and seed."""
    flat = u[:, :-1, :-1].ravel()
    out = {"ks": scipy.stats.kstest(flat, "uniform").pvalue,
           "histogram": scipy.stats.chisquare(np.bincount((flat * 64).astype(int), minlength=64)).pvalue}
    pairs = {"token": (u[:, :-1, :-1], u[:, :-1, 1:]), "position": (u[:, :-1, :-1], u[:, 1:, :-1]),
             "row": (u[:-1, :-1, :-1], u[1:, :-1, :-1]), "seed": (u[:, :-1, :-1], other_seed[:, :-1, :-1])}
    for name, (a, b) in pairs.items():
        cells = np.zeros((8, 8))
        np.add.at(cells, ((a.ravel() * 8).astype(int), (b.ravel() * 8).astype(int)), 1)
        out[name] = scipy.stats.chi2_contingency(cells)[1]
    return out


def test_noise_is_uniform_and_independent_and_a_weak_mixer_is_caught(monkeypatch):
    """130k values per check: uniform, and independent of the value at the next token id, the next position,
    the next row and the next seed. The negative control swaps the avalanche mix for a multiplicative hash
    (x * golden ratio, no xor-shifts): neighbours are then visibly dependent and a check fails."""
    p = noise_p_values(grid_uniforms(0), grid_uniforms(1))
    assert min(p.values()) > P_VALUE_MIN, p
    # the streams are independent too (a rejection test must not see the drafter's noise)
    cross = noise_p_values(grid_uniforms(0), grid_uniforms(0, stream=S.TEST_STREAM))["seed"]
    assert cross > P_VALUE_MIN, cross

    monkeypatch.setattr(S, "_mix", lambda x: x * jnp.uint32(0x9E3779B1))
    weak = noise_p_values(grid_uniforms(0), grid_uniforms(1))
    assert min(weak.values()) < 1e-6, weak


def test_sample_draws_the_processed_distribution():
    """Gumbel-max with the keyed noise (rows 0..N-1 at one position) samples softmax of the processed logits:
    chi-square against it, and never a token top-p removed."""
    logits = jnp.asarray(np.random.default_rng(0).normal(0, 2, 24), jnp.float32)
    n = 60_000
    for sp in (HOT, SamplingParams(temperature=0.7, top_k=10, top_p=0.8)):
        tokens = sample(sample_key(7, n, start=5), jnp.broadcast_to(logits, (n, 24)), sp)
        counts = np.bincount(np.asarray(tokens), minlength=24)
        p = np.asarray(S.probabilities(logits, sp), np.float64)
        assert counts[p == 0].sum() == 0
        assert scipy.stats.chisquare(counts[p > 0], n * p[p > 0] / p.sum()).pvalue > P_VALUE_MIN


def test_a_drafter_samples_from_the_q_it_returns():
    """A sampling drafter draws with Gumbel-max on the q it returns, so its token always has q > 0 under a tight
    top-k / top-p, over 500 rows, i.e. 500 keys, and its tokens follow that q (`draft_fit`'s chi-square).
    DFlash used to sample each slot under vmap but return q computed for all slots at once; DSpark draws slot by
    slot through its Markov head. (Every drafter's own test file checks the same at T = 0.7, top-k, top-p.)"""
    target = peaky_target(3)
    tight = SamplingParams(temperature=1.0, top_k=6, top_p=0.6)
    for drafter in (block_drafter(target, "dflash"), block_drafter(target, "dspark")):
        p_value, _, impossible, inconsistent = draft_fit(target, drafter, sampling=tight, rows=500)
        assert impossible == 0 and inconsistent == 0, (drafter.name, impossible, inconsistent)
        assert p_value > P_VALUE_MIN, (drafter.name, p_value)


# ---------------------------------------------------------------------------------------------------------
# Speculative == AR, token for token
# ---------------------------------------------------------------------------------------------------------

def block_drafter(target, kind: str, tree: dict | None = None):
    """A random DFlash / DSpark (chain of 3, or a tree with `tree` settings) for `target`."""
    from drafters import dflash
    from tests.test_dflash import noisy
    from tests.test_scheduling import random_dspark

    if kind == "dspark":
        d = random_dspark(target, 3)
    else:
        task = dflash.make_task(target, num_layers=1, block_size=3, taps=[1])
        params, buffers = task.init(jax.random.PRNGKey(0), None)
        d = dflash.DFlashDrafter.from_trained(task.arch, noisy(params, 1, 0.3), buffers, target, 3)
    if tree is None:
        return d
    return type(d)(d.arch, d.params, 6, tree_top_k=2, tree_depth=3, **tree)


def make_drafter(name: str, target):
    """One drafter of each registered kind (trained ones with random weights), chains and trees."""
    from drafters import distilled_lm
    from tests.test_eagle3 import make as make_eagle3
    from tests.test_medusa import make as make_medusa

    if name == "ngram":
        return create_drafter("ngram", target, 4, max_ngram=2)
    if name == "suffix":
        return create_drafter("suffix", target, 5)
    if name == "self_spec":
        return create_drafter("self_spec", target, 3, num_layers=1)
    if name == "self_spec_tree":
        return create_drafter("self_spec", target, 6, num_layers=1, tree_top_k=2, tree_depth=3)
    if name == "draft_lm":  # a draft LM equal to the target
        return DraftLMDrafter(target.cfg, target.params, 4, name="draft_lm")
    if name == "distilled_lm":
        task = distilled_lm.make_task(target, num_layers=1, init="random")
        params, _ = task.init(jax.random.PRNGKey(4), None)
        return DraftLMDrafter(task.dcfg, params, 3, name="distilled_lm")
    if name == "eagle3":
        return make_eagle3(target, k=3)[3]
    if name == "eagle3_tree":  # with a reduced draft vocabulary: its draws take the target's noise of their ids
        chain = make_eagle3(target, 64, k=3)[3]
        return Eagle3TreeDrafter(chain.arch, chain.params, 6, top_k=2, depth=3)
    if name == "medusa":
        return make_medusa(target)[2]
    if name == "medusa_tree":
        return make_medusa(target, tree_paths=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])[2]
    if name in ("dflash", "dspark"):
        return block_drafter(target, name)
    if name == "dspark_tree":
        return block_drafter(target, "dspark", {})
    if name == "dspark_dynamic_tree":
        return block_drafter(target, "dspark", {"tree_sampling": "dynamic"})
    if name == "hybrid":
        return HybridDrafter(block_drafter(target, "dspark"), NgramDrafter(3, max_ngram=3), 1)
    raise ValueError(name)


# Trees: a draft LM's dynamic top-k tree (EAGLE-3's is the same growth), Medusa's static tree, and DSpark's two
# sampled trees (DFlash's fixed sampled tree is DSpark's code without the Markov head).
DRAFTERS = ["ngram", "suffix", "self_spec", "self_spec_tree", "draft_lm", "distilled_lm", "eagle3", "medusa",
            "medusa_tree", "dflash", "dspark", "dspark_tree", "dspark_dynamic_tree", "hybrid"]


def test_every_registered_drafter_is_covered():
    covered = {name.removesuffix("_tree").removesuffix("_dynamic") for name in DRAFTERS} | {"prompt_lookup"}  # ngram's alias
    assert set(drafters.available()) <= covered


def adaptive(drafter) -> AdaptiveWidth:
    """The adaptive width with given round costs (nothing timed): one per verify width, rising with it."""
    widths = AdaptiveWidth().verify_widths(drafter.num_draft_tokens, None)
    return AdaptiveWidth(round_costs=tuple(1.0 + 0.12 * w for w in widths), draft_cost=0.05)


def policy_for(drafter) -> str:
    return "invariant_tree" if drafter.kind == "tree" else "invariant_chain"


@pytest.fixture(scope="module")
def target():
    return peaky_target(3)


@pytest.fixture(scope="module")
def ar(target):
    """AR's tokens per (sampling, seed, prompts): the reference every speculative run must equal."""
    cache = {}

    def get(sp, seed, prompts):
        k = (sp, seed, str(prompts))
        if k not in cache:
            cache[k] = generate(target, prompts, NEW_TOKENS, sp, seed=seed).tokens
        return cache[k]
    return get


# Medusa's static tree is left to test_sampled_trees_equal_ar_at_batch_four_and_one, which runs it as this test would
# (invariant_tree, the adaptive width, T = 0.7 with top-p 0.95, batch 4) and at batch 1 too.
@pytest.mark.parametrize("name", [name for name in DRAFTERS if name != "medusa_tree"])
def test_speculative_equals_ar_at_temperature_above_zero(name, target, ar):
    """Batch 4 under the adaptive width (given costs): the same tokens as AR for the same seed, at T = 1 for half
    the drafters and T = 0.7 with top-p 0.95 for the others."""
    drafter = make_drafter(name, target)
    sp = HOT if DRAFTERS.index(name) % 2 else NUCLEUS
    out = speculative_generate(target, drafter, PROMPTS, policy=policy_for(drafter), max_new_tokens=NEW_TOKENS,
                               sampling=sp, seed=11, scheduler=adaptive(drafter))
    assert out.tokens == ar(sp, 11, PROMPTS), name


@pytest.mark.parametrize("name", ["ngram", "suffix", "draft_lm", "dspark", "dspark_tree", "hybrid"])
def test_batch_one_at_fixed_width_equals_ar(name, target, ar):
    """One prompt alone (row 0 of its own list), every drafted node verified: AR's tokens for that list."""
    drafter = make_drafter(name, target)
    for prompt in (PROMPTS[0], PROMPTS[2]):
        out = speculative_generate(target, drafter, [prompt], policy=policy_for(drafter), max_new_tokens=NEW_TOKENS,
                                   sampling=NUCLEUS, seed=5)
        assert out.tokens == ar(NUCLEUS, 5, [prompt]), name


# Sampled trees beside DSpark's: the draft LM's dynamic tree (self-speculation's model), EAGLE-3's dynamic tree and
# Medusa's static tree, each node's children the Gumbel top-k of log q + the noise of their position
TREES = ["self_spec_tree", "eagle3_tree", "medusa_tree"]


@pytest.mark.parametrize("name", TREES)
def test_sampled_trees_equal_ar_at_batch_four_and_one(name, target, ar):
    """invariant_tree at T = 0.7 with top-p 0.95 under the adaptive width (given costs): AR's tokens for the seed,
    for the four prompts together and for one alone, with trees verified (the random EAGLE-3 on its reduced
    vocabulary is never accepted, the others are)."""
    drafter = make_drafter(name, target)
    for prompts in (PROMPTS, PROMPTS[2:3]):
        out = speculative_generate(target, drafter, prompts, policy="invariant_tree", max_new_tokens=NEW_TOKENS,
                                   sampling=NUCLEUS, seed=7, scheduler=adaptive(drafter))
        assert out.tokens == ar(NUCLEUS, 7, prompts), (name, len(prompts))
        assert out.metrics.proposed_draft_tokens > 0, (name, len(prompts))


def judge_first_children(draft, target_logits, sampling, key):
    """invariant_tree on the draft with every node but the first child of its parent dropped: the accepted path
    runs through first children only, so the engine's counts per depth say how often a first child was the
    target's sample there."""
    n = draft.num_nodes
    before = jnp.tril(jnp.ones((n, n), bool), -1)[None]  # [1, i, j]: node j comes before node i
    sibling = (draft.parents[:, :, None] == draft.parents[:, None, :]) & draft.valid[:, None, :]
    later = jnp.any(before & sibling, axis=2)
    return invariant_tree(dataclasses.replace(draft, valid=draft.valid & ~later), target_logits, sampling, key)


FIRST_CHILDREN = Policy("first_children", lossless=True, supports_trees=True, greedy_only=False,
                        impl=judge_first_children)


class _TopKTree(DraftLMTreeDrafter):
    """The uncoupled tree: top-k picks (the argmaxes of q) at every temperature, blind to the target's noise."""

    def propose(self, params, cache, ctx, sampling, key):
        return super().propose(params, cache, ctx, S.GREEDY, key)


def test_a_coupled_tree_drafts_the_targets_sample_as_every_first_child(target, ar):
    """The coupling in a tree: a node's first child is Gumbel-max on log q with the target's noise at its
    position, so for a draft LM equal to the target (q = p) it IS the target's sample. Judged on first children
    alone, every verdict at every depth accepts (T = 1, 6-node trees of top-k 2 and depth 3), and the text is
    AR's. The negative control: the same oracle's top-k tree, whose first child is the argmax of q, misses the
    target's sample at depth 1 in some rounds."""
    def first_children(drafter):
        out = speculative_generate(target, drafter, PROMPTS, policy=FIRST_CHILDREN, max_new_tokens=NEW_TOKENS,
                                   sampling=HOT, seed=2)
        assert out.tokens == ar(HOT, 2, PROMPTS)
        return np.asarray(out.metrics.position_accepted), np.asarray(out.metrics.position_eligible)

    accepted, judged = first_children(DraftLMTreeDrafter(target.cfg, target.params, 6, 2, 3, name="oracle_tree"))
    assert judged[0] > 0 and judged[1] > 0 and (accepted == judged).all(), (accepted, judged)
    accepted, judged = first_children(_TopKTree(target.cfg, target.params, 6, 2, 3, name="oracle_tree"))
    assert accepted[0] < judged[0], (accepted, judged)


def first_proposal(target, drafter, rows: int = 16) -> Draft:
    """The drafter's first proposal after prefill (T = 0.7, top-p 0.95, seed 0) for `rows` copies of the test
    prompts: each row its own noise."""
    from specdec import engine
    from specdec.generate import cache_capacity, pad_prompts

    spec = engine.LoopSpec(cfg=target.cfg, forward=target.forward, drafter=drafter, policy=None, sampling=NUCLEUS,
                           eos_ids=())
    tokens, lengths = pad_prompts((PROMPTS * rows)[:rows], 0)
    capacity = cache_capacity(lengths, 8, extra=drafter.num_draft_tokens + 1)
    state = engine.start(spec, target, drafter, target.init_cache(rows, capacity), tokens, lengths, capacity, 8, 0)
    return engine._jit_propose(spec, drafter.params, state)[0]


def test_tree_first_children_are_the_chains_coupled_draws(target):
    """The draft LM's and EAGLE-3's dynamic trees (EAGLE-3 on a reduced draft vocabulary) draw the root's first
    child, and Medusa's static tree every first child down its spine ([0], [0, 0], [0, 0, 0]), as their chains
    draw their tokens: Gumbel-max on q with the target's noise at the position (a tree drawing at another
    offset, or with the noise of draft ids instead of target ids, fails). Every node is drawn from the q it
    carries (q > 0 at its token, q sums to 1). The control: those tokens are not all the argmax of q (the tree
    at T = 0), so the check sees more than top-k picks."""
    from tests.test_eagle3 import make as make_eagle3
    from tests.test_medusa import make as make_medusa

    spine = [0, 2, 5]  # [0], [0, 0], [0, 0, 0] in medusa_tree's paths
    pairs = ((make_drafter("self_spec", target), make_drafter("self_spec_tree", target), [0]),
             (make_eagle3(target, 64, k=3)[3], make_drafter("eagle3_tree", target), [0]),
             (make_medusa(target)[2], make_drafter("medusa_tree", target), spine))
    for chain, tree, nodes in pairs:
        coupled = np.asarray(first_proposal(target, chain).tokens)[:, : len(nodes)]
        drawn = first_proposal(target, tree)
        tokens, probs, valid = (np.asarray(x) for x in (drawn.tokens, drawn.probs, drawn.valid))
        np.testing.assert_array_equal(tokens[:, nodes], coupled, err_msg=tree.name)
        assert (np.take_along_axis(probs, tokens[..., None], -1)[..., 0][valid] > 0).all(), tree.name
        np.testing.assert_allclose(probs[valid].sum(-1), 1.0, rtol=1e-5)
        assert (probs[:, nodes].argmax(-1) != coupled).any(), tree.name


def test_same_seed_same_tokens_other_seed_other_tokens(target, ar):
    """Run twice: identical tokens. Another seed: other tokens (the check can fail), again equal to AR's."""
    drafter = make_drafter("self_spec", target)
    run = lambda seed: speculative_generate(target, drafter, PROMPTS, policy="invariant_chain",  # noqa: E731
                                            max_new_tokens=NEW_TOKENS, sampling=HOT, seed=seed).tokens
    first = run(3)
    assert run(3) == first == ar(HOT, 3, PROMPTS)
    other = run(4)
    assert other != first and other == ar(HOT, 4, PROMPTS)


def test_a_policy_drawing_one_position_off_fails_the_equality(target, ar):
    """The mutant accepts by the target's sample at the wrong position (offset 0 read as the root's own): a
    different key, still a valid sampler, and the equality test catches it."""
    def off_by_one(draft, logits, sampling, key):
        return invariant_chain(draft, logits, sampling, key.at(key.start - 1))

    mutant = Policy("off_by_one", lossless=False, supports_trees=False, greedy_only=False, impl=off_by_one)
    drafter = make_drafter("draft_lm", target)
    out = speculative_generate(target, drafter, PROMPTS, policy=mutant, max_new_tokens=NEW_TOKENS, sampling=HOT,
                               seed=11)
    assert out.tokens != ar(HOT, 11, PROMPTS)
    honest = dataclasses.replace(mutant, name="honest", impl=invariant_chain)
    assert speculative_generate(target, drafter, PROMPTS, policy=honest, max_new_tokens=NEW_TOKENS, sampling=HOT,
                                seed=11).tokens == ar(HOT, 11, PROMPTS)


def test_a_drafter_equal_to_the_target_is_always_accepted(target):
    """The coupling: a draft LM equal to the target draws its tokens with the target's noise on the same q, so at
    T = 1 invariant_chain accepts every draft (16 = 1 + 3 rounds of 5 tokens: no round is cut short), while a
    one-layer self-speculation drafter is accepted less often but not never."""
    oracle = make_drafter("draft_lm", target)
    out = speculative_generate(target, oracle, PROMPTS, policy="invariant_chain", max_new_tokens=16, sampling=HOT,
                               seed=2)
    m = out.metrics
    assert m.accepted_draft_tokens == m.proposed_draft_tokens > 0, (m.accepted_draft_tokens, m.proposed_draft_tokens)
    weak = speculative_generate(target, make_drafter("self_spec", target), PROMPTS, policy="invariant_chain",
                                max_new_tokens=16, sampling=HOT, seed=2).metrics
    assert 0 < weak.accepted_draft_tokens < weak.proposed_draft_tokens


def test_invariant_policies_at_temperature_zero_are_greedy():
    """At T = 0 the target's sample is the argmax: the invariant policies are the greedy ones."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 5, 9)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 9, (3, 4)), jnp.int32)
    tokens = tokens.at[0].set(jnp.argmax(logits[0, :4], -1))  # row 0 accepts everything
    for invariant, greedy in (("invariant_chain", "greedy_chain"), ("invariant_tree", "greedy_tree")):
        a = get_policy(invariant).verify(Draft.chain(tokens), logits, S.GREEDY, jax.random.key(0))
        b = get_policy(greedy).verify(Draft.chain(tokens), logits, S.GREEDY, jax.random.key(0))
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_cli_generate_with_a_drafter_prints_what_ar_prints(monkeypatch, capsys, target):
    """`specdec generate --seed S --temperature T --top-p P --policy invariant_chain --drafter ...` prints the text
    `specdec generate --seed S --temperature T --top-p P` prints (on the tiny model with the byte codec); a tree
    drafter (suffix) runs the policy's tree counterpart, invariant_tree."""
    import specdec.target
    from experiments import cli
    from specdec.models.tokenizer import ByteCodec

    monkeypatch.setattr(specdec.target, "load_target",
                        lambda *a, **k: dataclasses.replace(target, tokenizer=ByteCodec()))
    common = ["generate", "abcabcabcab", "xyzxyz", "--raw", "--seed", "9", "--temperature", "0.7", "--top-p", "0.95",
              "--max-new-tokens", str(NEW_TOKENS)]

    def text(*extra):  # the printed prompts and continuations; the last line is the metrics
        assert cli.main(common + list(extra)) == 0
        return capsys.readouterr().out.strip().split("\n")[:-1]

    ar = text()
    assert ar[0] == "### abcabcabcab" and len(ar) > 3
    for drafter in ("ngram", "suffix"):
        assert text("--drafter", drafter, "--policy", "invariant_chain", "--scheduler", "fixed") == ar, drafter


def test_configs_accept_the_invariant_policies():
    from specdec.config import load_config
    from specdec.errors import ConfigError

    for name in ("invariant_chain", "invariant_tree"):
        cfg = load_config({"verify": {"policy": name}, "sampling": {"temperature": 0.7, "top_p": 0.95}})
        assert cfg.verify.policy == name and get_policy(name).lossless
    with pytest.raises(ConfigError, match="invariant_chain / invariant_tree"):
        load_config({"verify": {"policy": "greedy_chain"}, "sampling": {"temperature": 0.7}})
