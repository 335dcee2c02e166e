"""Tokenizer and chat template, built from the checkpoint itself.

GGUF checkpoints carry `tokenizer.ggml.*` (vocabulary, merges, token types, special ids, chat template);
Hugging Face directories carry tokenizer.json and tokenizer_config.json. Either way the result is a
`tokenizers.Tokenizer` plus the Jinja chat template, rendered the way transformers renders it
(`transformers.utils.chat_template_utils`): a sandboxed Jinja environment with trim_blocks, lstrip_blocks and
loop controls; its extras `raise_exception(msg)`, `strftime_now(fmt)`, a `tojson` that does not HTML-escape
and takes indent / separators / sort_keys / ensure_ascii, and the `{% generation %}` block; the variables
`messages` (keys holding None dropped), `tools`, `documents`, `add_generation_prompt`, the special tokens
that are set (`bos_token`, `eos_token`, `unk_token`, `pad_token`) and any extra keyword (e.g. `date_string`).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from specdec.models.registry import UnsupportedModelError

TOKEN_TYPE_CONTROL = 3  # GGUF token_type for special (control) tokens


GGUF_PRE_TOKENIZERS = {
    # SmolLM2 ("smollm"): digits split individually, then GPT-2 byte-level with its regex.
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]),
    # plain GPT-2 byte-level BPE
    "default": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
}


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: Jinja's own escapes <, >, & and ' for HTML (wrong in a prompt) and takes only indent
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with it (for training
    masks); rendering, it is its body, in a scope of its own as transformers' call block is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """A chat template compiled in transformers' environment (the sandbox: templates are untrusted code)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, *, bos_token: str | None, eos_token: str | None,
                 pad_token: str | None, chat_template: str | None, extra_eos: Sequence[str] = (),
                 unk_token: str | None = None):
        self.backend = tokenizer
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.chat_template = chat_template
        self.bos_token_id = self._id(bos_token)
        self.pad_token_id = self._id(pad_token)
        eos = [self._id(t) for t in (eos_token, *extra_eos)]
        self.eos_token_ids = tuple(dict.fromkeys(i for i in eos if i is not None))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) become their ids."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids if int(i) >= 0], skip_special_tokens=skip_special_tokens)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The special tokens that are set, by transformers' names (what a chat template sees)."""
        tokens = {"bos_token": self.bos_token, "eos_token": self.eos_token, "unk_token": self.unk_token,
                  "pad_token": self.pad_token}
        return {name: token for name, token in tokens.items() if token is not None}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            **template_vars) -> str:
        """`messages` ([{"role", "content"}, ...]) rendered as transformers' `tokenizer.apply_chat_template(
        messages, tokenize=False, ...)` renders them; `template_vars` (e.g. date_string="26 Jul 2024") reach the
        template as variables, overriding the special tokens as in transformers."""
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat template; pass raw text instead of messages")
        if not messages:
            raise ValueError("cannot apply the chat template to an empty conversation")
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise TypeError(f"chat message {i} is a {type(m).__name__}, not a dict with 'role' and 'content'")
        # transformers drops keys holding None (an API's content=None), which templates would print as "None"
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return compile_chat_template(self.chat_template).render(
            messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **template_vars})

    def encode_messages(self, messages: list[dict], **template_vars) -> list[int]:
        """Token ids of a conversation rendered with the chat template, ending in the assistant's prompt."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True, **template_vars))

    def encode_chat(self, user_message: str, system: str | None = None) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + \
                   [{"role": "user", "content": user_message}]
        return self.encode_messages(messages)

    # ------------------------------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        def field(key, default=None):
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        model = field("tokenizer.ggml.model")
        if model != "gpt2":
            raise UnsupportedModelError(
                f"GGUF tokenizer model {model!r} is not supported (supported: gpt2-style byte-level BPE)")
        tokens = field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
        types = field("tokenizer.ggml.token_type", [1] * len(tokens))
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pre = field("tokenizer.ggml.pre", "default")
        if pre not in GGUF_PRE_TOKENIZERS:
            # A wrong pre-tokenizer silently changes token ids, so refuse rather than guess.
            raise UnsupportedModelError(
                f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(GGUF_PRE_TOKENIZERS)}); "
                "load the model from a Hugging Face directory with tokenizer.json instead")
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
        backend.decoder = decoders.ByteLevel()
        special = [tok for tok, kind in zip(tokens, types) if kind == TOKEN_TYPE_CONTROL]
        backend.add_special_tokens(special)

        def token(key):
            idx = field(key)
            return None if idx is None else tokens[int(idx)]

        return cls(backend, bos_token=token("tokenizer.ggml.bos_token_id"),
                   eos_token=token("tokenizer.ggml.eos_token_id"), pad_token=token("tokenizer.ggml.padding_token_id"),
                   unk_token=token("tokenizer.ggml.unknown_token_id"), chat_template=field("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: Path) -> "Tokenizer":
        tok_file = Path(path) / "tokenizer.json"
        if not tok_file.is_file():
            raise UnsupportedModelError(f"{path}: no tokenizer.json (specdec builds the tokenizer from it)")
        backend = HFTokenizer.from_file(str(tok_file))
        cfg_file = Path(path) / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}

        def name(value):
            return value.get("content") if isinstance(value, dict) else value

        template = cfg.get("chat_template")
        jinja_file = Path(path) / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(backend, bos_token=name(cfg.get("bos_token")), eos_token=name(cfg.get("eos_token")),
                   pad_token=name(cfg.get("pad_token")), unk_token=name(cfg.get("unk_token")), chat_template=template)


# ----------------------------------------------------------------------------------------------------------
# Models without a tokenizer (random test models): one token per UTF-8 byte
# ----------------------------------------------------------------------------------------------------------

def plain_conversation(messages: Sequence[dict]) -> str:
    """A conversation as plain text, for models without a chat template: the turns' texts, blank-line separated."""
    return "\n\n".join(m["content"] for m in messages)


class ByteCodec:
    """Text <-> token ids for models without a tokenizer: one token per UTF-8 byte."""

    chat_template = None
    specials = (0, 1, 2)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_messages(self, messages: Sequence[dict], chat: bool = False) -> list[int]:
        return self.encode(plain_conversation(messages))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 2 < int(i) < 256).decode("utf-8", errors="replace")
