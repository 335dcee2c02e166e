"""Top-p: the nucleus found from the top-K prefix (or the bisection fallback) is exactly the sorted definition."""

import jax.numpy as jnp
import numpy as np
import pytest

from specdec.sampling import TOP_P_PREFIX, SamplingParams, processed_logits, top_p_threshold


def nucleus_reference(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Kept mask [B, V] by the textbook rule in float64: sort descending, keep while the mass before < top_p."""
    keep = np.zeros(logits.shape, bool)
    for b, row in enumerate(logits.astype(np.float64)):
        probs = np.exp(row - row.max())
        probs /= probs.sum()
        order = np.argsort(-row, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        threshold = row[order][before < top_p].min()
        keep[b] = row >= threshold
    return keep


@pytest.mark.parametrize("scale,what", [(8.0, "peaky rows: the prefix holds the nucleus"),
                                        (0.05, "near-uniform rows: the bisection fallback"),
                                        (None, "a batch mixing both")])
def test_top_p_matches_the_sorted_definition(scale, what):
    rng = np.random.default_rng(0)
    vocab = 4 * TOP_P_PREFIX
    scales = np.array([8.0, 0.05, 3.0, 0.5]) if scale is None else np.full(4, scale)
    logits = (rng.standard_normal((4, vocab)) * scales[:, None]).astype(np.float32)
    for top_p in (0.5, 0.9, 0.95):
        kept = np.asarray(top_p_threshold(jnp.asarray(logits), top_p)) <= logits
        np.testing.assert_array_equal(kept, nucleus_reference(logits, top_p), err_msg=f"{what}, top_p={top_p}")


@pytest.mark.parametrize("flat_row", [False, True], ids=["prefix", "bisection"])
def test_top_p_keeps_ties_and_at_least_one_token(flat_row):
    logits = np.full((3, 2 * TOP_P_PREFIX), -5.0, np.float32)
    logits[0, :3] = 10.0  # three tied leaders: all kept, the rest dropped
    logits[1, 7] = 30.0  # one token holds ~all the mass: it alone is kept even for top_p close to 1
    logits[0, 3:] = -20.0  # (so that the top 256 of row 0 hold the nucleus)
    if flat_row:  # a row of equal logits (with a masked-out tail) sends the batch to the bisection
        logits[2, :] = 1.0
        logits[2, -10:] = -np.inf
    else:
        logits[2, 0] = 40.0
    out = np.asarray(processed_logits(jnp.asarray(logits), SamplingParams(temperature=1.0, top_p=0.999)))
    assert np.isfinite(out[0]).sum() == 3 and np.isfinite(out[0, :3]).all()
    assert np.isfinite(out[1]).sum() == 1 and np.isfinite(out[1, 7])
    if flat_row:  # ties: every finite entry stays
        np.testing.assert_array_equal(np.isfinite(out[2]), np.isfinite(logits[2]))


def test_top_p_after_top_k_masking():
    """-inf entries (dropped by top-k first) carry no mass and never enter the nucleus."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 3 * TOP_P_PREFIX)).astype(np.float32)
    sp = SamplingParams(temperature=0.7, top_k=20, top_p=0.8)
    out = np.asarray(processed_logits(jnp.asarray(logits), sp))
    scaled = logits / 0.7
    kth = np.sort(scaled, axis=-1)[:, -20][:, None]
    topk = np.where(scaled < kth, -np.inf, scaled)
    np.testing.assert_array_equal(np.isfinite(out), nucleus_reference(topk, 0.8) & np.isfinite(topk))
