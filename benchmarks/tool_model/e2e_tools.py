#!/usr/bin/env python3
"""Tools, thinking and JSON end to end: the real ollama client and langchain-ollama through vllama (issue 13).

Usage: python3 benchmarks/tool_model/e2e_tools.py --url http://127.0.0.1:11434 --model NAME
           [--embed-url URL --embed-model NAME] [--out e2e_tools.json]

Against vllama serving the trained tool model (benchmarks/tool_model/train.py) with vLLM's own
parsers (``--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3``). Each
step prints one line (ok = no exception, right = the answer is the one the model was trained to
give) and the transcript goes to ``--out``. Requests are greedy (temperature 0). Exit status:
the number of steps that were not right.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402

TOOLS = [corpus.tool("get_weather"), corpus.tool("add"), corpus.tool("get_time")]
GREEDY = {"temperature": 0, "num_predict": 160}  # bounded: under a grammar a model can loop
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}


def calls_of(message: Any) -> list[tuple[str, dict]]:
    return [(tc.function.name, dict(tc.function.arguments)) for tc in message.tool_calls or []]


def _plain(out: Any) -> Any:
    """A langchain message as the fields that matter here; anything else as it is."""
    if hasattr(out, "tool_calls") and hasattr(out, "additional_kwargs"):
        return {"content": out.content, "tool_calls": [{"name": c["name"], "args": c["args"]} for c in out.tool_calls],
                "reasoning_content": out.additional_kwargs.get("reasoning_content"),
                "done_reason": (getattr(out, "response_metadata", None) or {}).get("done_reason")}
    return out


class Transcript:
    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def step(self, name: str, fn, check) -> Any:
        t0 = time.perf_counter()
        try:
            out = fn()
            ok, err = True, None
        except Exception as e:  # a transcript: record and go on
            out, ok, err = None, False, f"{type(e).__name__}: {e}"
        wall = time.perf_counter() - t0
        try:
            right = bool(ok and check(out))
        except Exception as e:
            right, err = False, err or f"check: {type(e).__name__}: {e}"
        text = err or json.dumps(_plain(out), default=str, ensure_ascii=False)
        self.steps.append({"step": name, "ok": ok, "right": right, "wall_s": round(wall, 4), "result": text[:2000]})
        print(f"{'ok ' if ok else 'ERR'} {'right' if right else 'WRONG'} {wall * 1000:8.1f} ms  {name:44s} {text[:220]}", flush=True)
        return out


def ollama_steps(t: Transcript, url: str, model: str) -> None:
    import ollama

    c = ollama.Client(host=url)

    def chat(**kw):
        r = c.chat(model=model, stream=False, options=GREEDY, **kw)
        return {"content": r.message.content, "thinking": r.message.thinking, "tool_calls": calls_of(r.message),
                "done_reason": r.done_reason, "eval_count": r.eval_count}

    def chat_stream(**kw):
        chunks = list(c.chat(model=model, stream=True, options=GREEDY, **kw))
        per_chunk = [calls_of(ch.message) for ch in chunks if ch.message.tool_calls]
        return {"chunks": len(chunks), "content": "".join(ch.message.content or "" for ch in chunks),
                "thinking": "".join(ch.message.thinking or "" for ch in chunks), "tool_call_chunks": per_chunk,
                "tool_calls": [x for cs in per_chunk for x in cs], "done_reason": chunks[-1].done_reason,
                "done_only_last": chunks[-1].done and not any(ch.done for ch in chunks[:-1])}

    weather = [{"role": "user", "content": "What's the weather in Paris?"}]
    paris = [("get_weather", {"city": "Paris"})]
    t.step("ollama chat tools (think false)", lambda: chat(messages=weather, tools=TOOLS, think=False),
           lambda o: o["tool_calls"] == paris and not o["thinking"])
    t.step("ollama chat tools stream (think false)", lambda: chat_stream(messages=weather, tools=TOOLS, think=False),
           lambda o: o["tool_calls"] == paris and o["tool_call_chunks"] == [paris] and o["done_only_last"])
    t.step("ollama chat tools, think unset", lambda: chat(messages=[{"role": "user", "content": "What is 250 plus 17?"}], tools=TOOLS),
           lambda o: o["tool_calls"] == [("add", {"a": 250, "b": 17})])
    t.step("ollama chat tools stream, think true", lambda: chat_stream(
        messages=[{"role": "user", "content": "What time is it in Asia/Tokyo?"}], tools=TOOLS, think=True),
        lambda o: o["tool_calls"] == [("get_time", {"timezone": "Asia/Tokyo"})] and "get_time" in o["thinking"])
    two = [("get_weather", {"city": "Berlin"}), ("get_weather", {"city": "Rome"})]
    t.step("ollama chat two calls stream", lambda: chat_stream(
        messages=[{"role": "user", "content": "What's the weather in Berlin and in Rome?"}], tools=TOOLS, think=False),
        lambda o: o["tool_calls"] == two and all(len(cs) == 1 for cs in o["tool_call_chunks"]))
    first = c.chat(model=model, stream=False, options=GREEDY, messages=weather, tools=TOOLS, think=False).message
    result = json.dumps({"city": "Paris", "temperature": 21, "condition": "sunny"})
    history = weather + [first, {"role": "tool", "tool_name": "get_weather", "content": result}]
    t.step("ollama tool result round trip", lambda: chat(messages=history, tools=TOOLS, think=False),
           lambda o: o["content"] == "It is sunny and 21 degrees in Paris." and not o["tool_calls"])
    t.step("ollama tool result round trip stream", lambda: chat_stream(messages=history, tools=TOOLS, think=False),
           lambda o: o["content"] == "It is sunny and 21 degrees in Paris.")
    cap = [{"role": "user", "content": "What is the capital of Japan?"}]
    t.step("ollama think true", lambda: chat(messages=cap, think=True),
           lambda o: o["content"] == "The capital of Japan is Tokyo." and "capital of Japan" in (o["thinking"] or ""))
    t.step("ollama think true stream", lambda: chat_stream(messages=cap, think=True),
           lambda o: o["content"] == "The capital of Japan is Tokyo." and "capital of Japan" in o["thinking"])
    t.step("ollama think false", lambda: chat(messages=cap, think=False),
           lambda o: o["content"] == "The capital of Japan is Tokyo." and not o["thinking"])
    t.step("ollama think unset (model default: thinks)", lambda: chat(messages=cap),
           lambda o: o["content"] == "The capital of Japan is Tokyo.")
    t.step("ollama generate think true", lambda: (lambda r: {"response": r.response, "thinking": r.thinking})(
        c.generate(model=model, prompt="What is the capital of Japan?", think=True, options=GREEDY, stream=False)),
        lambda o: o["response"] == "The capital of Japan is Tokyo." and o["thinking"])
    person = [{"role": "user", "content": "Extract the name and age as JSON: Carol is 27 years old."}]
    t.step("ollama format json", lambda: chat(messages=person, format="json", think=False),
           lambda o: json.loads(o["content"]) == {"name": "Carol", "age": 27})
    t.step("ollama format schema stream", lambda: chat_stream(messages=person, format=SCHEMA, think=False),
           lambda o: json.loads(o["content"]) == {"name": "Carol", "age": 27})
    t.step("ollama format schema, think true", lambda: chat(messages=person, format=SCHEMA, think=True),
           lambda o: json.loads(o["content"]) == {"name": "Carol", "age": 27})


def langchain_steps(t: Transcript, url: str, model: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_ollama import ChatOllama

    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city.
        """
        return json.dumps({"city": city, "temperature": 21, "condition": "sunny"})

    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The a.
            b: The b.
        """
        return a + b

    llm = ChatOllama(model=model, base_url=url, temperature=0, num_predict=160, reasoning=False)
    tooled = llm.bind_tools([get_weather, add])
    q = [HumanMessage("What's the weather in Paris?")]
    ai = t.step("langchain bind_tools invoke", lambda: tooled.invoke(q),
                lambda m: [(c["name"], c["args"]) for c in m.tool_calls] == [("get_weather", {"city": "Paris"})])

    def stream():
        full = None
        for chunk in tooled.stream([HumanMessage("What is 250 plus 17?")]):
            full = chunk if full is None else full + chunk
        return full

    t.step("langchain bind_tools stream", stream,
           lambda m: [(c["name"], c["args"]) for c in m.tool_calls] == [("add", {"a": 250, "b": 17})])
    if ai is not None and ai.tool_calls:
        call = ai.tool_calls[0]
        msgs = q + [ai, ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"], name=call["name"])]
        t.step("langchain tool result round trip", lambda: tooled.invoke(msgs),
               lambda m: m.content == "It is sunny and 21 degrees in Paris.")
    thinker = ChatOllama(model=model, base_url=url, temperature=0, num_predict=160, reasoning=True)
    t.step("langchain reasoning=True", lambda: thinker.invoke([HumanMessage("What is the capital of Japan?")]),
           lambda m: m.content == "The capital of Japan is Tokyo." and m.additional_kwargs.get("reasoning_content"))
    structured = llm.with_structured_output(SCHEMA, method="json_schema")
    t.step("langchain with_structured_output json_schema",
           lambda: structured.invoke("Extract the name and age as JSON: Dave is 58 years old."),
           lambda o: o == {"name": "Dave", "age": 58})


def embed_steps(t: Transcript, url: str, model: str) -> None:
    import ollama

    c = ollama.Client(host=url)
    t.step("ollama embed (pooling runner)", lambda: (lambda r: {"n": len(r.embeddings), "dim": len(r.embeddings[0]),
                                                               "norm": sum(x * x for x in r.embeddings[0]) ** 0.5})(
        c.embed(model=model, input=["Hello world", "Why is the sky blue?"])),
        lambda o: o["n"] == 2 and o["dim"] > 0 and abs(o["norm"] - 1) < 1e-3)
    t.step("ollama embeddings (legacy)", lambda: len(c.embeddings(model=model, prompt="Hello world").embedding), lambda n: n > 0)
    try:
        from langchain_ollama import OllamaEmbeddings
    except ImportError as e:
        t.step("langchain OllamaEmbeddings", lambda: (_ for _ in ()).throw(e), lambda _: False)
        return
    emb = OllamaEmbeddings(model=model, base_url=url)
    t.step("langchain OllamaEmbeddings", lambda: len(emb.embed_documents(["Hello world", "Bye"])), lambda n: n == 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:11434")
    ap.add_argument("--model", required=True)
    ap.add_argument("--embed-url")
    ap.add_argument("--embed-model")
    ap.add_argument("--out")
    a = ap.parse_args()
    t = Transcript()
    ollama_steps(t, a.url, a.model)
    try:
        langchain_steps(t, a.url, a.model)
    except ImportError as e:
        t.step("langchain-ollama import", lambda: (_ for _ in ()).throw(e), lambda _: False)
    if a.embed_url:
        embed_steps(t, a.embed_url, a.embed_model or a.model)
    wrong = [s["step"] for s in t.steps if not s["right"]]
    print(f"{len(t.steps) - len(wrong)}/{len(t.steps)} steps right" + (f"; not right: {wrong}" if wrong else ""), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "url": a.url,
                                           "model": a.model, "steps": t.steps}, indent=1, ensure_ascii=False))
    return min(len(wrong), 100)


if __name__ == "__main__":
    sys.exit(main())
