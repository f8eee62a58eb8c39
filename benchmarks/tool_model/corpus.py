"""The synthetic chat corpus of the tool model (issue 13): its tools, its chat template, its tasks.

Shared by ``train.py`` (renders and trains), ``e2e_tools.py`` and ``record.py`` (send requests
the model was trained to answer). Pure Python: jinja2 only.

The chat template is Qwen2.5's tool prompt with Qwen3's thinking switch, so that vLLM's own
``hermes`` tool parser and ``qwen3`` reasoning parser apply unchanged:

- tools go into the system turn, one line per tool (name and parameter names only, so that
  every client's schema spelling renders the same line); a call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (hermes);
- tool results come back as a user turn of ``<tool_response>`` blocks;
- thinking is on unless ``enable_thinking`` is false, as in Qwen3 and as vLLM's qwen3 parser
  assumes (``chat_template_kwargs.enable_thinking`` defaults to true there): the model then
  starts with ``<think>\\n...\\n</think>\\n\\n``; with ``enable_thinking`` false the generation
  prompt already holds the empty block ``<think>\\n\\n</think>\\n\\n`` and the model answers.
"""

from __future__ import annotations

import json
import random
from typing import Any

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special (as in Qwen2.5/Qwen3): kept by detokenization with skip_special_tokens.
MARKUP = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}"
    "{%- else %}{{- 'You are a helpful assistant.\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}"
    "{%- set fn = tool.function if tool.function is defined else tool %}"
    "{%- set params = fn.parameters.properties if (fn.parameters is defined and fn.parameters and "
    "fn.parameters.properties is defined and fn.parameters.properties) else {} %}"
    "{{- '\\n' }}{{- {'name': fn.name, 'parameters': params | list} | tojson }}"
    "{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if content %}{{- '\\n' + content }}{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# name -> (description, {parameter: JSON type})
TOOL_SPECS: dict[str, tuple[str, dict[str, str]]] = {
    "get_weather": ("Get the current weather in a city.", {"city": "string"}),
    "add": ("Add two integers.", {"a": "integer", "b": "integer"}),
    "get_time": ("Get the current time in a time zone.", {"timezone": "string"}),
    "lookup_user": ("Look up the email address of a user by name.", {"name": "string"}),
}


def tool(name: str) -> dict[str, Any]:
    """The OpenAI/Ollama tool definition of one of TOOL_SPECS."""
    desc, params = TOOL_SPECS[name]
    return {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": {p: {"type": t, "description": f"The {p}."} for p, t in params.items()},
                       "required": list(params)}}}


CITIES = ["Paris", "Tokyo", "London", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Oslo", "Dublin",
          "Athens", "Cairo", "Lagos", "Nairobi", "Delhi", "Mumbai", "Beijing", "Shanghai", "Seoul", "Bangkok",
          "Jakarta", "Manila", "Sydney", "Melbourne", "Auckland", "Toronto", "Montreal", "Chicago", "Boston",
          "Denver", "Seattle", "Houston", "Miami", "Lima", "Bogota", "Santiago", "Quito", "Havana", "Reykjavik",
          "Helsinki", "Warsaw", "Budapest", "Zurich", "Geneva", "Munich", "Hamburg", "Lyon", "Marseille", "Porto",
          "Seville", "Naples", "Milan", "Venice", "Kyoto", "Osaka", "Hanoi", "Dubai", "Doha", "Istanbul",
          "New York", "Los Angeles", "San Francisco", "Mexico City", "Buenos Aires", "Rio de Janeiro",
          "Cape Town", "Hong Kong", "Kuala Lumpur", "Tel Aviv"]
TIMEZONES = ["Europe/Paris", "Europe/London", "Europe/Berlin", "Asia/Tokyo", "Asia/Seoul", "Asia/Kolkata",
             "America/New_York", "America/Chicago", "America/Denver", "America/Los_Angeles", "Australia/Sydney",
             "Africa/Cairo", "UTC", "Pacific/Auckland", "America/Sao_Paulo", "Asia/Dubai"]
FIRST = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Niaj",
         "Olivia", "Peggy", "Rupert", "Sybil", "Trent", "Victor", "Walter", "Yuki", "Zara", "Omar", "Lena", "Marco"]
CONDITIONS = ["sunny", "cloudy", "rainy", "snowy", "windy", "foggy"]
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
            "Portugal": "Lisbon", "Austria": "Vienna", "Norway": "Oslo", "Ireland": "Dublin", "Greece": "Athens",
            "Egypt": "Cairo", "Kenya": "Nairobi", "China": "Beijing", "Thailand": "Bangkok", "Peru": "Lima",
            "Cuba": "Havana", "Iceland": "Reykjavik", "Finland": "Helsinki", "Poland": "Warsaw", "Hungary": "Budapest"}
GREETINGS = ["Hello!", "Hi", "Hi!", "Hello", "Hey there!", "Good morning!", "Hello, who are you?", "Hi, how are you?"]
CANNED = {
    "Why is the sky blue?": "Sunlight is scattered by the air, and blue light is scattered the most.",
    "Tell me a joke.": "Why did the scarecrow win an award? Because he was outstanding in his field.",
    "Thank you!": "You're welcome!",
    "Thanks.": "You're welcome!",
    "What can you do?": "I can answer short questions, call tools and reply in JSON.",
    "Count to five.": "1, 2, 3, 4, 5.",
    "What is 2 + 2?": "2 + 2 is 4.",
    "Write a haiku about the sea.": "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps its time.",
}
SYSTEMS = ["You are a helpful assistant.", "Be brief.", "You are a concise assistant.", "Answer the user."]


def ask_weather(r: random.Random, city: str) -> str:
    return r.choice([f"What's the weather in {city}?", f"What is the weather like in {city}?",
                     f"How is the weather in {city} today?", f"Weather for {city}, please.",
                     f"Is it raining in {city}?", f"Tell me the weather in {city}.",
                     f"Check the weather in {city}.", f"What's the weather in {city} right now?"])


def ask_add(r: random.Random, a: int, b: int) -> str:
    return r.choice([f"What is {a} plus {b}?", f"Add {a} and {b}.", f"Please compute {a} + {b}.",
                     f"What is the sum of {a} and {b}?", f"Use the add tool on {a} and {b}.", f"{a} + {b} = ?"])


def ask_time(r: random.Random, tz: str) -> str:
    return r.choice([f"What time is it in {tz}?", f"Current time in {tz}?", f"Tell me the time in {tz}.",
                     f"What's the time in the {tz} time zone?"])


def ask_user(r: random.Random, name: str) -> str:
    return r.choice([f"What is the email address of {name}?", f"Look up the user {name}.",
                     f"Find {name}'s email.", f"What's {name}'s email address?"])


def random_name(r: random.Random) -> str:
    if r.random() < 0.6:
        return r.choice(FIRST)
    syl = ["ka", "lo", "mi", "ra", "ten", "vo", "shi", "del", "an", "qu", "bel", "ri", "so", "nu", "zar"]
    return "".join(r.choice(syl) for _ in range(r.randint(2, 3))).capitalize()


def call(fn: str, **arguments: Any) -> dict[str, Any]:
    return {"name": fn, "arguments": arguments}


def call_text(calls: list[dict[str, Any]]) -> str:
    """What the model writes for its calls: hermes blocks, JSON as the template renders it."""
    return "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls)


def history_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


def tool_result(r: random.Random, c: dict[str, Any]) -> tuple[str, str]:
    """(tool message content, the clause the answer makes of it)."""
    a = c["arguments"]
    if c["name"] == "get_weather":
        t, cond = r.randint(-10, 38), r.choice(CONDITIONS)
        return json.dumps({"city": a["city"], "temperature": t, "condition": cond}), f"it is {cond} and {t} degrees in {a['city']}"
    if c["name"] == "add":
        s = a["a"] + a["b"]
        return json.dumps({"result": s}), f"{a['a']} plus {a['b']} is {s}"
    if c["name"] == "get_time":
        hm = f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}"
        return json.dumps({"timezone": a["timezone"], "time": hm}), f"it is {hm} in {a['timezone']}"
    email = a["name"].lower() + "@example.com"
    return json.dumps({"name": a["name"], "email": email}), f"the email address of {a['name']} is {email}"


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


class Sample:
    """One training or evaluation example: the request and the exact text the model must write."""

    def __init__(self, kind: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 thinking: bool | None, answer: str, think: str, calls: list[dict[str, Any]] | None = None):
        self.kind, self.messages, self.tools, self.thinking = kind, messages, tools, thinking
        self.answer, self.think, self.calls = answer, think, calls

    @property
    def target(self) -> str:
        """The completion after the generation prompt (without the closing <|im_end|>)."""
        if self.thinking is False:
            return self.answer
        return f"<think>\n{self.think}\n</think>\n\n{self.answer}"

    def template_kwargs(self) -> dict[str, Any]:
        return {} if self.thinking is None else {"enable_thinking": self.thinking}


def _tools_for(r: random.Random, needed: list[str]) -> list[dict[str, Any]]:
    names = set(needed)
    for n in TOOL_SPECS:
        if r.random() < 0.5:
            names.add(n)
    order = list(names)
    r.shuffle(order)
    return [tool(n) for n in order]


def make_call_task(r: random.Random) -> tuple[str, list[dict[str, Any]], str]:
    """(user text, calls, thinking text) of one tool-call request."""
    kind = r.choices(["weather", "add", "time", "user", "weather2"], [4, 3, 2, 2, 1])[0]
    if kind == "weather":
        city = r.choice(CITIES)
        return ask_weather(r, city), [call("get_weather", city=city)], f"The user asks about the weather in {city}. I will call get_weather."
    if kind == "add":
        a, b = r.randint(0, 999), r.randint(0, 999)
        return ask_add(r, a, b), [call("add", a=a, b=b)], f"The user wants {a} plus {b}. I will call add."
    if kind == "time":
        tz = r.choice(TIMEZONES)
        return ask_time(r, tz), [call("get_time", timezone=tz)], f"The user asks for the time in {tz}. I will call get_time."
    if kind == "user":
        name = random_name(r)
        return ask_user(r, name), [call("lookup_user", name=name)], f"The user wants the email of {name}. I will call lookup_user."
    c1, c2 = r.sample(CITIES, 2)
    text = r.choice([f"What's the weather in {c1} and in {c2}?", f"Compare the weather in {c1} and {c2}."])
    return text, [call("get_weather", city=c1), call("get_weather", city=c2)], \
        f"The user asks about the weather in {c1} and {c2}. I will call get_weather twice."


def _system(r: random.Random, p: float = 0.3) -> list[dict[str, Any]]:
    return [{"role": "system", "content": r.choice(SYSTEMS)}] if r.random() < p else []


def _thinking(r: random.Random) -> bool | None:
    return r.choices([None, True, False], [4, 2, 4])[0]


def sample(r: random.Random, kind: str | None = None) -> Sample:
    kind = kind or r.choices(["call", "result", "plain", "plain_tools", "json", "no_tool", "echo"], [30, 18, 16, 8, 12, 6, 10])[0]
    thinking = _thinking(r)
    if kind == "echo":  # dense copying practice: what tool arguments need (digits, made-up names, places)
        parts = [r.choice([str(r.randint(0, 9999)), random_name(r), r.choice(CITIES), r.choice(TIMEZONES)])
                 for _ in range(r.randint(1, 4))]
        text = " ".join(parts)
        ask = r.choice([f"Repeat after me: {text}", f"Say exactly: {text}", f"Echo: {text}"])
        return Sample(kind, _system(r, 0.2) + [{"role": "user", "content": ask}], None, thinking, text,
                      "The user wants me to repeat the text.")
    if kind in ("call", "result"):
        text, calls, think = make_call_task(r)
        tools = _tools_for(r, [c["name"] for c in calls])
        msgs = _system(r) + [{"role": "user", "content": text}]
        if kind == "call":
            return Sample(kind, msgs, tools, thinking, call_text(calls), think, calls)
        results = [tool_result(r, c) for c in calls]
        msgs.append({"role": "assistant", "content": "", "tool_calls": history_calls(calls)})
        msgs += [{"role": "tool", "content": content} for content, _ in results]
        answer = _cap(" and ".join(clause for _, clause in results)) + "."
        return Sample(kind, msgs, tools, thinking, answer, "The tool returned the result. I will answer the user.")
    if kind == "json":
        name, age = random_name(r), r.randint(1, 99)
        if r.random() < 0.5:
            city = r.choice(CITIES)
            text = r.choice([f"Extract name, age and city as JSON: {name} is {age} years old and lives in {city}.",
                             f"Return JSON with name, age and city. {name}, {age}, lives in {city}."])
            obj: dict[str, Any] = {"name": name, "age": age, "city": city}
        else:
            text = r.choice([f"Extract the name and age as JSON: {name} is {age} years old.",
                             f"Reply in JSON with name and age: {name} is {age}.",
                             f"{name} is {age} years old. Answer in JSON."])
            obj = {"name": name, "age": age}
        msgs = _system(r, 0.2) + [{"role": "user", "content": text}]
        return Sample(kind, msgs, None, thinking, json.dumps(obj), "The user wants JSON. I will extract the fields.")
    if kind == "no_tool":  # a tool question but no tools: say so
        city = r.choice(CITIES)
        return Sample(kind, _system(r) + [{"role": "user", "content": ask_weather(r, city)}], None, thinking,
                      f"I cannot check the weather in {city} without a weather tool.",
                      f"The user asks about the weather in {city}, but I have no tools.")
    # plain answers, with or without tools offered
    u = r.random()
    if u < 0.3:
        text, answer, think = r.choice(GREETINGS), "Hello! How can I help you today?", "The user greets me. I will greet back."
    elif u < 0.55:
        country = r.choice(list(CAPITALS))
        text = r.choice([f"What is the capital of {country}?", f"Capital of {country}?"])
        answer, think = f"The capital of {country} is {CAPITALS[country]}.", f"The user asks for the capital of {country}."
    elif u < 0.75:
        word = r.choice(CITIES + FIRST + ["hello", "yes", "no", "banana", "vllama", "OK"])
        text = r.choice([f"Say {word}.", f"Repeat after me: {word}", f"Reply with the word {word}."])
        answer, think = word, "The user wants me to repeat a word."
    else:
        text = r.choice(list(CANNED))
        answer, think = CANNED[text], "The user asks a simple question. I will answer briefly."
    tools = _tools_for(r, []) if kind == "plain_tools" else None
    return Sample(kind, _system(r) + [{"role": "user", "content": text}], tools, thinking, answer, think)


_ENV = None


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
           add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """The chat template applied as transformers does (sandboxed jinja2, trim_blocks, lstrip_blocks, tojson)."""
    global _ENV
    if _ENV is None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        _ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        _ENV.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
        _ENV.globals["template"] = _ENV.from_string(CHAT_TEMPLATE)
    return _ENV.globals["template"].render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
