"""What of a JSON schema the grammar engine enforces, decided before any grammar is built.

A guided reply (`response_format` json_schema, forced tool calls) is promised to validate
against its schema, so a schema is either enforced exactly or refused with a 400 naming the
keyword and where it is: never a silently looser grammar. What xgrammar 0.2.9 (the installed
engine) enforces, probed value by value against `jsonschema`:

    any type     type (one or a list), enum, const, anyOf, allOf of one schema, oneOf whose
                 branches are of different types, local $ref ("#", "#/$defs/…", "#/definitions/…",
                 any JSON pointer; recursive too), annotations (title, description, default, …)
    string       minLength, maxLength, pattern (no look-arounds, no backreferences), format
                 (FORMATS below)
    integer      minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf
    number       the same bounds (multipleOf is ignored by the engine: refused)
    array        items, prefixItems, minItems, maxItems (uniqueItems is ignored: refused)
    object       properties, required, additionalProperties, minProperties, maxProperties,
                 patternProperties, propertyNames; properties a schema does not declare are
                 never generated (xgrammar's strict mode), so `required` must name declared ones

Refused as not enforced: not, if/then/else, contains, dependentRequired/dependentSchemas,
allOf of several, oneOf of overlapping branches, uniqueItems, number multipleOf, pattern
beside minLength/maxLength, string/number/array/object keywords without a `type` saying so,
keywords beside `$ref`, remote refs, unknown formats. Refused as unsatisfiable: `false`,
enum [] (or no enum value passing the rest of the schema), const failing the rest, min > max
of every kind, a recursive $ref with no finite value.

    check(schema, "response_format.json_schema.schema") -> the schema, normalized
        (enum values the rest of the schema rejects dropped, integer bounds rounded inward)
"""
from __future__ import annotations

import copy
import math
import re

from kvmesh.workers.sampling.params import InvalidRequestError

FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                     "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                         "deprecated", "readOnly", "writeOnly", "$defs", "definitions"})
BY_TYPE = {"string": {"pattern", "minLength", "maxLength", "format"},
           "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
           "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
           "array": {"items", "prefixItems", "minItems", "maxItems", "uniqueItems"},
           "object": {"properties", "required", "additionalProperties", "minProperties", "maxProperties",
                      "patternProperties", "propertyNames"}}
ANY_TYPE = {"type", "enum", "const", "anyOf", "allOf", "oneOf", "$ref"}
TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")
_BACKREF = re.compile(r"\\[1-9]|\\k<")


class _Where:
    """A place in the request (`tools[0].function.parameters.properties.x`) for the 400's param."""

    def __init__(self, path: str):
        self.path = path

    def __truediv__(self, key) -> "_Where":
        return _Where(f"{self.path}[{key}]" if isinstance(key, int) else f"{self.path}.{key}")

    def refuse(self, keyword: str, why: str) -> InvalidRequestError:
        return InvalidRequestError(f"`{keyword}` {why}", f"{self.path}.{keyword}")


def check(schema, where: str) -> dict:
    """The schema normalized, or InvalidRequestError naming the keyword the engine cannot enforce
    or that no value satisfies (its `field` is where: `where` + the path inside the schema)."""
    if schema is True:
        return {}
    if not isinstance(schema, dict):
        raise InvalidRequestError("must be a JSON object (a schema); `false` accepts no value", where)
    root = copy.deepcopy(schema)
    walker = _Walker(root, _Where(where))
    walker.walk(root, walker.where)
    walker.check_finite()
    return root


class _Walker:
    def __init__(self, root: dict, where: _Where):
        self.root, self.where = root, where
        self.refs: dict[str, tuple[object, _Where]] = {}      # pointer -> (target, its place)

    def walk(self, s, at: _Where) -> None:
        if s is False:
            raise InvalidRequestError("`false` accepts no value", at.path)
        if s is True:
            return
        if not isinstance(s, dict):
            raise InvalidRequestError("must be a schema (an object or a boolean)", at.path)
        if "$ref" in s:
            return self._ref(s, at)
        types = self._types(s, at)
        for key in s:
            self._known(key, s, types, at)
        self._children(s, types, at)
        self._bounds(s, types, at)
        self._values(s, at)

    def _types(self, s: dict, at: _Where) -> set[str]:
        t = s.get("type")
        types = [t] if isinstance(t, str) else t if isinstance(t, list) else None
        if t is not None and (types is None or not types or any(x not in TYPES for x in types)):
            raise at.refuse("type", f"must be one of {list(TYPES)} or a non-empty list of them")
        return set(types or ())

    def _known(self, key: str, s: dict, types: set[str], at: _Where) -> None:
        if key in ANNOTATIONS or key in ANY_TYPE:
            return
        owners = [t for t, kws in BY_TYPE.items() if key in kws]
        if owners:
            if not types & set(owners):
                raise at.refuse(key, f"needs `type` {' or '.join(map(repr, owners))} beside it "
                                     "(the grammar engine applies it only to a declared type)")
            return
        if key in ("unevaluatedProperties", "unevaluatedItems") and s[key] is False:
            return                               # what the engine's strict mode does anyway
        if key in ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
                   "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems",
                   "additionalItems", "$dynamicRef", "$recursiveRef", "$anchor", "$dynamicAnchor"):
            raise at.refuse(key, "is not enforced by the grammar engine; express the schema without it")
        # any other key is no JSON Schema keyword: validators ignore it, and so does the grammar

    def _children(self, s: dict, types: set[str], at: _Where) -> None:
        for key in ("anyOf", "allOf", "oneOf"):
            if key in s and (not isinstance(s[key], list) or not s[key]):
                raise at.refuse(key, "must be a non-empty list of schemas")
        if len(s.get("allOf", ())) > 1:
            raise at.refuse("allOf", "of more than one schema is not enforced by the grammar engine; "
                                     "merge them into one")
        if len(s.get("oneOf", ())) > 1 and not _disjoint(s["oneOf"]):
            raise at.refuse("oneOf", "branches must differ in `type` (the grammar engine enforces overlapping "
                                     "ones as anyOf); use anyOf if a value may match several")
        for key in ("anyOf", "allOf", "oneOf"):
            for i, sub in enumerate(s.get(key, ())):
                self.walk(sub, at / key / i)
        for key in ("properties", "patternProperties"):
            for name, sub in _mapping(s, key, at).items():
                self.walk(sub, at / key / name)
        for key in ("additionalProperties", "propertyNames", "items"):
            if key in s:
                if isinstance(s[key], list):
                    raise at.refuse(key, "must be a schema (for a tuple use prefixItems)")
                if s[key] is not False:
                    self.walk(s[key], at / key)
        for i, sub in enumerate(s.get("prefixItems") or ()):
            self.walk(sub, at / "prefixItems" / i)
        for key in ("$defs", "definitions"):
            _mapping(s, key, at)                 # walked where a $ref uses them

    def _bounds(self, s: dict, types: set[str], at: _Where) -> None:
        for lo, hi in (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties")):
            for key in (lo, hi):
                if key in s and not (isinstance(s[key], int) and not isinstance(s[key], bool) and s[key] >= 0):
                    raise at.refuse(key, "must be a non-negative integer")
            if s.get(lo, 0) > s.get(hi, math.inf):
                raise at.refuse(lo, f"{s[lo]} is over {hi} {s[hi]}: no value satisfies both")
        if "pattern" in s:
            self._pattern(s, at)
        if "format" in s and s["format"] not in FORMATS:
            raise at.refuse("format", f"{s['format']!r} is not enforced by the grammar engine "
                                      f"(it enforces {sorted(FORMATS)}); use a pattern")
        if "number" in types and "multipleOf" in s:
            raise at.refuse("multipleOf", "is enforced for integers only by the grammar engine")
        if s.get("uniqueItems") and s.get("maxItems", 2) > 1:
            raise at.refuse("uniqueItems", "is not enforced by the grammar engine")
        self._numbers(s, types, at)
        self._shapes(s, at)

    def _shapes(self, s: dict, at: _Where) -> None:
        """Objects and arrays no value fits: required names outside properties, counts over limits."""
        required = s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise at.refuse("required", "must be a list of property names")
        missing = [k for k in required if k not in (s.get("properties") or {})]
        if missing:
            raise at.refuse("required", f"names {missing}, not among `properties` (the grammar engine "
                                        "generates only declared properties)")
        if len(set(required)) > s.get("maxProperties", math.inf):
            raise at.refuse("maxProperties", "is under the number of required properties")
        if s.get("items") is False and s.get("minItems", 0) > len(s.get("prefixItems") or ()):
            raise at.refuse("minItems", "exceeds prefixItems while items is false")
        closed = s.get("additionalProperties") in (None, False)
        if closed and s.get("minProperties", 0) > len(s.get("properties") or {}):
            raise at.refuse("minProperties", "exceeds the declared properties (undeclared ones are never "
                                             "generated)")

    def _pattern(self, s: dict, at: _Where) -> None:
        p = s["pattern"]
        if not isinstance(p, str):
            raise at.refuse("pattern", "must be a string")
        try:
            re.compile(p)
        except re.error as e:
            raise at.refuse("pattern", f"is not a valid regular expression: {e}") from None
        if _LOOKAROUND.search(p) or _BACKREF.search(p):
            raise at.refuse("pattern", "uses a look-around or backreference, which the grammar engine "
                                       "does not enforce")
        for key in ("minLength", "maxLength"):
            if key in s:
                raise at.refuse(key, "cannot be combined with `pattern` (the grammar engine ignores it "
                                     "there); put the length into the pattern")

    def _numbers(self, s: dict, types: set[str], at: _Where) -> None:
        for key in BY_TYPE["integer"]:
            if key in s and (not isinstance(s[key], (int, float)) or isinstance(s[key], bool)
                             or not math.isfinite(s[key])):
                raise at.refuse(key, "must be a finite number")
        if s.get("multipleOf", 1) <= 0 or ("multipleOf" in s and s["multipleOf"] != int(s["multipleOf"])):
            raise at.refuse("multipleOf", "must be a positive integer")
        if "integer" in types and "number" not in types:   # whole, inclusive bounds (what the engine takes)
            for key, rnd, step, side, pick in (("minimum", math.ceil, 0, "minimum", max),
                                               ("exclusiveMinimum", math.floor, 1, "minimum", max),
                                               ("maximum", math.floor, 0, "maximum", min),
                                               ("exclusiveMaximum", math.ceil, -1, "maximum", min)):
                if key in s:
                    bound = int(rnd(s.pop(key))) + step
                    s[side] = pick(s.get(side, bound), bound)
        lo = max(s.get("minimum", -math.inf), s.get("exclusiveMinimum", -math.inf))
        hi = min(s.get("maximum", math.inf), s.get("exclusiveMaximum", math.inf))
        empty = lo > hi or (lo == hi and ("exclusiveMinimum" in s and s["exclusiveMinimum"] == lo
                                          or "exclusiveMaximum" in s and s["exclusiveMaximum"] == hi))
        if empty and types and types <= {"integer", "number"}:
            raise at.refuse("minimum" if "minimum" in s else "exclusiveMinimum",
                            "is over the maximum: no number satisfies both")
        if "multipleOf" in s in s and math.isfinite(lo) and math.isfinite(hi) \
                and math.ceil(lo / s["multipleOf"]) * s["multipleOf"] > hi:
            raise at.refuse("multipleOf", "has no multiple between the bounds")

    def _values(self, s: dict, at: _Where) -> None:
        """enum / const: each value must pass the rest of the schema (the engine checks only the
        value list); failing enum values are dropped, a failing const or no enum value left is a 400."""
        passes = _test({k: v for k, v in s.items() if k not in ("enum", "const")}, self.root)
        if "const" in s and not passes(s["const"]):
            raise at.refuse("const", "fails the rest of its schema: no value satisfies it")
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                raise at.refuse("enum", "is empty: no value satisfies it")
            s["enum"] = [v for v in s["enum"] if passes(v) and ("const" not in s or v == s["const"])]
            if not s["enum"]:
                raise at.refuse("enum", "has no value that passes the rest of its schema")

    def _ref(self, s: dict, at: _Where) -> None:
        ref = s["$ref"]
        extra = [k for k in s if k != "$ref" and k not in ANNOTATIONS]
        if extra:
            raise at.refuse(extra[0], "beside `$ref` is not enforced by the grammar engine; "
                                      "move it into the referenced schema or use allOf of one")
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise at.refuse("$ref", f"{ref!r} is not a local reference (\"#\" or \"#/…\" into this schema)")
        if ref in self.refs:
            return
        target = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise at.refuse("$ref", f"{ref!r} points at nothing in this schema")
        place = _Where(f"{self.where.path}{ref[1:].replace('/', '.')}")
        self.refs[ref] = (target, place)
        self.walk(target, place)

    def check_finite(self) -> None:
        """A recursive $ref must have a finite value: fixpoint of which refs have one."""
        known = {ref: False for ref in self.refs}
        changed = True
        while changed:
            changed = False
            for ref, (target, _) in self.refs.items():
                if not known[ref] and _has_value(target, known):
                    known[ref] = changed = True
        for ref, has in known.items():
            if not has:
                raise self.refs[ref][1].refuse("$ref", f"{ref!r} recurses with no finite value (every path "
                                                       "through it requires itself again)")


def _mapping(s: dict, key: str, at: _Where) -> dict:
    v = s.get(key, {})
    if not isinstance(v, dict):
        raise at.refuse(key, "must be an object")
    return v


def _disjoint(branches: list) -> bool:
    """oneOf branches each of one plain type, no two alike (integer and number overlap)."""
    seen = []
    for b in branches:
        t = b.get("type") if isinstance(b, dict) else None
        if not isinstance(t, str) or "$ref" in b or t in seen or {t, *seen} >= {"integer", "number"}:
            return False
        seen.append(t)
    return True


def _test(schema: dict, root: dict):
    """value -> whether it passes `schema` (a part of `root`: its refs into root's $defs or
    definitions resolve; one to another place cannot here, and the value is kept)."""
    import jsonschema
    from referencing.exceptions import Unresolvable
    validator = jsonschema.Draft202012Validator(
        {**schema, **{k: root[k] for k in ("$defs", "definitions") if k in root}})

    def passes(value) -> bool:
        try:
            return validator.is_valid(value)
        except Unresolvable:
            return True
    return passes


def _has_value(s, known: dict[str, bool]) -> bool:
    """Whether schema `s` has a finite instance, given which refs are known to have one."""
    if not isinstance(s, dict):
        return s is not False
    if "$ref" in s:
        return known.get(s["$ref"], False)
    if "enum" in s or "const" in s:
        return True
    if not all(_has_value(sub, known) for sub in s.get("allOf", ())):
        return False
    for key in ("anyOf", "oneOf"):
        if key in s and not any(_has_value(sub, known) for sub in s[key]):
            return False
    types = s.get("type")
    return any(_type_has_value(t, s, known) for t in ([types] if isinstance(types, str) else types or TYPES))


def _type_has_value(t: str, s: dict, known: dict[str, bool]) -> bool:
    if t == "object":
        props = s.get("properties") or {}
        return all(_has_value(props.get(k, True), known) for k in s.get("required") or ())
    if t == "array":
        prefix, need = s.get("prefixItems") or [], s.get("minItems", 0)
        return all(_has_value(p, known) for p in prefix[:need]) and (
            need <= len(prefix) or _has_value(s.get("items", True), known))
    return True
