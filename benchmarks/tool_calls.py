"""Tool calls through the server, plainly and speculatively.

    python benchmarks/tool_calls.py
    python benchmarks/tool_calls.py --adaptive --gamma 8
    python benchmarks/tool_calls.py --gamma 5 --choices required

Each question goes to /v1/chat/completions with five tools offered, under tool_choice "auto"
(the model decides: the demo 1.5B answers a question its tools fit with the call alone in a
```json block, which the server reads as the call) and "required" (the answer held by a
grammar to calls between Qwen2.5's <tool_call> tags, with arguments the function's schema
allows; the draft drafts under the same masks). For each request plain decoding runs before
and after the speculative run; speed-up = the plain runs' mean decoding time / the speculative
run's, summed over the questions. VALID when the speculative answer (its text, its calls'
names and arguments) is the plain one. The draft's reading of the prompt counts in the
speculative run's decoding time, and with five tools described the prompt is some 430 tokens
where an answer is 30 to 100: with --adaptive (as `verispec serve --adaptive`) the draft reads
only the prompt's last 32 positions at first.
"""

from __future__ import annotations

import argparse
import json
import sys

import verispec  # noqa: F401  (first: it sets how torch's threads wait)

from perf_common import add_pair_arguments, load_pair, save


def function(name: str, description: str, **properties: str) -> dict:
    """A tool whose arguments are all required, each of the JSON type given."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in properties.items()},
                       "required": list(properties)}}}


TOOLS = [
    function("get_weather", "The current weather in a city", city="string"),
    function("calculate", "The value of an arithmetic expression", expression="string"),
    function("convert_currency", "An amount of money in another currency", amount="number",
             source="string", target="string"),
    function("search_web", "The top results of a web search", query="string"),
    function("get_time", "The current time in a time zone", timezone="string"),
]
QUESTIONS = [
    "What is the weather in Tokyo right now?",
    "What is 1764 divided by 42?",
    "How much is 250 euros in US dollars?",
    "Find the latest release of the Python programming language.",
    "What time is it in New York?",
    "Is it raining in Paris or in London today?",
    "What is 17 percent of 3,450?",
    "Search for reviews of the Raspberry Pi 5.",
]


def ask(client, question: str, tool_choice: str, tokens: int) -> dict:
    request = {"messages": [{"role": "user", "content": question}], "tools": TOOLS, "tool_choice": tool_choice,
               "max_tokens": tokens, "temperature": 0}
    response = client.post("/v1/chat/completions", json=request)
    if response.status_code != 200:
        raise SystemExit(f"the server refused a request: {response.text}")
    return response.json()


def answer_of(body: dict) -> tuple:
    """What must agree between plain and speculative answers: the text and the calls."""
    message = body["choices"][0]["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    return message["content"], calls


def compare(plain, spec, questions: list[str], tool_choice: str, tokens: int) -> dict:
    rows, totals = [], {"plain_s": 0.0, "spec_s": 0.0, "drafted": 0, "accepted": 0, "valid": True, "called": 0}
    for question in questions:
        before = ask(plain, question, tool_choice, tokens)
        fast = ask(spec, question, tool_choice, tokens)
        after = ask(plain, question, tool_choice, tokens)
        plain_s = (before["verispec"]["decode_s"] + after["verispec"]["decode_s"]) / 2
        stats = fast["verispec"]
        valid = answer_of(fast) == answer_of(before) == answer_of(after)
        content, calls = answer_of(before)
        rows.append({"question": question, "calls": calls, "content": content, "plain_s": plain_s,
                     "spec_s": stats["decode_s"], "tokens": before["usage"]["completion_tokens"],
                     "acceptance": stats["acceptance_rate"], "valid": valid})
        totals["plain_s"] += plain_s
        totals["spec_s"] += stats["decode_s"]
        totals["drafted"] += stats["drafted"]
        totals["accepted"] += stats["accepted"]
        totals["valid"] &= valid
        totals["called"] += bool(calls)
        shown = ", ".join(f"{name}({json.dumps(arguments)})" for name, arguments in calls) or repr(content[:40])
        print(f"  {tool_choice:>8} {plain_s / max(stats['decode_s'], 1e-9):5.2f}x  "
              f"{stats['acceptance_rate']:6.1%}  {'VALID' if valid else 'INVALID'}  {question[:40]:<40} {shown}")
    totals["speedup"] = totals["plain_s"] / totals["spec_s"] if totals["spec_s"] else 0.0
    totals["acceptance"] = totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0
    return {"questions": rows, **totals}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--choices", nargs="+", default=["auto", "required"], choices=["auto", "required"])
    parser.add_argument("--adaptive", action="store_true",
                        help="the speculative server with --adaptive (cost-aware γ)")
    args = parser.parse_args()

    from fastapi.testclient import TestClient

    from verispec.server import create_app

    details = f"{'--adaptive, ' if args.adaptive else ''}γ = {args.gamma}, up to {args.tokens} tokens"
    target, draft, record = load_pair(args, "tool calls", details)
    plain = TestClient(create_app(target))
    spec = TestClient(create_app(target, draft=draft, gamma=args.gamma, adaptive=args.adaptive))
    ask(plain, QUESTIONS[0], "auto", 4)  # warm both up
    ask(spec, QUESTIONS[0], "auto", 4)
    record.update(gamma=args.gamma, tokens=args.tokens, adaptive=args.adaptive, choices={})
    all_valid = True
    for tool_choice in args.choices:
        result = compare(plain, spec, QUESTIONS, tool_choice, args.tokens)
        record["choices"][tool_choice] = result
        all_valid &= result["valid"]
        print(f"  tool_choice {tool_choice}: speed-up {result['speedup']:.2f}x, acceptance {result['acceptance']:.1%}, "
              f"{result['called']} of {len(QUESTIONS)} answers called a tool, "
              f"{'VALID' if result['valid'] else 'INVALID'}")
    history = {"gamma": args.gamma, "adaptive": args.adaptive, "all_valid": all_valid,
               "speedup": {c: round(r["speedup"], 4) for c, r in record["choices"].items()}}
    save("tool_calls_adaptive" if args.adaptive else "tool_calls", record, history)
    return 0 if all_valid else 1


if __name__ == "__main__":
    sys.exit(main())
