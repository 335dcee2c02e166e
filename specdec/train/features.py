"""Target features for drafter training: the frozen target's hidden-state taps and logits for a batch.

Online (default): inside the jitted training step the target runs the whole batch once, with an empty KV cache
of the sequence length, through the very step function decoding uses (`transformer.forward(..., taps=...)`),
so the drafter trains on exactly the features it will see at inference.

Cached: `build_feature_cache` runs the target once over the data and stores, per token, the taps the drafter
reads plus the last layer's residual stream (tap L) when logits are needed (the logits are recomputed from it
in the step: final norm + lm_head, ~20% of the target's cost). float16 by default. Size per token =
(number of stored taps) x hidden x bytes, e.g. EAGLE-3 on SmolLM2 (taps 2, 15, 27 + 30): 4 x 576 x 2 =
4,608 bytes/token in float16. Layout: `taps.bin` (a raw [total_tokens, n_stored, H] array), `offsets.npy`
(start of each example), `meta.json` (written last: its presence marks a complete cache).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec.models import transformer


class TargetFeatures(NamedTuple):
    taps: jax.Array | None  # [n_taps, B, T, H] residual stream after the requested layers (task order)
    logits: jax.Array | None  # float32 [B, T, V] target logits at every position (None if not requested)


def _stacked(params) -> bool:
    return isinstance(params["layers"], dict)


def online_features(tparams, cfg, forward, tokens: jax.Array, taps: tuple[int, ...], logits: bool) -> TargetFeatures:
    """One target forward over tokens [B, T] from an empty cache (no gradient flows into the target)."""
    b, t = tokens.shape
    cache = transformer.init_cache(cfg, b, t, stacked=_stacked(tparams))
    at = None if logits else jnp.zeros((b, 1), jnp.int32)  # skip the lm_head when logits are not needed
    out = forward(tparams, cfg, cache, tokens, taps=taps, logits_at=at)
    tap_arr = None if not taps else jax.lax.stop_gradient(out.taps)
    return TargetFeatures(tap_arr, jax.lax.stop_gradient(out.logits) if logits else None)


def logits_from_last(tparams, cfg, last: jax.Array) -> jax.Array:
    """Target logits from the (stored) residual stream after the last block: the norm in float32 whatever
    the stored dtype, as the target's step computes it."""
    return transformer.final_logits(tparams, cfg, last.astype(jnp.float32))[1]


def stored_taps(taps: tuple[int, ...], num_layers: int, logits: bool) -> tuple[int, ...]:
    """The layers a cache stores: the task's taps, plus the last layer (for logits) if not among them."""
    return tuple(dict.fromkeys(taps + ((num_layers,) if logits else ())))


def cached_features(tparams, cfg, feats: jax.Array, taps: tuple[int, ...], stored: tuple[int, ...],
                    logits: bool) -> TargetFeatures:
    """TargetFeatures from a cached batch feats [B, T, n_stored, H]."""
    feats = feats.astype(jnp.float32)
    tap_arr = jnp.stack([feats[:, :, stored.index(l)] for l in taps]) if taps else None
    lg = logits_from_last(tparams, cfg, feats[:, :, stored.index(cfg.num_layers)]) if logits else None
    return TargetFeatures(tap_arr, lg)


# ---------------------------------------------------------------------------------------------------------
# Disk cache
# ---------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class FeatureCache:
    path: Path
    meta: dict
    offsets: np.ndarray
    array: np.ndarray  # memmap [total_tokens, n_stored, H]

    @property
    def stored(self) -> tuple[int, ...]:
        return tuple(self.meta["stored_taps"])

    @property
    def bytes_per_token(self) -> int:
        return int(self.meta["bytes_per_token"])

    def batch(self, rows: np.ndarray, lengths: np.ndarray, seq_len: int) -> np.ndarray:
        """Features of examples `rows` (indices into the data the cache was built from), [B, seq_len, n, H]."""
        n, h = self.array.shape[1:]
        out = np.zeros((len(rows), seq_len, n, h), self.array.dtype)
        for i, r in enumerate(rows):
            k = int(lengths[i])
            start = int(self.offsets[r])
            out[i, :k] = self.array[start:start + k]
        return out


def data_fingerprint(tokens: np.ndarray, lengths: np.ndarray) -> str:
    digest = hashlib.sha256(np.ascontiguousarray(tokens).tobytes())
    digest.update(np.ascontiguousarray(lengths).tobytes())
    return digest.hexdigest()[:16]


def open_feature_cache(path: str | os.PathLike, expect: dict[str, Any] | None = None,
                       needed: tuple[int, ...] = ()) -> FeatureCache | None:
    """The cache at `path`, or None if it is absent/incomplete. `expect`: meta values that must match;
    `needed`: layers the cache must hold (it may hold more: `cached_features` picks them by layer)."""
    p = Path(path)
    if not (p / "meta.json").is_file():
        return None
    meta = json.loads((p / "meta.json").read_text())
    for key, value in (expect or {}).items():
        if meta.get(key) != value:
            raise ValueError(f"feature cache {p} was built for {key}={meta.get(key)!r}, this run needs {value!r}; "
                             "delete it or set train.features_dir elsewhere")
    missing = sorted(set(needed) - set(meta["stored_taps"]))
    if missing:
        raise ValueError(f"feature cache {p} holds layers {meta['stored_taps']}, this run also needs {missing}; "
                         "delete it or set train.features_dir elsewhere")
    offsets = np.load(p / "offsets.npy")
    array = np.memmap(p / "taps.bin", dtype=meta["dtype"], mode="r",
                      shape=(meta["num_tokens"], len(meta["stored_taps"]), meta["hidden_size"]))
    return FeatureCache(p, meta, offsets, array)


def find_feature_cache(root: str | os.PathLike, expect: dict[str, Any], needed: tuple[int, ...]) -> FeatureCache | None:
    """A finished cache under `root` (one folder per cache) whose meta matches `expect` and that holds every layer
    of `needed`; the one storing the fewest layers (the least to read per token) if several do."""
    found = []
    for meta_path in sorted(Path(root).glob("*/meta.json")):
        meta = json.loads(meta_path.read_text())
        if all(meta.get(k) == v for k, v in expect.items()) and set(needed) <= set(meta["stored_taps"]):
            found.append((len(meta["stored_taps"]), str(meta_path.parent)))
    return open_feature_cache(min(found)[1], expect, needed) if found else None


def build_feature_cache(target, arrays: dict[str, np.ndarray], taps: tuple[int, ...], logits: bool,
                        path: str | os.PathLike, *, dtype: str = "float16", batch_size: int = 8,
                        progress: bool = True) -> FeatureCache:
    """Run the target over every example of `arrays` (from `DistillData.padded`) and store its taps."""
    from tqdm.auto import tqdm

    p = Path(path)
    cfg = target.cfg
    stored = stored_taps(taps, cfg.num_layers, logits)
    tokens, lengths = arrays["tokens"], arrays["lengths"]
    n, seq_len = tokens.shape
    offsets = np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64)
    total = int(lengths.sum())
    p.mkdir(parents=True, exist_ok=True)
    (p / "meta.json").unlink(missing_ok=True)
    out = np.memmap(p / "taps.bin", dtype=dtype, mode="w+", shape=(max(total, 1), len(stored), cfg.hidden_size))

    @jax.jit
    def run(tparams, toks):
        f = online_features(tparams, cfg, target.forward, toks, stored, False)
        return jnp.moveaxis(f.taps, 0, 2)  # [B, T, n, H]

    # Batches of similar length, cut to their longest row rounded up to 64 tokens (a few compiled widths): the
    # target is causal and the padding trails each row, so a row's features do not depend on the cut, and the
    # forward runs on real tokens instead of seq_len (examples average well under it).
    by_length = np.argsort(lengths, kind="stable")
    bar = tqdm(total=n, desc="target features", unit="example", disable=not progress, dynamic_ncols=True)
    for start in range(0, n, batch_size):
        rows = by_length[start:start + batch_size]
        width = min(seq_len, -(-int(lengths[rows].max()) // 64) * 64)
        toks = tokens[np.concatenate([rows, np.full(batch_size - len(rows), rows[-1])]), :width]
        feats = np.asarray(run(target.params, jnp.asarray(toks))).astype(dtype)
        for i, r in enumerate(rows):
            out[offsets[r]:offsets[r] + lengths[r]] = feats[i, :lengths[r]]
        bar.update(len(rows))
    bar.close()
    out.flush()
    del out
    np.save(p / "offsets.npy", offsets)
    meta = {"stored_taps": list(stored), "dtype": dtype, "hidden_size": cfg.hidden_size, "num_tokens": max(total, 1),
            "num_examples": n, "seq_len": seq_len, "target": cfg.name, "data": data_fingerprint(tokens, lengths),
            "bytes_per_token": len(stored) * cfg.hidden_size * np.dtype(dtype).itemsize}
    (p / "meta.json").write_text(json.dumps(meta, indent=2))
    return open_feature_cache(p)
