"""The official OpenAI client against the gateway's /v1/chat/completions.

Usage: openai_client.py BASE_URL API_KEY SCENARIO

Runs SCENARIO once without and once with streaming and prints one JSON object:
{"plain": OUTCOME, "streamed": OUTCOME}, where OUTCOME is what the client saw:
{"content", "tool_calls": [{"id", "name", "arguments"}], "finish_reason", "usage",
"toolfleet"} or {"error": {"status", "body"}}. The streamed outcome is assembled from
the client's own chunk objects.
"""

import json
import sys

import openai

BASE, KEY, SCENARIO = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=60)

USER = [{"role": "user", "content": "Show me my invoices and appointments."}]
CALLER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather where the caller is",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def request(scenario):
    """The create() arguments of a scenario."""
    args = {"model": "any-model", "messages": list(USER)}
    if scenario == "mixed":
        args["tools"] = [CALLER_TOOL, {"type": "fleet"}]
    if scenario == "rounds_cap":
        args["extra_body"] = {"toolfleet": {"max_rounds": 1}}
    return args


def outcome_of(response):
    choice = response.choices[0]
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in (choice.message.tool_calls or [])]
    extra = (response.model_extra or {}).get("toolfleet")
    return {"content": choice.message.content, "tool_calls": calls,
            "finish_reason": choice.finish_reason,
            "usage": response.usage.model_dump() if response.usage else None,
            "toolfleet": extra}


def streamed_outcome(stream):
    content, calls, finish, usage, extra = None, {}, None, None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage.model_dump()
        if (chunk.model_extra or {}).get("toolfleet"):
            extra = chunk.model_extra["toolfleet"]
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for part in delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
                if part.id:
                    call["id"] = part.id
                if part.function and part.function.name:
                    call["name"] += part.function.name
                if part.function and part.function.arguments:
                    call["arguments"] += part.function.arguments
            if choice.finish_reason:
                finish = choice.finish_reason
    return {"content": content, "tool_calls": [calls[i] for i in sorted(calls)],
            "finish_reason": finish, "usage": usage, "toolfleet": extra}


def run(stream):
    args = request(SCENARIO)
    try:
        if stream:
            args["stream_options"] = {"include_usage": True}
            seen = streamed_outcome(client.chat.completions.create(stream=True, **args))
        else:
            seen = outcome_of(client.chat.completions.create(**args))
    except openai.APIStatusError as e:
        return {"error": {"status": e.status_code, "body": e.body}}
    if SCENARIO == "mixed" and seen.get("tool_calls"):
        # The caller runs its own tool and continues; the fleet's results are added.
        messages = list(USER) + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in seen["tool_calls"]]}]
        for c in seen["tool_calls"]:
            if c["name"] == "get_weather":
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": "sunny"})
        again = {"model": "any-model", "messages": messages,
                 "tools": [CALLER_TOOL, {"type": "fleet"}]}
        if stream:
            seen["continued"] = streamed_outcome(
                client.chat.completions.create(stream=True, **again))
        else:
            seen["continued"] = outcome_of(client.chat.completions.create(**again))
    return seen


print(json.dumps({"plain": run(False), "streamed": run(True)}))
