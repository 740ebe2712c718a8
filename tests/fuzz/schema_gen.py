"""Hypothesis strategies drawn from the router's OpenAPI document (router/openapi.py, generated
from the pydantic models of router/protocol.py).

`SchemaGen(doc, limits)` turns the document's JSON schemas into strategies: `body(name)` draws
request bodies of `components.schemas[name]` that the document's own validator accepts, and
`validator(name)` is that validator (JSON Schema 2020-12, `$ref`s resolved inside the
document). Only the keywords the document uses are understood; a field with `examples` is drawn
from them (so guided_json, tools, ... are specs that compile), everything else from its type
and bounds, capped by `Limits` so a request stays cheap to serve. Objects get their required
fields, a few optional ones, and, where `additionalProperties` is true at the top level, a few
unknown ones (the router names those in X-Tandem-Ignored-Fields).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

DOC_URI = "urn:tandem:openapi"

# Any JSON value, small: what a field without a type (`user`, ...) or an unknown field gets.
JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**31), 2**31)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


@dataclass(slots=True)
class Limits:
    """Caps on generated values (schema bounds still hold: a cap only narrows them)."""

    int_span: int = 64  # an integer without a maximum draws from [minimum, minimum + span]
    text: int = 24  # longest generated string
    items: int = 4  # longest generated array
    optional: int = 4  # optional fields per object, at most
    unknown: int = 1  # unknown top-level fields per body, at most
    ints: dict[str, tuple[int, int]] = field(default_factory=dict)  # by field name
    always: tuple[str, ...] = ()  # optional fields every body of an object carries

    def __post_init__(self) -> None:
        if min(self.int_span, self.text, self.items, self.optional, self.unknown) < 0:
            raise ValueError("limits must be >= 0")
        for name, (lo, hi) in self.ints.items():
            if lo > hi:
                raise ValueError(f"empty range for {name}: [{lo}, {hi}]")


class SchemaGen:
    def __init__(self, doc: dict, limits: Limits | None = None) -> None:
        self.doc = doc
        self.limits = limits or Limits()
        resource = Resource.from_contents(doc, default_specification=DRAFT202012)
        self.registry = Registry().with_resource(DOC_URI, resource)

    def schema(self, name: str) -> dict:
        return self.doc["components"]["schemas"][name]

    def validator(self, name: str) -> Draft202012Validator:
        return self.validator_at("components", "schemas", name)

    def validator_at(self, *pointer: str) -> Draft202012Validator:
        """The validator of the schema at `pointer` (keys from the document's root down)."""
        escaped = "/".join(p.replace("~", "~0").replace("/", "~1") for p in pointer)
        return Draft202012Validator({"$ref": f"{DOC_URI}#/{escaped}"}, registry=self.registry)

    def body(self, name: str) -> st.SearchStrategy[dict]:
        """Bodies of schema `name` that the document's validator accepts."""
        check = self.validator(name)
        schema = self.schema(name)
        if "properties" not in schema and "oneOf" in schema:  # one of several bodies
            bodies = [self._object(self.resolve(s), top=True) for s in schema["oneOf"]]
            return st.one_of(bodies).filter(check.is_valid)
        return self._object(schema, top=True).filter(check.is_valid)

    def resolve(self, schema: dict) -> dict:
        ref = schema.get("$ref")
        if ref is None:
            return schema
        node: Any = self.doc
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]
        return self.resolve({**node, **{k: v for k, v in schema.items() if k != "$ref"}})

    def value(self, schema: dict, name: str = "") -> st.SearchStrategy[Any]:
        """Values `schema` allows (before its conditionals, which `body` filters on)."""
        schema = self.resolve(schema)
        if "examples" in schema:
            return st.sampled_from(schema["examples"]).map(copy.deepcopy)
        if "const" in schema:
            return st.just(copy.deepcopy(schema["const"]))
        if "enum" in schema:
            return st.sampled_from(schema["enum"]).map(copy.deepcopy)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return st.one_of([self.value(s, name) for s in schema[key]])
        kind = schema.get("type")
        if kind is None:
            return JSON_VALUES
        if isinstance(kind, list):
            return st.one_of([self.value({**schema, "type": k}, name) for k in kind])
        return self._typed(kind, schema, name)

    def _typed(self, kind: str, schema: dict, name: str) -> st.SearchStrategy[Any]:
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind == "integer":
            return self._integer(schema, name)
        if kind == "number":
            lo = schema.get("minimum", schema.get("exclusiveMinimum"))
            return st.floats(
                lo,
                schema.get("maximum"),
                exclude_min="exclusiveMinimum" in schema,
                allow_nan=False,
                allow_infinity=False,
            )
        if kind == "string":
            if "pattern" in schema:
                return st.from_regex(schema["pattern"], fullmatch=True)
            lo = schema.get("minLength", 0)
            return st.text(min_size=lo, max_size=max(lo, self.limits.text))
        if kind == "array":
            lo = schema.get("minItems", 0)
            hi = min(schema.get("maxItems", self.limits.items), max(lo, self.limits.items))
            items = self.value(schema["items"], name) if "items" in schema else JSON_VALUES
            return st.lists(items, min_size=lo, max_size=hi)
        if kind == "object":
            return self._object(schema, top=False)
        raise ValueError(f"schema type {kind!r} is not handled")

    def _integer(self, schema: dict, name: str) -> st.SearchStrategy[int]:
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if name in self.limits.ints:
            cap_lo, cap_hi = self.limits.ints[name]
            lo = cap_lo if lo is None else max(lo, cap_lo)
            hi = cap_hi if hi is None else min(hi, cap_hi)
        elif hi is None:
            hi = (0 if lo is None else lo) + self.limits.int_span
        return st.integers(lo, hi)

    def _object(self, schema: dict, top: bool) -> st.SearchStrategy[dict]:
        props: dict = schema.get("properties", {})
        if not props:
            return st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=self.limits.items)
        required = [k for k in schema.get("required", []) if k in props]
        always = [k for k in self.limits.always if k in props and k not in required]
        optional = sorted(set(props) - set(required) - set(always))
        unknown = self.limits.unknown if top and schema.get("additionalProperties") else 0
        limits = self.limits

        pick = st.lists(st.sampled_from(optional), unique=True, max_size=limits.optional)

        @st.composite
        def draw_object(draw) -> dict:
            chosen = draw(pick) if optional else []
            out = {k: draw(self.value(props[k], k)) for k in [*required, *always, *chosen]}
            names = st.text(min_size=1, max_size=12).filter(lambda n: n not in props)
            for extra in draw(st.lists(names, unique=True, max_size=unknown)):
                out[extra] = draw(JSON_VALUES)
            return out

        return draw_object()
