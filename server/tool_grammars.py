"""Grammars (llguidance's Lark dialect, as text) for tool calls, built from OpenAI `tools`.

Contract: pure functions from a list of OpenAI tools (`{"type": "function", "function": {"name",
"parameters"}}`, or the bare function objects) to grammar text that `server.grammar.GrammarCompiler`
compiles (its `tool_call` / `tool_call_json` methods call these with the tokenizer's special tokens).
`special_tokens` maps the text of the tokenizer's special tokens to their ids: a marker's text that
is a special token is written as that token, `<[id]>` (a special token never matches text), the rest
of it as text.

- `tool_call_grammar(tools, named=None, parallel=True, optional=False)`: the built-in Gemma 4 format of
  common.chat_format, `<|tool_call>call:NAME{ARGS}<tool_call|>`, one call or (parallel) one or more
  in a row (`optional`: after free text, none, or one / one or more: tool_choice "auto" with strict
  tools), NAME one of the offered tools (`named`: only that one), ARGS in the format's value syntax
  (bare keys, strings `<|"|>text<|"|>`, JSON numbers, true/false/null) following the tool's
  `parameters` schema: `properties` in their declared order (required ones always, optional ones
  optionally; no other keys), `type` (also a list of types), `enum`, `const`, `anyOf`/`oneOf`,
  `allOf` (shallowly merged), array `items` and `minItems` >= 1, local `$ref`s (`#/$defs/...`,
  `#/definitions/...`, recursive ones included). Not enforced (any value of the type is allowed):
  string `pattern`/`format`/lengths, numeric bounds, array `maxItems`/`prefixItems`,
  `additionalProperties` (an object with `properties` takes no other keys; one without takes any
  keys). What it accepts, `common.chat_format.parse_generated` parses into the same call.
  `unenforced_keywords(parameters)` names what a schema asks beyond that (a strict tool's are refused).
- `tool_call_json_grammar(tools, named=None, parallel=False, open_marker="", close_marker="")`: for
  a chat template whose model writes calls as JSON, `{"name": NAME, "arguments": {...}}` validated
  by llguidance's JSON-schema support (lenient: unsupported keywords are ignored; whitespace as in
  server.grammar's JSON), each call between the template's markers (e.g. `<tool_call>\\n` and
  `\\n</tool_call>`; special tokens inside a marker are matched as tokens); parallel calls are
  separated by optional newlines.
Both raise ValueError for no tools, an unknown `named`, or a name/key the format cannot carry.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

from common.chat_format import CALL_CLOSE, CALL_OPEN, QUOTE, format_value

# JSON whitespace: at most this much at each place JSON allows it. Unbounded whitespace lets a small
# model loop on newlines until max_tokens (outlines bounds it for the same reason). Numbers in calls are
# bounded alike (20 digits before and after the point, 3 in the exponent: past what a 64-bit integer or a
# double holds): a small model wrote digits until max_tokens.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,32}"
_NAME_OK = re.compile(r"[^{}<>\s]+")          # what common.chat_format's call parser takes as a name
_KEY_BAD = set("{}[],<>:")                     # what it cannot take inside a bare key
# Any value of the value syntax; keys of an object without declared properties are identifiers.
_GENERIC_RULES = r"""
g_value: g_string | NUMBER | "true" | "false" | "null" | g_object | g_array
g_object: "{" (g_member ("," g_member)*)? "}"
g_member: G_KEY ":" g_value
g_array: "[" (g_value ("," g_value)*)? "]"
G_KEY: /[A-Za-z_][A-Za-z0-9_.\-]*/
NUMBER: /-?(0|[1-9][0-9]{0,19})(\.[0-9]{1,20})?([eE][+-]?[0-9]{1,3})?/
INTEGER: /-?(0|[1-9][0-9]{0,19})/
"""


def tool_functions(tools: list[dict], named: str | None = None) -> list[dict]:
    """The offered function objects (`named`: only that one), checked to be callable by name."""
    functions = [t.get("function", t) for t in tools if isinstance(t, dict)]
    functions = [f for f in functions if isinstance(f, dict) and f.get("name")]
    if not functions:
        raise ValueError("no tools to call")
    if named is not None:
        functions = [f for f in functions if f["name"] == named]
        if not functions:
            raise ValueError(f"tool {named!r} is not among the offered tools")
    return functions


def lark_string(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)


def marker(text: str, special_tokens: Mapping[str, int]) -> str:
    """A marker as grammar items: each special token's text in it (leftmost, longest first) as that
    token, the text around them as text (e.g. `<tool_call>\\n` -> `<[id]> "\\n"`)."""
    items, rest = [], text
    while rest:
        hits = [(rest.find(s), -len(s), s) for s in special_tokens if s and s in rest]
        if not hits:
            items.append(lark_string(rest))
            break
        at, _, special = min(hits)
        if at:
            items.append(lark_string(rest[:at]))
        items.append(f"<[{special_tokens[special]}]>")
        rest = rest[at + len(special):]
    return " ".join(items)


def tool_call_grammar(tools: list[dict], named: str | None = None, parallel: bool = True,
                      special_tokens: Mapping[str, int] | None = None, optional: bool = False) -> str:
    special_tokens = special_tokens or {}
    rules = _ValueSyntaxRules(special_tokens)
    alternatives = []
    for fn in tool_functions(tools, named):
        name = fn["name"]
        if not _NAME_OK.fullmatch(name) or "call:" in name:
            raise ValueError(f"tool name {name!r} cannot be written in the Gemma 4 call syntax")
        parameters = fn.get("parameters") or {"type": "object"}
        if optional and not fn.get("strict"):
            args = "g_object"  # "auto" with strict tools: only the strict ones' arguments are checked
        else:
            args = rules.value(parameters, parameters, force_object=True)
            refuse_unsatisfiable(parameters)
        alternatives.append(f"{lark_string('call:' + name)} {args}")
    body = f"({' | '.join(alternatives)}) {marker(CALL_CLOSE, special_tokens)}"
    if optional:
        return _optional_calls_head(body, parallel, special_tokens) + rules.text()
    head = f"start: call{'+' if parallel else ''}\ncall: {marker(CALL_OPEN, special_tokens)} {body}\n"
    return head + rules.text()


def _optional_calls_head(body: str, parallel: bool, special_tokens: Mapping[str, int]) -> str:
    """`start` of tool_choice "auto" under strict: free text, then no call or calls (one or more with
    `parallel`, else one), nothing after them. The text never spells the call opener (the parser
    would take it for a call the grammar did not check). Where the opener is a special token the
    text simply ends at it; where it is text, a lexer that reads text greedily could not give back
    the opener's first bytes, so the text before a first call and the opener are one lexeme (LEAD:
    text ending at its first opener)."""
    opener = re.escape(CALL_OPEN)
    text = f"/(?s:.*)/ & ~/(?s:.*){opener}(?s:.*)/"
    more = "*" if parallel else "?"
    if CALL_OPEN in special_tokens:
        return f"start: TEXT? call{more}\nTEXT: {text}\ncall: {marker(CALL_OPEN, special_tokens)} {body}\n"
    return (f"start: TEXT | LEAD {body}{' call*' if parallel else ''}\nTEXT: {text}\n"
            f"LEAD: /(?s:.*){opener}/ & ~/(?s:.*){opener}(?s:.+)/\ncall: {lark_string(CALL_OPEN)} {body}\n")


# Keywords the value-syntax grammar does not enforce (it allows any value of the type): a tool marked
# `strict` that uses one is refused rather than enforced in part.
_UNENFORCED_KEYWORDS = ("pattern", "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
                        "exclusiveMaximum", "multipleOf", "maxItems", "prefixItems", "uniqueItems", "contains",
                        "minContains", "maxContains", "minProperties", "maxProperties", "patternProperties",
                        "propertyNames", "dependentRequired", "dependentSchemas", "not", "if", "then", "else",
                        "unevaluatedProperties", "unevaluatedItems")


# Keywords that `$ref`, `anyOf` and `oneOf` take precedence over in the grammar (a sibling is not checked).
_STRUCTURE_KEYWORDS = ("type", "properties", "required", "items", "enum", "const", "additionalProperties")


def unenforced_keywords(schema: Any) -> list[str]:
    """The keywords of a `parameters` schema that `tool_call_grammar` would not enforce, sorted: those
    above; `minItems` above 1; `additionalProperties` other than what it does (an object with
    `properties` takes no other keys; one without takes any, or none where it is false); `oneOf`
    (checked as `anyOf`: one member or more, not exactly one) and `allOf` (merged shallowly); a tuple's
    `items` (a list); and a structural keyword beside `$ref`, `anyOf` or `oneOf` (named as that one)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item)
        if not isinstance(node, dict):
            return
        found.update(k for k in _UNENFORCED_KEYWORDS + ("oneOf", "allOf") if k in node)
        if isinstance(node.get("minItems"), int) and node["minItems"] > 1:
            found.add("minItems")
        if isinstance(node.get("items"), list):
            found.add("items")
        extra = node.get("additionalProperties")
        if extra is not None and not (extra is False or (extra is True and not node.get("properties"))):
            found.add("additionalProperties")
        for wins in ("$ref", "anyOf", "oneOf"):
            if wins in node and any(k in node for k in _STRUCTURE_KEYWORDS):
                found.add(wins)
        for key, value in node.items():
            if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
                walk(list(value.values()))
            elif key in ("items", "anyOf", "oneOf", "allOf"):
                walk(value)

    walk(schema)
    return sorted(found)


def tool_call_json_schema(tools: list[dict], named: str | None = None) -> dict:
    """JSON schema of one call object `{"name": NAME, "arguments": {...}}` for the offered tools."""
    functions = tool_functions(tools, named)
    options = []
    for i, fn in enumerate(functions):
        refuse_unsatisfiable(fn.get("parameters"))
        # a parameters schema's local $refs point into itself: rebase them to where it now sits
        at = "#/properties/arguments" if len(functions) == 1 else f"#/anyOf/{i}/properties/arguments"
        options.append({"type": "object",
                        "properties": {"name": {"const": fn["name"]},
                                       "arguments": _rebase_refs(fn.get("parameters") or {"type": "object"}, at)},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def _rebase_refs(schema: Any, at: str) -> Any:
    if isinstance(schema, dict):
        return {k: (at + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase_refs(v, at))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase_refs(v, at) for v in schema]
    return schema


def tool_call_json_grammar(tools: list[dict], named: str | None = None, parallel: bool = False,
                           open_marker: str = "", close_marker: str = "",
                           special_tokens: Mapping[str, int] | None = None) -> str:
    special_tokens = special_tokens or {}
    schema = dict(tool_call_json_schema(tools, named))
    schema["x-guidance"] = {"lenient": True, "whitespace_pattern": JSON_WHITESPACE}
    body = " ".join(p for p in (marker(open_marker, special_tokens) if open_marker else "", "call_json",
                                marker(close_marker, special_tokens) if close_marker else "") if p)
    start = 'start: call ("\\n"* call)*' if parallel else "start: call"
    return f"{start}\ncall: {body}\ncall_json: %json {json.dumps(schema)}\n"


class _ValueSyntaxRules:
    """Lark rules for schemas in common.chat_format's value syntax; `value` returns a rule name."""

    def __init__(self, special_tokens: Mapping[str, int]):
        self.quote_token = special_tokens.get(QUOTE)
        self.rules: dict[str, str] = {}
        self.by_ref: dict[str, str] = {}

    def text(self) -> str:
        if self.quote_token is None:  # lazy: the string ends at the first closing quote marker
            q = re.escape(QUOTE)
            string_rules = f"g_string[lazy]: /{q}(?s:.*){q}/\n"
        else:                         # the quote is a token; the text between must not spell it
            q = f"<[{self.quote_token}]>"
            string_rules = (f"g_string: {q} G_TEXT {q}\n"
                            f"G_TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(QUOTE)}(?s:.*)/\n")
        return "".join(f"{name}: {body}\n" for name, body in self.rules.items()) + string_rules + _GENERIC_RULES

    def _rule(self, body: str) -> str:
        name = f"v{len(self.rules)}"
        self.rules[name] = body
        return name

    def literal(self, value: Any) -> str:
        """A grammar item matching exactly format_value(value)."""
        if isinstance(value, str):
            if QUOTE in value:
                raise ValueError(f"a string containing {QUOTE} cannot be written in the Gemma 4 value syntax")
            if self.quote_token is None:
                return lark_string(format_value(value))
            q = f"<[{self.quote_token}]>"
            return f"{q} {lark_string(value)} {q}" if value else f"{q} {q}"
        if isinstance(value, dict):
            members = [f"{lark_string(_key(k) + ':')} {self.literal(v)}" for k, v in value.items()]
            return '"{" ' + ' "," '.join(members) + ' "}"' if members else '"{" "}"'
        if isinstance(value, (list, tuple)):
            items = [self.literal(v) for v in value]
            return '"[" ' + ' "," '.join(items) + ' "]"' if items else '"[" "]"'
        return lark_string(format_value(value))

    def value(self, schema: Any, root: dict, force_object: bool = False) -> str:
        if schema is True or not isinstance(schema, dict) or not schema:
            return "g_object" if force_object else "g_value"
        _check_keywords(schema)
        if "$ref" in schema:
            return self._ref(schema["$ref"], root)
        if "allOf" in schema:
            return self.value(_merge_all_of(schema), root, force_object)
        if "const" in schema:
            return self._rule(self.literal(schema["const"]))
        if "enum" in schema:
            return self._rule(" | ".join(self.literal(v) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self._rule(" | ".join(self.value(s, root) for s in schema[key]))
        types = schema.get("type")
        if types is None:
            types = "object" if ("properties" in schema or force_object) else "array" if "items" in schema else None
        if types is None:
            return "g_value"
        if isinstance(types, list):
            return self._rule(" | ".join(self._typed(t, schema, root) for t in types))
        return self._typed(types, schema, root)

    def _typed(self, kind: str, schema: dict, root: dict) -> str:
        if kind == "string":
            return "g_string"
        if kind == "integer":
            return "INTEGER"
        if kind == "number":
            return "NUMBER"
        if kind == "boolean":
            return self._rule('"true" | "false"')
        if kind == "null":
            return self._rule('"null"')
        if kind == "array":
            items = schema.get("items", True)
            item = self.value(True if isinstance(items, list) else items, root)  # a tuple's items: any value
            if schema.get("minItems", 0) >= 1:
                return self._rule(f'"[" {item} ("," {item})* "]"')
            return self._rule(f'"[" ({item} ("," {item})*)? "]"')
        if kind == "object":
            return self._object(schema, root)
        raise ValueError(f"unknown JSON schema type {kind!r}")

    def _object(self, schema: dict, root: dict) -> str:
        properties = schema.get("properties") or {}
        if not properties:
            # no declared keys: any keys, or none where additionalProperties is false (a tool of no arguments)
            return self._rule('"{" "}"') if schema.get("additionalProperties") is False else "g_object"
        required = set(schema.get("required") or ())
        members = [(f"{lark_string(_key(k) + ':')} {self.value(s, root)}", k in required)
                   for k, s in properties.items()]
        # first_i: the members from i on when none was written yet; rest_i: after one was (so each
        # starts with a comma). Declared order, required ones always, optional ones maybe: linear size.
        first, rest = "", ""
        for member, needed in reversed(members):
            rest_next = rest
            rest = self._rule(f'"," {member} {rest_next}' if needed else f'("," {member})? {rest_next}')
            first_next = first
            if needed:
                first = self._rule(f"{member} {rest_next}")
            else:
                first = self._rule(f"{member} {rest_next} | {first_next}" if first_next else f"({member} {rest_next})?")
        return self._rule(f'"{{" {first} "}}"')

    def _ref(self, ref: str, root: dict) -> str:
        if ref in self.by_ref:
            return self.by_ref[ref]
        if not ref.startswith("#"):
            raise ValueError(f"only local $refs are supported, not {ref!r}")
        target = _pointer(ref, root)
        if target is _UNRESOLVED:
            raise ValueError(f"$ref {ref!r} does not resolve")
        name = f"v{len(self.rules)}"
        self.rules[name] = ""  # reserved first, so a recursive reference finds it
        self.by_ref[ref] = name
        self.rules[name] = self.value(target, root)
        return name


_LIST_KEYWORDS = ("enum", "anyOf", "oneOf", "allOf", "required")   # JSON Schema arrays (the first four non-empty)
_OBJECT_KEYWORDS = ("properties", "$defs", "definitions")


def _check_keywords(schema: dict) -> None:
    """ValueError for a keyword of the wrong JSON type (a client's schema is checked before it
    becomes grammar text: `"required": 5` would otherwise fail inside the builder) and for an
    `enum` / `anyOf` / `oneOf` / `allOf` with no members (no value satisfies it; JSON Schema
    requires them non-empty)."""
    for key in _LIST_KEYWORDS:
        if key in schema and not isinstance(schema[key], list):
            raise ValueError(f"'{key}' must be an array in a JSON schema, not {type(schema[key]).__name__}")
        if key in schema and key != "required" and not schema[key]:
            raise ValueError(f"'{key}' is empty: no value satisfies it")
    for key in _OBJECT_KEYWORDS:
        if key in schema and not isinstance(schema[key], dict):
            raise ValueError(f"'{key}' must be an object in a JSON schema, not {type(schema[key]).__name__}")
    if "required" in schema and not all(isinstance(k, str) for k in schema["required"]):
        raise ValueError("'required' must list property names (strings)")
    if "$ref" in schema and not isinstance(schema["$ref"], str):
        raise ValueError(f"'$ref' must be a string, not {type(schema['$ref']).__name__}")
    types = schema.get("type")
    if types is not None and not (isinstance(types, str) or (isinstance(types, list) and types
                                                              and all(isinstance(t, str) for t in types))):
        raise ValueError("'type' must be a type name or a non-empty array of them")
    if "items" in schema and not isinstance(schema["items"], (dict, bool, list)):
        raise ValueError("'items' must be a schema (an object or a boolean), or a list of them (a tuple)")
    min_items = schema.get("minItems", 0)
    if isinstance(min_items, bool) or not isinstance(min_items, int) or min_items < 0:
        raise ValueError("'minItems' must be a non-negative integer")


def refuse_unsatisfiable(schema: Any) -> None:
    """ValueError where no finite value satisfies `schema` or one of the `$ref`s it uses (resolved
    within it): a `$ref` that leads back to itself without anything written between (directly, or
    through `allOf` / `anyOf` / `oneOf` members or required properties), which llguidance would
    compile and then fail on mid-generation once a value began there, optional or not; or an `enum` /
    `anyOf` with nothing satisfiable in it. The check is the least fixpoint of "some finite value
    satisfies it" over the schema's `$ref` targets."""
    if not isinstance(schema, dict):
        return
    refs = sorted(_refs_in(schema))
    productive: set[str] = set()
    while True:
        grown = {ref for ref in refs if ref not in productive and _satisfiable(_resolve(ref, schema), productive)}
        if not grown:
            break
        productive |= grown
    dead = [ref for ref in refs if ref not in productive]
    if dead:  # even where optional: a grammar that lets a value begin there could not end it
        raise ValueError(f"no finite value satisfies $ref {dead[0]!r} (it refers back to itself with nothing "
                         "written between)")
    if not _satisfiable(schema, productive):
        raise ValueError("no finite value satisfies this schema")


def _refs_in(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(_refs_in(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_refs_in(v) for v in node))
    return set()


_UNRESOLVED = object()


def _pointer(ref: str, root: dict) -> Any:
    """What a local `$ref` ("#/$defs/a", JSON-pointer escapes undone) points at in `root`, else
    _UNRESOLVED (a remote one too)."""
    target: Any = root
    if not ref.startswith("#"):
        return _UNRESOLVED
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return _UNRESOLVED
        target = target[part]
    return target


def _resolve(ref: str, root: dict) -> Any:
    """`_pointer`'s target; one that does not resolve (refused where a grammar is built) is no cycle here."""
    target = _pointer(ref, root)
    return True if target is _UNRESOLVED else target


def _satisfiable(node: Any, productive: set[str]) -> bool:
    """Whether some finite value satisfies `node`, taking the `$ref`s in `productive` to be so
    (and no other: the fixpoint grows the set). Keywords that only narrow values (bounds, patterns)
    are not looked at: this is about grammars that can never end."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    if isinstance(node.get("$ref"), str) and node["$ref"] not in productive:
        return False
    if isinstance(node.get("enum"), list) and not node["enum"]:
        return False
    if isinstance(node.get("allOf"), list) and not all(_satisfiable(m, productive) for m in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(_satisfiable(m, productive) for m in node[key]):
            return False
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    if not all(_satisfiable(properties[k], productive) for k in required if isinstance(k, str) and k in properties):
        return False
    min_items = node.get("minItems")
    if isinstance(min_items, int) and min_items >= 1 and isinstance(node.get("items"), (dict, bool)):
        return _satisfiable(node["items"], productive)
    return True


def _key(name: str) -> str:
    if not name or name != name.strip() or _KEY_BAD & set(name):
        raise ValueError(f"property name {name!r} cannot be written as a bare key in the Gemma 4 value syntax")
    return name


def _merge_all_of(schema: dict) -> dict:
    merged = {k: v for k, v in schema.items() if k != "allOf"}
    for part in schema["allOf"]:
        if not isinstance(part, dict):
            continue
        _check_keywords(part)
        for k, v in part.items():
            if k == "properties":
                merged["properties"] = {**merged.get("properties", {}), **v}
            elif k == "required":
                merged["required"] = list(dict.fromkeys([*merged.get("required", []), *v]))
            else:
                merged.setdefault(k, v)
    return merged
