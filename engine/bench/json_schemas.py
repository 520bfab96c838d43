"""Bounded JSON schemas of the shapes applications ask for (optional fields, nested objects,
arrays of enums with bounds, ``anyOf`` with number ranges): what profiling/bench_structured.py
constrains its batch with, and the engine's structured-output tests check outputs against.
Every string has a ``maxLength`` and every array a ``maxItems``, so that each output is bounded
and fits a known ``max_tokens``."""

SCHEMAS = {
    "optional-fields": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 16},
            "author": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 10},
                    "last": {"type": "string", "maxLength": 10},
                },
                "required": ["first", "last"],
            },
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        },
        "required": ["title", "author", "year"],
    },
    "arrays-enums": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 10},
                "maxItems": 4,
            },
        },
        "required": ["tags", "scores"],
    },
    "anyof-number": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": -5, "maximum": 5},
                    {"type": "string", "maxLength": 8},
                    {"type": "boolean"},
                ]
            },
            "price": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["value", "price"],
    },
}
