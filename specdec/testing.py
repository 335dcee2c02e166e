"""Helpers the test suite shares (and a new drafter's own tests can use), in one importable place.

- `peaky_target`: the tiny random two-layer model with peaky logits (weights at scale 0.35): greedy text
  repeats, so lookup drafters get accepted, and there are no near-ties between logits; `model.name: tiny` in
  experiment configs is this model.
- Exact enumeration of the engine's output law: `distribution_target` (vocabulary 8), `exact_joint` (every
  sequence of LENGTH tokens it can sample under SAMPLING, with its probability), `sampled_joint` (NUM_SAMPLES
  rows through `speculative_generate`), `assert_lossless` / `assert_biased` (chi-square and total variation
  against the exact law, and the negative controls' check).
- A drafter's tokens against the q it returns: `draft_fit`, `assert_draft_matches_its_q`.
- An exported drafter with one field or tensor edited (the import-refusal tests): `edited_export`.
- Checks that must run in a fresh process (another device count, W&B's threads, a very large compile):
  `child_result` runs `python -m <module> [args]` and returns the JSON it printed after "RESULT ".
- Text for the tokenizer-less tiny model: `specdec.models.tokenizer.ByteCodec` (one token per UTF-8 byte) is
  the one byte codec; experiments and the data builder use it too, so tests import it from there.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from specdec import engine
from specdec.engine import speculative_generate
from specdec.drafter import PromptInfo
from specdec.generate import cache_capacity, pad_prompts, prefill
from specdec.models.config import tiny_config
from specdec.sampling import SamplingParams, probabilities
from specdec.target import Target, random_target

PEAKY_SCALE = 0.35  # random weights at this scale give peaky logits (see the module docstring)

# Prompts the engine tests decode: repetitive ones (lookup drafters find proposals), a short one, one token.
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12], [20, 21, 20, 21, 20, 21, 20, 21, 20, 21, 20], [3]]


def peaky_target(seed: int = 0, backend: str = "reference", **cfg) -> Target:
    """The tiny test model (`specdec.models.config.tiny_config(**cfg)`) with peaky random weights."""
    return random_target(tiny_config(**cfg), seed=seed, backend=backend, scale=PEAKY_SCALE)


# ---------------------------------------------------------------------------------------------------------
# Distributional losslessness through the whole engine
# ---------------------------------------------------------------------------------------------------------

VOCAB = 8
# Temperature, top-k and top-p all active: top-k cuts every step to 3 tokens, top-p one step in two further.
SAMPLING = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)
LENGTH = 9  # tokens per sample: the prefill token, then ~4.3 rounds per row with the 2-token chain below
NUM_SAMPLES = 6000
PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 3, 1, 4]  # every token occurs earlier, so lookup always has a proposal
P_VALUE_MIN = 1e-3


def distribution_target():
    return random_target(tiny_config(vocab_size=VOCAB, eos_token_ids=(), pad_token_id=0), seed=2, scale=0.25)


@functools.lru_cache(maxsize=None)
def exact_joint(length: int = LENGTH) -> tuple[np.ndarray, np.ndarray]:
    """Every sequence of `length` generated tokens with positive probability under `distribution_target` with
    SAMPLING, and its probability: (seqs [S, length], probs [S]), by expanding the support level by level."""
    target = distribution_target()
    last = jax.jit(lambda params, t: target.forward(params, target.cfg, target.init_cache(t.shape[0], 32),
                                                    t).logits[:, -1])
    seqs, probs = np.zeros((1, 0), np.int32), np.ones(1)
    for _ in range(length):
        tokens = np.concatenate([np.tile(PROMPT, (len(seqs), 1)), seqs], axis=1)
        p = np.asarray(probabilities(last(target.params, jnp.asarray(tokens)), SAMPLING), np.float64)
        row, token = np.nonzero(p > 0)
        seqs = np.concatenate([seqs[row], token[:, None].astype(np.int32)], axis=1)
        probs = probs[row] * p[row, token]
    return seqs, probs


def sampled_joint(target, drafter, policy, num_samples=NUM_SAMPLES, **options):
    """(counts over exact_joint()'s sequences, samples outside its support, metrics) of NUM_SAMPLES rows
    decoded in one call (`options`: e.g. a scheduler)."""
    out = speculative_generate(target, drafter, [PROMPT] * num_samples, policy=policy, max_new_tokens=LENGTH,
                               sampling=SAMPLING, seed=123, **options)
    seqs, _ = exact_joint()
    index = {tuple(q): i for i, q in enumerate(seqs.tolist())}
    found = np.array([index.get(tuple(t), -1) for t in out.tokens])
    return np.bincount(found[found >= 0], minlength=len(seqs)), int(np.sum(found < 0)), out.metrics


def fit(counts: np.ndarray, exact: np.ndarray) -> tuple[float, float]:
    """(chi-square p-value with sparse cells pooled, total variation distance)."""
    expected = exact * counts.sum()
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    p_value = float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)
    return p_value, 0.5 * float(np.abs(counts / counts.sum() - exact).sum())


@functools.lru_cache(maxsize=None)
def tv_bound(num_samples: int = NUM_SAMPLES) -> float:
    """The total variation an exact sampler stays under: mean + 6 sd of the TV between exact_joint() and
    `num_samples` multinomial draws from it (300 simulations; ~0.12 + 6 x 0.004 at 6000 samples). Most of
    the TV a correct sampler shows is this sampling noise over ~1700 outcomes."""
    _, probs = exact_joint()
    draws = np.random.default_rng(0).multinomial(num_samples, probs, size=300) / num_samples
    tv = 0.5 * np.abs(draws - probs).sum(axis=1)
    return float(tv.mean() + 6 * tv.std())


def assert_lossless(counts, impossible, metrics, num_samples=NUM_SAMPLES):
    """The engine's output law equals the target's: no impossible sequence, chi-square p > 1e-3 (fixed seeds,
    so deterministic), TV under `tv_bound`; and the test really exercised speculation (>= 4 rounds per row
    on average, drafts accepted)."""
    p_value, tv = fit(counts, exact_joint()[1])
    assert impossible == 0, f"{impossible} samples the target gives probability 0"
    assert p_value > P_VALUE_MIN and tv < tv_bound(num_samples), (p_value, tv, tv_bound(num_samples))
    assert metrics.rounds >= 4 * num_samples, metrics.rounds
    assert metrics.accepted_draft_tokens > 0.5 * num_samples


def assert_biased(counts, impossible):
    """A negative control: the same check must reject the output law (p < 1e-6, or an impossible sequence)."""
    p_value, tv = fit(counts, exact_joint()[1])
    assert impossible > 0 or p_value < 1e-6, f"the check failed to see a bias: p = {p_value:.2e}, TV = {tv:.4f}"


# ---------------------------------------------------------------------------------------------------------
# Drafters sample from the q they return
# ---------------------------------------------------------------------------------------------------------

DRAFT_SAMPLING = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)
DRAFT_ROWS = 4000


def draft_fit(target, drafter, sampling=DRAFT_SAMPLING, rows=DRAFT_ROWS, prompt=PROMPTS[0]):
    """One proposal for `rows` copies of one prompt (the engine's prefill, drafter init and propose): rows are
    independent draws, so at each draft position j the rows sharing the root (the first token, sampled from the
    prefill) and the drafted prefix x_<j share q_j, and
    their x_j must be distributed as that q_j. Returns (chi-square p-value pooled over every (j, prefix)
    group with >= 50 rows, the largest TV over positions j between the frequencies of x_j and the rows' mean
    q_j, drafted tokens with q_j = 0, rows whose q_j differs from their group's)."""
    spec = engine.LoopSpec(cfg=target.cfg, forward=target.forward, drafter=drafter, policy=None, sampling=sampling,
                           eos_ids=())
    tokens, lengths = pad_prompts([prompt] * rows, 0)
    capacity = cache_capacity(lengths, 8, extra=drafter.num_draft_tokens + 1)
    state = engine.start(spec, target, drafter, target.init_cache(rows, capacity), tokens, lengths, capacity, 8, 0)
    draft, _ = engine._jit_propose(spec, drafter.params, state)
    x, q = np.asarray(draft.tokens), np.asarray(draft.probs, np.float64)
    assert np.asarray(draft.valid).all() and np.allclose(q.sum(-1), 1, atol=1e-4)
    impossible = int(np.sum(np.take_along_axis(q, x[..., None], -1) == 0))
    root = np.asarray(state.seq)[np.arange(rows), np.asarray(state.seq_len) - 1]  # sampled from prefill: varies
    context = np.concatenate([root[:, None], x], axis=1)
    stat, dof, worst_tv, inconsistent = 0.0, 0, 0.0, 0
    for j in range(x.shape[1]):
        groups: dict[bytes, list[int]] = {}
        for b, prefix in enumerate(context[:, : j + 1]):
            groups.setdefault(prefix.tobytes(), []).append(b)
        for members in groups.values():
            qj = q[members[0], j]
            inconsistent += int(np.sum(~np.isclose(q[members, j], qj, atol=1e-5).all(-1)))
            if len(members) < 50:
                continue
            counts = np.bincount(x[members, j], minlength=len(qj))
            support = qj > 0
            expected = len(members) * qj[support]
            stat += float(np.sum((counts[support] - expected) ** 2 / expected))
            dof += int(support.sum()) - 1
        # all rows: the frequencies of x_j against the mixture of the rows' q_j
        freq = np.bincount(x[:, j], minlength=q.shape[-1]) / rows
        worst_tv = max(worst_tv, 0.5 * float(np.abs(freq - q[:, j].mean(0)).sum()))
    return float(stats.chi2.sf(stat, max(dof, 1))), worst_tv, impossible, inconsistent


def assert_draft_matches_its_q(target, drafter, **options):
    """A drafter's returned q is the law its tokens were drawn from (at T=0.7 with top-k and top-p): a q that
    is not what it sampled from would silently break rejection sampling. TV < 0.04 per position (the noise
    of 4000 rows over the ~10-30 tokens a position's mixture covers is ~0.01-0.02)."""
    p_value, tv, impossible, inconsistent = draft_fit(target, drafter, **options)
    assert impossible == 0 and inconsistent == 0, (impossible, inconsistent)
    assert p_value > P_VALUE_MIN and tv < 0.04, (p_value, tv)


def prefill_for_drafter(target, drafter, rows, width: int = 16, capacity: int = 64, state_capacity: int = 48):
    """A drafter's first round, set up as the engine does it: the prompts `rows` (padded with 2 to `width`)
    prefilled with every layer's hidden states, the roots (greedy), and the drafter's state from `init`.
    Returns (tokens [B, width], lengths [B], roots [B], drafter state, hidden states [L+1, B, width, H]) for
    tests that compare a drafter with a re-implementation of it (the export parity tests)."""
    tokens = np.full((len(rows), width), 2, np.int32)
    for i, p in enumerate(rows):
        tokens[i, : len(p)] = p
    lengths = jnp.asarray([len(p) for p in rows], jnp.int32)
    every = tuple(range(target.cfg.num_layers + 1))
    logits, taps, _ = prefill(target.params, target.init_cache(len(rows), capacity), jnp.asarray(tokens), lengths,
                              forward=target.forward, cfg=target.cfg, taps=every)
    root = np.asarray(jnp.argmax(logits, -1))
    return tokens, lengths, root, drafter_state(drafter, tokens, lengths, root, taps, state_capacity), taps


def drafter_state(drafter, tokens, lengths, roots, taps, capacity: int = 48):
    """The drafter's state from `init` after the target's prefill of `tokens` [B, T] (`lengths` [B]; `roots` [B]:
    the token the target chose after each row), given the target's hidden states `taps`, indexable by layer
    ([L+1, B, T, H], or {layer: [B, T, H]} holding at least the drafter's taps)."""
    mine = jnp.stack([taps[t] for t in drafter.taps])  # the taps the drafter asks for, in its own order
    prompt = PromptInfo(jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32), mine, jnp.asarray(roots, jnp.int32))
    return jax.jit(drafter.init, static_argnums=2)(drafter.params, prompt, capacity)


def edited_export(src, dst, edit_config=None, edit_tensors=None):
    """A copy of the export directory `src` (config.json + model.safetensors) at `dst`, with `edit_config(config
    dict)` and `edit_tensors(name -> array dict)` applied in place first. Returns `dst`."""
    import json

    from safetensors.numpy import load_file, save_file

    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    if edit_config:
        edit_config(config)
    if edit_tensors:
        edit_tensors(tensors)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


# ---------------------------------------------------------------------------------------------------------
# Checks run in a child process
# ---------------------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def child_result(module: str, *args: str, env: dict | None = None, timeout: float = 600):
    """Run `python -m module args...` from the repo root (with `env` added to this process's environment) and
    return the JSON value of its last stdout line starting "RESULT "; AssertionError with the child's exit
    status and stderr when it printed none (it crashed, or timed out)."""
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise AssertionError(f"{module} produced no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])
