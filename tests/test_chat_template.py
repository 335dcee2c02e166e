"""Chat templates rendered as transformers renders them: one small template per feature of transformers'
environment (its `tojson`, `strftime_now`, `raise_exception`, loop controls, trim_blocks / lstrip_blocks, the
`{% generation %}` block and the variables it passes), and a Llama-3.1-style template. Each rendering is checked
against a written-out expected string and, where transformers is installed (the parity extra), against
transformers' own `apply_chat_template(..., tokenize=False)` string for string."""

from __future__ import annotations

from datetime import datetime

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from specdec.models.tokenizer import Tokenizer

SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def backend() -> HFTokenizer:
    tok = HFTokenizer(models.WordLevel(vocab={"<unk>": 0, "<|begin_of_text|>": 1, "<|eot_id|>": 2}, unk_token="<unk>"))
    tok.add_special_tokens(["<|begin_of_text|>", "<|eot_id|>"])
    return tok


def render(template: str, messages: list[dict], *, add_generation_prompt: bool = True, specials=None,
           **kwargs) -> str:
    """Ours, after checking it equals transformers' rendering when transformers is importable."""
    specials = SPECIALS if specials is None else specials
    ours = Tokenizer(backend(), bos_token=specials.get("bos_token"), eos_token=specials.get("eos_token"),
                     pad_token=specials.get("pad_token"), chat_template=template).apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, **kwargs)
    theirs = transformers_render(template, messages, add_generation_prompt=add_generation_prompt, specials=specials,
                                 **kwargs)
    if theirs is not None:
        assert ours == theirs, f"specdec:\n{ours!r}\ntransformers:\n{theirs!r}"
    return ours


def transformers_render(template, messages, *, add_generation_prompt, specials, **kwargs) -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend(), chat_template=template, **specials)
    return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)


USER = [{"role": "user", "content": "Hi"}]


def test_tojson_does_not_escape_html_or_unicode():
    text = "<b>Tom & 'Jerry'</b> é"
    out = render("{{ messages[0].content | tojson }}", [{"role": "user", "content": text}])
    assert out == '"<b>Tom & \'Jerry\'</b> é"'  # Jinja's own tojson gives "\u003cb\u003eTom \u0026 ..."


def test_tojson_indent_separators_sort_keys_ensure_ascii():
    tool = {"name": "f", "b": [1, 2], "a": "é"}
    out = render("{{ tools[0] | tojson(indent=2, sort_keys=true) }}|{{ tools[0] | tojson(separators=(',', ':')) }}"
                 "|{{ tools[0] | tojson(ensure_ascii=true) }}", USER, tools=[tool])
    assert out == ('{\n  "a": "é",\n  "b": [\n    1,\n    2\n  ],\n  "name": "f"\n}'
                   '|{"name":"f","b":[1,2],"a":"é"}|{"name": "f", "b": [1, 2], "a": "\\u00e9"}')


def test_strftime_now():
    out = render("{{ strftime_now('%Y-%m-%d') }}", USER)
    assert out == datetime.now().strftime("%Y-%m-%d")


def test_raise_exception():
    template = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                "{{ raise_exception('unknown role ' + m.role) }}{% endif %}{{ m.content }}{% endfor %}")
    assert render(template, USER) == "Hi"
    tok = Tokenizer(backend(), bos_token=None, eos_token=None, pad_token=None, chat_template=template)
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_loop_controls():
    template = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{{ m.content }};"
                "{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}")
    msgs = [{"role": "system", "content": "S"}] + [{"role": "user", "content": str(i)} for i in range(5)]
    assert render(template, msgs) == "0;1;"


def test_trim_blocks_and_lstrip_blocks():
    # Without trim_blocks the newline after each tag stays; without lstrip_blocks the indentation does.
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n"
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert render(template, msgs) == "[a]\n[c]\n"


def test_add_generation_prompt_and_special_tokens():
    template = ("{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}"
                "{% if pad_token is defined %}[pad {{ pad_token }}]{% endif %}")
    assert render(template, USER) == "<|begin_of_text|>user: Hi<|eot_id|>assistant:"
    assert render(template, USER, add_generation_prompt=False) == "<|begin_of_text|>user: Hi<|eot_id|>"
    # only the special tokens that are set are defined, as transformers passes its special_tokens_map
    assert render(template, USER, specials={**SPECIALS, "pad_token": "<|eot_id|>"}).endswith("[pad <|eot_id|>]")
    assert render("{% if bos_token is defined %}B{% endif %}x", USER, specials={"eos_token": "<|eot_id|>"}) == "x"


def test_tools_documents_and_extra_variables():
    template = ("{% if tools is not none %}{{ tools | length }} tools;{% else %}no tools;{% endif %}"
                "{% if documents is none %}no documents;{% endif %}"
                "{% if date_string is not defined %}{% set date_string = '26 Jul 2024' %}{% endif %}{{ date_string }}")
    assert render(template, USER) == "no tools;no documents;26 Jul 2024"
    assert render(template, USER, tools=[{"name": "f"}], date_string="01 Jan 2025") == \
        "1 tools;no documents;01 Jan 2025"


def test_message_keys_holding_none_are_dropped():
    template = "{% for m in messages %}{{ m.role }}={% if 'content' in m %}{{ m.content }}{% else %}-{% endif %};{% endfor %}"
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": None}]
    assert render(template, msgs) == "user=q;assistant=-;"


def test_generation_block_renders_its_body():
    template = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{% set x = 1 %}"
                "<a>{{ m.content }}</a>{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
                "{{ x is defined }}")
    msgs = USER + [{"role": "assistant", "content": "yo"}]
    assert render(template, msgs) == "Hi<a>yo</a>False"


def test_bad_messages_are_named():
    tok = Tokenizer(backend(), bos_token=None, eos_token=None, pad_token=None, chat_template="{{ messages }}")
    with pytest.raises(TypeError, match="chat message 1 is a str"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, "b"])
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(backend(), bos_token=None, eos_token=None, pad_token=None, chat_template=None).apply_chat_template(USER)


def test_templates_run_sandboxed():
    tok = Tokenizer(backend(), bos_token=None, eos_token=None, pad_token=None,
                    chat_template="{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template(USER)


# ----------------------------------------------------------------------------------------------------------
# A Llama-3.1-style template: bos_token, strftime_now / date_string, tools through tojson(indent=4),
# raise_exception, {%- ... %} whitespace control, a system message slotted into the system header
# ----------------------------------------------------------------------------------------------------------

LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

CHAT = [{"role": "system", "content": "You are terse. "}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And <3 & 5>?"}]


def test_llama31_template_multi_turn():
    out = render(LLAMA31_TEMPLATE, CHAT, date_string="26 Jul 2024")
    assert out == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                   "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are terse.<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nAnd <3 & 5>?<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama31_template_dates_itself_with_strftime_now():
    out = render(LLAMA31_TEMPLATE, CHAT[1:2])
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}\n\n<|eot_id|>" in out


def test_llama31_template_tools_and_tool_calls():
    tool = {"type": "function", "function": {"name": "add", "description": "a < b & c",
                                             "parameters": {"type": "object", "properties": {}}}}
    call = {"role": "assistant", "tool_calls": [{"type": "function",
                                                 "function": {"name": "add", "arguments": {"a": 3, "b": "<5>"}}}]}
    msgs = CHAT[1:2] + [call, {"role": "tool", "content": {"sum": 8}}]
    out = render(LLAMA31_TEMPLATE, msgs, tools=[tool], date_string="26 Jul 2024")
    assert "Environment: ipython\n" in out
    assert '{\n    "type": "function",\n    "function": {\n        "name": "add",\n        "description": "a < b & c"' in out
    assert '{"name": "add", "parameters": {"a": 3, "b": "<5>"}}<|eot_id|>' in out
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"sum": 8}<|eot_id|>' in out


def test_llama31_template_raises_as_written():
    tok = Tokenizer(backend(), **SPECIALS, pad_token=None, chat_template=LLAMA31_TEMPLATE)
    two_calls = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}] * 2}
    with pytest.raises(jinja2.exceptions.TemplateError, match="single tool-calls"):
        tok.apply_chat_template(CHAT[1:2] + [two_calls])
    with pytest.raises(jinja2.exceptions.TemplateError, match="no first user message"):
        tok.apply_chat_template(CHAT[:1], tools=[{"name": "f"}])
