"""Twenty JSON schemas and the chat request for each, the structured-output workload of
tools/bench/structured.py and its tests: nested objects, arrays, enums, required fields, numbers with
bounds. Strings and arrays are bounded so that any model, the bundled one included, finishes inside
the token budget: an output cut by max_tokens is not valid JSON, whatever the grammar."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
WORD = {"type": "string", "maxLength": 12}


def _obj(required: dict, optional: dict | None = None) -> dict:
    return {
        "type": "object",
        "properties": {**required, **(optional or {})},
        "required": list(required),
        "additionalProperties": False,
    }


def _list(item: dict, most: int = 3, least: int = 0) -> dict:
    return {"type": "array", "items": item, "minItems": least, "maxItems": most}


SCHEMAS: list[tuple[str, dict]] = [
    ("a person", _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    (
        "a city",
        _obj({"city": NAME, "country": NAME, "population": {"type": "integer", "minimum": 0}}),
    ),
    (
        "a book",
        _obj(
            {
                "title": NAME,
                "author": NAME,
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            }
        ),
    ),
    (
        "a weather report",
        _obj(
            {
                "city": NAME,
                "celsius": {"type": "number", "minimum": -60, "maximum": 60},
                "sky": {"enum": ["clear", "cloudy", "rain", "snow"]},
            }
        ),
    ),
    (
        "a product",
        _obj(
            {
                "name": NAME,
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "in_stock": {"type": "boolean"},
            }
        ),
    ),
    ("a shopping list", _obj({"items": _list(WORD, 4, 1)})),
    (
        "a movie review",
        _obj(
            {
                "movie": NAME,
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "verdict": {"enum": ["watch", "skip"]},
            }
        ),
    ),
    (
        "a student",
        _obj(
            {"name": NAME, "grades": _list({"type": "integer", "minimum": 0, "maximum": 100}, 4, 1)}
        ),
    ),
    (
        "an address",
        _obj(
            {
                "person": NAME,
                "address": _obj(
                    {
                        "street": NAME,
                        "city": NAME,
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    }
                ),
            }
        ),
    ),
    (
        "a recipe",
        _obj(
            {
                "dish": NAME,
                "ingredients": _list(
                    _obj(
                        {"item": WORD, "grams": {"type": "integer", "minimum": 1, "maximum": 1000}}
                    ),
                    3,
                    1,
                ),
            }
        ),
    ),
    (
        "a traffic light",
        _obj(
            {
                "color": {"enum": ["red", "yellow", "green"]},
                "seconds": {"type": "integer", "minimum": 1, "maximum": 120},
            }
        ),
    ),
    (
        "a point in 3D",
        _obj(
            {
                "x": {"type": "number", "minimum": -100, "maximum": 100},
                "y": {"type": "number", "minimum": -100, "maximum": 100},
                "z": {"type": "number", "minimum": -100, "maximum": 100},
            }
        ),
    ),
    (
        "a calendar event",
        _obj(
            {
                "title": NAME,
                "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            },
            {"location": NAME},
        ),
    ),
    (
        "a team",
        _obj(
            {
                "team": NAME,
                "members": _list(
                    _obj({"name": NAME, "role": {"enum": ["lead", "dev", "qa"]}}), 3, 1
                ),
            }
        ),
    ),
    (
        "an HTTP response",
        _obj(
            {
                "status": {"type": "integer", "minimum": 100, "maximum": 599},
                "ok": {"type": "boolean"},
                "headers": _list(WORD, 2),
            }
        ),
    ),
    (
        "a math answer",
        _obj(
            {
                "question": NAME,
                "answer": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "steps": _list(WORD, 3),
            }
        ),
    ),
    (
        "a pet",
        _obj(
            {
                "name": NAME,
                "species": {"enum": ["cat", "dog", "bird", "fish"]},
                "age": {"type": "integer", "minimum": 0, "maximum": 30},
            },
            {"vaccinated": {"type": "boolean"}},
        ),
    ),
    (
        "a color",
        _obj({"name": NAME, "rgb": _list({"type": "integer", "minimum": 0, "maximum": 255}, 3, 3)}),
    ),
    (
        "a flight",
        _obj(
            {
                "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "stops": {"type": "integer", "minimum": 0, "maximum": 3},
            }
        ),
    ),
    (
        "a to-do item",
        _obj(
            {
                "task": NAME,
                "done": {"type": "boolean"},
                "priority": {"enum": ["low", "medium", "high"]},
                "subtasks": _list(_obj({"task": WORD, "done": {"type": "boolean"}}), 2),
            }
        ),
    ),
]


def request_text(what: str) -> str:
    """The user turn that asks for the object (the schema constrains; the text only guides)."""
    return f"Describe {what} as a JSON object."
