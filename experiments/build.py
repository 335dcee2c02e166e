"""From config sections to live objects: the target, its text codec, the drafter and the policy name.

`model.name: tiny` is the random two-layer test model (`specdec.models.config.tiny_config`, vocabulary 256),
which has no tokenizer; `ByteCodec` (specdec/models/tokenizer.py) gives it a deterministic byte-level one: token
id = UTF-8 byte value.
Ids 0-2 double as the tiny model's special tokens (unk, bos, eos); those control bytes never occur in text
and are dropped when decoding. No chat template.

A conversation (`Prompt.messages`) is chat-templated when the codec has a template and `chat` is on; otherwise
it is its turns' texts joined by blank lines (`plain_conversation`), a single user turn being just its text.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from specdec import sharding
from specdec.config import ExperimentConfig, MeshConfig, TargetConfig, VerifyConfig
from specdec.models.tokenizer import ByteCodec, plain_conversation
from specdec.target import Target
from specdec.verify import Policy, get_policy

TINY_NAMES = ("tiny",)


class TokenizerCodec:
    """Text <-> token ids through the model's tokenizer; `chat=True` applies its chat template."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if chat and self.tokenizer.chat_template:
            return self.tokenizer.encode_chat(text)
        return self.tokenizer.encode(text)

    def encode_messages(self, messages: Sequence[dict], chat: bool = False) -> list[int]:
        if chat and self.tokenizer.chat_template:
            return self.tokenizer.encode_messages(list(messages))
        return self.tokenizer.encode(plain_conversation(messages))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)


def encode_prompt(codec, prompt, chat: bool) -> list[int]:
    """A prompt's token ids: its conversation (`prompt.messages`) when it has one, else its text as one turn."""
    if prompt.messages is None:
        return codec.encode(prompt.text, chat=chat)
    return codec.encode_messages(prompt.messages, chat=chat)


def codec_for(target: Target):
    return TokenizerCodec(target.tokenizer) if target.tokenizer is not None else ByteCodec()


@functools.lru_cache(maxsize=2)
def _cached_target(name: str, dtype: str, backend: str, seed: int) -> Target:
    if name in TINY_NAMES:  # peaky random logits, so greedy text repeats and lookup drafters get accepted
        from specdec.testing import peaky_target

        return peaky_target(seed, backend, dtype=dtype)
    from specdec.target import load_target

    return load_target(name, backend=backend, dtype=dtype)


def build_target(cfg: TargetConfig, mesh: MeshConfig | None = None) -> Target:
    """The target of `model:`; loaded once per process for the same (name, dtype, backend, seed) (sweeps).
    With a multi-device `mesh:` its weights are placed on that mesh, tensor-parallel (specdec/sharding.py)."""
    key = (cfg.name, cfg.dtype, cfg.backend, cfg.seed if cfg.name in TINY_NAMES else 0)
    if mesh is None or not sharding.is_multi_device(mesh):
        return _cached_target(*key)
    return _sharded_target(key, mesh.data, mesh.model)


@functools.lru_cache(maxsize=2)
def _sharded_target(key: tuple, data: int, model: int) -> Target:
    mesh = sharding.make_mesh(MeshConfig(data=data, model=model))  # first: multi-host init precedes any JAX work
    return sharding.shard_target(_cached_target(*key), mesh)


def drafter_params(cfg: ExperimentConfig, accepted: Sequence[str]) -> dict:
    """`drafter.params`, plus the tree shape of `verify.tree` mapped onto the drafter's own parameters."""
    params = dict(cfg.drafter.params)
    tree = cfg.verify.tree
    if tree is None:
        return params
    name = cfg.drafter.name
    if tree.dynamic is not None:
        if not {"tree_top_k", "tree_depth"} <= set(accepted):
            raise ValueError(f"verify.tree.dynamic: drafter {name!r} does not grow dynamic trees (it has no "
                             f"tree_top_k/tree_depth parameters); drafters that do: self_spec, draft_lm")
        for key, value in (("tree_top_k", tree.dynamic.top_k), ("tree_depth", tree.dynamic.depth)):
            if key in params and params[key] != value:
                raise ValueError(f"drafter.params.{key}={params[key]} contradicts verify.tree.dynamic ({value})")
            params[key] = value
    else:
        key = next((k for k in ("tree_paths", "paths", "tree") if k in accepted), None)
        if key is None:
            raise ValueError(f"verify.tree.paths: drafter {name!r} does not take a static tree shape "
                             f"(its parameters: {', '.join(accepted) or 'none'})")
        params[key] = [list(p) for p in tree.paths]
    return params


def num_draft_tokens(cfg: ExperimentConfig) -> int:
    """The node budget: `verify.tree.dynamic.num_nodes` for a dynamic tree, else `drafter.num_draft_tokens`."""
    tree = cfg.verify.tree
    return tree.dynamic.num_nodes if tree is not None and tree.dynamic is not None else cfg.drafter.num_draft_tokens


def build_drafter(cfg: ExperimentConfig, target: Target):
    """(drafter, the parameters it was built with)."""
    import drafters
    from drafters import create_drafter

    drafters._load_all()
    if cfg.drafter.name == drafters.AUTO:  # the kind a trained drafter directory records
        if cfg.drafter.path is None:
            raise ValueError("drafter.name: 'auto' reads the drafter kind from drafter.path; set drafter.path")
        from specdec.train.checkpoint import drafter_kind

        cfg = dataclasses.replace(cfg, drafter=dataclasses.replace(cfg.drafter, name=drafter_kind(cfg.drafter.path)))
    if cfg.drafter.name not in drafters._FACTORIES:
        raise ValueError(f"drafter.name: unknown drafter {cfg.drafter.name!r}; available: "
                         f"{', '.join(drafters.available())}")
    accepted = drafters.parameters(cfg.drafter.name)
    params = drafter_params(cfg, accepted)
    if cfg.drafter.path is not None:
        if "path" not in accepted and "checkpoint" not in accepted:
            raise ValueError(f"drafter.path: drafter {cfg.drafter.name!r} takes no checkpoint (drafter.name=auto "
                             "reads the kind from the checkpoint)")
        params["path" if "path" in accepted else "checkpoint"] = cfg.drafter.path
    drafter = create_drafter(cfg.drafter.name, target, num_draft_tokens(cfg), **params)
    if sharding.mesh_of(target) is not None and drafter.params is not None:  # next to the target, on its mesh
        drafter.params = sharding.place_drafter_state(drafter.params, sharding.mesh_of(target))
    return drafter, params


def effective_policy(verify: VerifyConfig, drafter) -> tuple[Policy, str | None]:
    """The policy to run, with the options of `verify:` it takes (typical: eps, delta), and a note when it
    differs from the config: a chain policy on a tree drafter runs as its tree counterpart (greedy_chain ->
    greedy_tree, rejection_chain -> multidraft_tree; same rule)."""
    name, note = verify.policy, None
    counterpart = get_policy(name).tree_counterpart
    if drafter.kind == "tree" and counterpart is not None:
        name, note = counterpart, f"{name} on the tree drafter {drafter.name!r} runs as {counterpart}"
    policy = get_policy(name)
    config_options = {"epsilon": verify.eps, "delta": verify.delta}  # the policy option each `verify:` key sets
    return policy.with_options(**{k: v for k, v in config_options.items() if k in dict(policy.options)}), note


def drafter_label(drafter, params: dict) -> str:
    """A short, stable name for tables: ngram(k=5), suffix(k=8,max_depth=8), self_spec(k=4,num_layers=24)."""
    extra = ",".join(f"{k}={v}" for k, v in sorted(params.items()))
    return f"{drafter.name}(k={drafter.num_draft_tokens}{',' + extra if extra else ''})"


def build_scheduler(cfg: ExperimentConfig, target: Target, drafter, log=print):
    """The verify-width scheduler of `scheduler:` (the section parses straight into it, specdec/scheduler.py).
    What it must measure on this machine (the adaptive width's round costs, the prefix scheduler's SPS profile)
    it measures when the engine first runs it, cached in the specdec cache dir."""
    if cfg.scheduler.needs_confidence and not drafter.has_confidence:
        raise ValueError(f"scheduler.kind: {cfg.scheduler.kind!r} needs a drafter with draft confidences "
                         f"(dflash, dspark); {drafter.name!r} has none; use 'fixed' or 'adaptive'")
    return cfg.scheduler


def check_supported(cfg: ExperimentConfig) -> None:
    """Config values the runner cannot honour yet are errors, not silently ignored."""
    if cfg.generation.batch_size % cfg.mesh.data:
        raise ValueError(f"generation.batch_size={cfg.generation.batch_size} is not divisible by mesh.data="
                         f"{cfg.mesh.data}: data parallelism gives every data shard the same number of rows")
