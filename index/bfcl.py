"""The public starter corpus: BFCL v4 questions with their ground-truth calls, as conversations.

Contract: `iter_bfcl_conversations(categories=None, report=None)` reads the data files that the
`bfcl-eval` package ships (`bfcl_eval/data/BFCL_v4_<category>.json` and
`possible_answer/BFCL_v4_<category>.json`, one JSON object per line, matched by `id`) and yields
one OpenAI-format `Conversation` per question that has call-shaped ground truth. `categories`
(e.g. `["simple_python", "multi_turn_base"]`) defaults to all of `CATEGORIES`; memory,
web_search, irrelevance and format_sensitivity carry no ground-truth calls and are not offered.

- Single-turn categories: the question's messages, then ONE assistant message whose tool calls
  are the ground truth. Ground truth gives a list of possible values per argument: the first is
  taken, and a first value of "" (BFCL's "may be omitted") drops the argument. Nested objects
  hold possible-value lists too and are resolved the same way.
- Multi-turn categories: ground truth is, per user turn, a list of Python call strings
  ("cd(folder='document')"), parsed with `ast`; positional arguments are named from the tool's
  parameter order. Each turn becomes its user messages then one assistant message carrying all
  of that turn's calls. Tool results are not in the data and none are invented: the next user
  turn follows directly. A turn with no ground-truth calls adds no assistant message. Tools are
  the function docs of the involved classes (`multi_turn_func_doc/`), minus excluded functions;
  the miss_func holdout functions are offered from the start.
- BFCL schema types become JSON schema ones (dict -> object, float -> number, tuple -> array,
  any -> no type, Java/JS names likewise).

`bfcl_split(conversations, holdout_fraction, seed)` splits deterministically by a hash of each
conversation id, so an index and a replay built from the same corpus stay disjoint.
"""
from __future__ import annotations

import ast
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Iterator

from index.traces import Conversation, ReadReport

CATEGORIES = (
    "simple_python", "simple_java", "simple_javascript", "multiple", "parallel",
    "parallel_multiple", "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple",
    "multi_turn_base", "multi_turn_long_context", "multi_turn_miss_func", "multi_turn_miss_param",
)
# bfcl_eval.constants.executable_backend_config.MULTI_TURN_FUNC_DOC_FILE_MAPPING (copied: that
# module is data, importing the package's constants is not needed to read it).
_CLASS_DOCS = {
    "GorillaFileSystem": "gorilla_file_system.json", "MathAPI": "math_api.json",
    "MessageAPI": "message_api.json", "TwitterAPI": "posting_api.json",
    "TicketAPI": "ticket_api.json", "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json", "VehicleControlAPI": "vehicle_control.json",
    "WebSearchAPI": "web_search.json",
}
_TYPES = {"dict": "object", "HashMap": "object", "float": "number", "double": "number",
          "tuple": "array", "Array": "array", "ArrayList": "array", "long": "integer",
          "String": "string", "char": "string", "Boolean": "boolean"}


def data_dir() -> Path:
    return Path(str(resources.files("bfcl_eval") / "data"))


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def convert_schema(schema: Any) -> Any:
    """A BFCL parameter schema as JSON schema (types renamed, recursively)."""
    if isinstance(schema, list):
        return [convert_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "type" and isinstance(v, str):
            if v in ("any", ""):
                continue
            out[k] = _TYPES.get(v, v)
        elif k == "properties" and isinstance(v, dict):
            out[k] = {name: convert_schema(p) for name, p in v.items()}
        elif k in ("items", "additionalProperties"):
            out[k] = convert_schema(v)
        else:
            out[k] = v
    return out


def to_openai_tool(fn: dict) -> dict:
    f = {"name": fn["name"], "description": fn.get("description", ""),
         "parameters": convert_schema(fn.get("parameters") or {"type": "dict", "properties": {}})}
    return {"type": "function", "function": f}


def _first_value(options: Any) -> tuple[bool, Any]:
    """(present, value) from a list of possible values; "" first means the argument is omitted."""
    if not isinstance(options, list) or not options:
        return True, _resolve(options)
    first = options[0]
    if first == "":
        return False, None
    return True, _resolve(first)


def _resolve(value: Any) -> Any:
    """Nested ground-truth objects map each key to possible values too."""
    if isinstance(value, dict) and value and all(isinstance(v, list) for v in value.values()):
        return _present_values(value)
    if isinstance(value, list):
        return [_resolve(v) for v in value]
    return value


def _present_values(options_by_key: dict) -> dict:
    """Each key's first possible value, for the keys that have one."""
    out = {}
    for key, options in options_by_key.items():
        present, v = _first_value(options)
        if present:
            out[key] = v
    return out


def ground_truth_calls(ground_truth: list[dict]) -> list[tuple[str, dict]]:
    return [(name, _present_values(args)) for entry in ground_truth for name, args in entry.items()]


def parse_call_string(text: str, param_order: dict[str, list[str]]) -> tuple[str, dict]:
    """"mv(source='a', destination='b')" -> ("mv", {...}); positional args named from the tool."""
    node = ast.parse(text.strip(), mode="eval").body
    if not isinstance(node, ast.Call):
        raise ValueError(f"not a call: {text!r}")
    name = ast.unparse(node.func)
    kwargs: dict = {}
    if node.args:
        order = param_order.get(name)
        if order is None or len(node.args) > len(order):
            raise ValueError(f"cannot name positional arguments of {name}")
        for pname, a in zip(order, node.args):
            kwargs[pname] = ast.literal_eval(a)
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError(f"**kwargs in {text!r}")
        kwargs[kw.arg] = ast.literal_eval(kw.value)
    return name, kwargs


def _assistant(calls: list[tuple[str, dict]], turn: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{turn}_{k}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
        for k, (name, args) in enumerate(calls)]}


def _messages(turn: list) -> list[dict]:
    return [{"role": m["role"], "content": m.get("content") or ""} for m in turn]


def _multi_turn_functions(item: dict, docs: Path) -> list[dict]:
    excluded = set(item.get("excluded_function") or [])
    fns = []
    for cls in item.get("involved_classes", []):
        fns += [f for f in _jsonl(docs / _CLASS_DOCS[cls]) if f["name"] not in excluded]
    return fns


def convert_item(category: str, item: dict, answer: dict, docs: Path) -> Conversation:
    """One BFCL question + its answer -> Conversation; raises ValueError/KeyError when malformed."""
    gt = answer["ground_truth"]
    if category.startswith("multi_turn"):
        fns = _multi_turn_functions(item, docs)
        order = {f["name"]: list((f.get("parameters") or {}).get("properties", {})) for f in fns}
        messages: list[dict] = []
        for t, turn in enumerate(item["question"]):
            messages += _messages(turn)
            calls = [parse_call_string(s, order) for s in (gt[t] if t < len(gt) else [])]
            if calls:
                messages.append(_assistant(calls, t))
    else:
        fns = item["function"]
        messages = [m for turn in item["question"] for m in _messages(turn)]
        messages.append(_assistant(ground_truth_calls(gt), 0))
    return Conversation(messages=messages, tools=[to_openai_tool(f) for f in fns],
                        source=f"bfcl/{category}", line=0, id=item["id"])


def iter_bfcl_conversations(categories: Iterable[str] | None = None,
                            report: ReadReport | None = None) -> Iterator[Conversation]:
    report = report if report is not None else ReadReport()
    root = data_dir()
    for category in categories or CATEGORIES:
        if category not in CATEGORIES:
            raise ValueError(f"unknown BFCL category {category!r}; known: {', '.join(CATEGORIES)}")
        name = f"BFCL_v4_{category}.json"
        report.files += 1
        questions = _jsonl(root / name)
        answers = {a["id"]: a for a in _jsonl(root / "possible_answer" / name)}
        report.lines += len(questions)
        for no, item in enumerate(questions, 1):
            answer = answers.get(item.get("id"))
            if answer is None:
                report.skip(f"bfcl/{category}", no, f"no ground truth for {item.get('id')}")
                continue
            try:
                conv = convert_item(category, item, answer, root / "multi_turn_func_doc")
            except (ValueError, KeyError, TypeError, SyntaxError) as e:
                report.skip(f"bfcl/{category}", no, f"{item.get('id')}: {e}")
                continue
            conv.line = no
            report.conversations += 1
            report.by_format[f"bfcl/{category}"] += 1
            yield conv


def bfcl_split(conversations: Iterable[Conversation], holdout_fraction: float,
               seed: int = 0) -> tuple[list[Conversation], list[Conversation]]:
    """(index set, holdout set), decided per conversation by a hash of seed and its key."""
    if not 0.0 <= holdout_fraction <= 1.0:
        raise ValueError("holdout_fraction must be in [0, 1]")
    keep, hold = [], []
    for conv in conversations:
        h = hashlib.sha256(f"{seed}:{conv.key()}".encode()).digest()
        (hold if int.from_bytes(h[:8], "big") / 2**64 < holdout_fraction else keep).append(conv)
    return keep, hold
