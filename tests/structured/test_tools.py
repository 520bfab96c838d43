"""Tools: which format a chat template speaks, the grammars that force a call, and the messages
rendered through a Hermes-style (Qwen2.5-like) template and through the generic format."""

from __future__ import annotations

import json

import pytest
from tiny_models import smollm2_tokenizer
from xgrammar.testing import _is_grammar_accept_string as accepts

from engine.model.tokenizer import Tokenizer, template_variables
from engine.structured.tool_parsers import get_parser
from engine.structured.tools import Tool, ToolRequest, constraint, detect_format, render_messages

# A short Hermes-style template, shaped like Qwen2.5's: the tools in the system turn, calls in
# <tool_call> blocks, results as <tool_response> blocks in one user turn.
HERMES = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
    {{- '\n</tools>\nCall a function as <tool_call>\n{"name": <name>, "arguments": <args>}' }}
    {{- '\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for m in messages %}
    {%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if m.content %}{{- '\n' + m.content }}{%- endif %}
        {%- for c in m.tool_calls %}
            {%- set c = c.function %}
            {{- '\n<tool_call>\n{"name": "' + c.name + '", "arguments": ' }}
            {{- c.arguments | tojson + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""
LLAMA = (
    "{% if tools is not none %}Respond with a JSON for a function call in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.'
    "{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m.role == 'ipython' or m.role == 'tool' %}<|python_tag|>"
    "{% endif %}{{ m.content }}{% endfor %}"
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
TOOLS = (Tool("get_weather", "The weather", WEATHER), Tool("get_time"))
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


def test_detect_format():
    smollm = smollm2_tokenizer().chat_template
    assert "tools" not in template_variables(smollm)
    assert detect_format(smollm, template_variables(smollm)) == "generic"
    assert detect_format(HERMES, template_variables(HERMES)) == "hermes"
    assert detect_format(LLAMA, template_variables(LLAMA)) == "llama3_json"
    # "<tool_call>" in a template that never reads tools is not a tools section.
    text_only = "{{ messages[0].content }} <tool_call>"
    assert detect_format(text_only, template_variables(text_only)) == "generic"
    assert template_variables("{% if %}") == set()  # does not parse: no variables
    assert detect_format(None, set()) == "generic"


def test_hermes_template_renders_tools_calls_and_results():
    tok = Tokenizer(smollm2_tokenizer().backend, chat_template=HERMES)
    req = ToolRequest(TOOLS, "auto")
    messages, kwargs = render_messages("hermes", HISTORY, req)
    text = tok.apply_chat_template(messages, **kwargs)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n")
    assert json.dumps(TOOLS[0].openai()) in text
    assert '"parameters": {"type": "object", "properties": {}}' in text  # get_time's default
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n21 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text
    # tool_choice "none": no tools section, the history still rendered.
    messages, kwargs = render_messages("hermes", HISTORY, None)
    text = tok.apply_chat_template(messages, **kwargs)
    assert "<tools>" not in text and "<tool_response>\n21 C" in text


def test_generic_format_renders_tools_calls_and_results():
    tok = smollm2_tokenizer()
    extra = HISTORY + [{"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    messages, kwargs = render_messages("generic", extra, ToolRequest(TOOLS, "required", False))
    assert kwargs == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\nYou can call the following tools")
    assert "get_time" in system and "at least one" in system and "one tool at a time" in system
    call = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert json.loads(messages[2]["content"]) == call
    results = [json.loads(line)["tool_response"] for line in messages[3]["content"].split("\n")]
    assert results == [
        {"tool_call_id": "call_1", "name": "get_weather", "content": "21 C"},
        {"tool_call_id": "call_2", "name": None, "content": "noon"},
    ]
    text = tok.apply_chat_template(messages)
    assert text.count("<|im_start|>system") == 1  # ours replaced the template's default
    # No system message of the request's own: one is added.
    messages, _ = render_messages("generic", HISTORY[1:2], ToolRequest(TOOLS, "auto"))
    assert messages[0]["role"] == "system" and "plain text" in messages[0]["content"]
    assert render_messages("generic", HISTORY[1:2], None) == (HISTORY[1:2], {})


CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
TIME = '{"tool_calls": [{"name": "get_time", "arguments": {}}]}'


def _grammar(fmt: str, req: ToolRequest) -> str:
    so = constraint(fmt, req)
    if so.json is not None:
        import xgrammar as xgr

        return str(xgr.Grammar.from_json_schema(so.json, any_whitespace=False))
    return so.grammar


def test_generic_constraints():
    auto = _grammar("generic", ToolRequest(TOOLS, "auto"))
    assert accepts(auto, CALL) and accepts(auto, "It is sunny.")
    assert not accepts(auto, '{"answer": 1}') and not accepts(auto, " leading space")
    assert not accepts(auto, '{"tool_calls": [{"name": "get_weather", "arguments": {}}]}')
    required = _grammar("generic", ToolRequest(TOOLS, "required"))
    assert accepts(required, CALL) and accepts(required, TIME)
    assert accepts(required, CALL[:-2] + ", " + TIME[len('{"tool_calls": [') :])
    assert not accepts(required, "It is sunny.")
    one = _grammar("generic", ToolRequest(TOOLS, "required", parallel=False))
    assert accepts(one, CALL)
    assert not accepts(one, CALL[:-2] + ", " + TIME[len('{"tool_calls": [') :])
    named = _grammar("generic", ToolRequest(TOOLS, "get_time"))
    assert accepts(named, TIME) and not accepts(named, CALL)
    for text in (CALL, TIME):  # what the grammar takes, the parser reads
        assert get_parser("generic").parse(text)[1]


def test_model_format_constraints():
    assert constraint("hermes", ToolRequest(TOOLS, "auto")) is None  # parsed, not forced
    hermes = _grammar("hermes", ToolRequest(TOOLS, "required", parallel=False))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(hermes, call) and not accepts(hermes, call + "\n" + call)
    assert not accepts(hermes, "Sunny.")
    assert accepts(_grammar("hermes", ToolRequest(TOOLS, "required")), call + "\n" + call)
    llama = _grammar("llama3_json", ToolRequest(TOOLS, "get_weather"))
    assert accepts(llama, '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert not accepts(llama, '{"name": "get_time", "parameters": {}}')
    assert (
        get_parser("hermes").parse(call)[1]
        and get_parser("llama3_json").parse(
            '{"name": "get_weather", "parameters": {"city": "Paris"}}'
        )[1]
    )


def test_bad_parameters_name_the_tool():
    bad = Tool("f", None, {"type": "object", "properties": {"a": {"type": "nonsense"}}})
    with pytest.raises(ValueError, match=r"tools\.1\.function\.parameters"):
        constraint("generic", ToolRequest((TOOLS[0], bad), "auto"))
