"""Drives a kvgate worker with the official `openai` Python client (argv: base URL, model id).

Checks chat streaming with usage, non-streamed chat, completions with text and token-id prompts, and that the
server's errors surface as the client's typed exceptions. Prints "ok" on success; any failure raises.
"""
import sys

import openai


def main() -> None:
    base, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)

    models = client.models.list()
    assert [m.id for m in models.data] == [model], models

    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "ka ri to"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert usage is not None and usage.completion_tokens >= 1, usage
    assert usage.prompt_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert finish in ("stop", "length"), finish

    full = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "ka ri to"}],
        max_tokens=6,
        temperature=0,
    )
    assert full.choices[0].message.content == text, (full.choices[0].message.content, text)
    # The same system prompt again: part of it came from the prefix cache.
    assert full.usage.prompt_tokens_details.cached_tokens > 0, full.usage

    comp = client.completions.create(model=model, prompt="ka ri to ne", max_tokens=4, temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length")
    assert comp.usage.prompt_tokens > 0

    ids = client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 4, ids.usage

    try:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        assert e.body["code"] == "model_not_found", e.body
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], temperature=-3)
        raise AssertionError("bad temperature accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "temperature", e.body
    print("ok")


if __name__ == "__main__":
    main()
