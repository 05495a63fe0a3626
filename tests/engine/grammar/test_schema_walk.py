"""schema_walk: llguidance's messages named by keyword, and free-string bounds that only narrow a schema."""
import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from engine.grammar.schema_walk import approximations, bound_free_strings, keywords_of, subschemas


@pytest.mark.parametrize("message, keywords", [
    ('Unimplemented keys: ["uniqueItems", "not"]', ("uniqueItems", "not")),
    ("Unknown format: semver", ("format:semver",)),
    ("oneOf not fully supported, falling back to anyOf. This may cause validation errors (2 times)", ("oneOf",)),
    ('min/maxProperties only supported when all keys listed in "properties" are required', ("minProperties",
                                                                                             "maxProperties")),
    ("Resource 'https://x.org/a.json' is not present in a registry and retrieving it failed", ("$ref",)),
    ("something else entirely", ()),
])
def test_keywords_of_names_what_llguidance_means(message, keywords):
    assert keywords_of(message) == keywords


def test_approximations_are_sorted_keywords_or_the_text():
    warnings = ['Unimplemented keys: ["uniqueItems"]', "Unknown format: path", "an unheard-of warning"]
    assert approximations(warnings) == ("an unheard-of warning", "format:path", "uniqueItems")


def test_subschemas_skip_property_names():
    schema = {"properties": {"oneOf": {"type": "string"}, "items": {"anyOf": [{"type": "integer"}]}}}
    found = list(subschemas(schema))
    assert {"type": "string"} in found and {"type": "integer"} in found and len(found) == 4


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tag": {"type": "string", "pattern": "^a"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "map": {"type": "object", "additionalProperties": {"type": "integer"}}},
          "required": ["name"]}


def test_bound_free_strings_bounds_values_and_free_keys_only():
    bounded = bound_free_strings(SCHEMA, 5)
    assert bounded["properties"]["name"]["maxLength"] == 5 and "maxLength" not in bounded["properties"]["tag"]
    assert bounded["properties"]["tags"]["items"]["maxLength"] == 5
    assert bounded["patternProperties"] == {"^.{0,5}$": {}} and bounded["additionalProperties"] is False
    assert "patternProperties" not in bounded["properties"]["map"]   # its extra values are constrained
    assert SCHEMA["properties"]["name"] == {"type": "string"}        # the original is untouched


@settings(max_examples=60, deadline=None)
@given(name=st.text(max_size=8), extra=st.dictionaries(st.text(max_size=8), st.integers(), max_size=3))
def test_what_the_bounded_schema_accepts_the_original_accepts(name, extra):
    instance = {**{k: v for k, v in extra.items() if k not in SCHEMA["properties"]}, "name": name}
    if jsonschema.Draft202012Validator(bound_free_strings(SCHEMA, 5)).is_valid(instance):
        assert jsonschema.Draft202012Validator(SCHEMA).is_valid(instance)
