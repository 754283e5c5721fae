"""Input schemas derived from a tool's type hints: a `TypedDict` (nested ones, lists,
`Optional`, `Literal`, `Annotated[int, {"minimum": 0}]` for ranges) or a pydantic model
(`model_json_schema()`, and the arguments validated into the model). Unknown arguments
are refused (`additionalProperties: false`) unless the tool allows them. It shapes
schemas only; the coordinator validates every call against them."""

import dataclasses
import typing


def is_typeddict(annotation):
    """`typing.is_typeddict` (Python 3.10) for 3.9 as well."""
    return (isinstance(annotation, type) and issubclass(annotation, dict)
            and hasattr(annotation, "__total__"))

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


class ArgumentsError(TypeError):
    """A tool's arguments cannot be described as a JSON object schema; names the fix."""


def _is_pydantic(annotation):
    return isinstance(annotation, type) and hasattr(annotation, "model_json_schema")


def _schema(annotation, allow_unknown, defs):
    """The JSON Schema of one annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        schema = _schema(args[0], allow_unknown, defs)
        for extra in args[1:]:
            if isinstance(extra, dict):
                schema = {**schema, **extra}
        return schema
    if annotation in _SCALARS:
        return {"type": _SCALARS[annotation]}
    if annotation is typing.Any:
        return {}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        return {"anyOf": [_schema(a, allow_unknown, defs) for a in args]}
    if origin in (list, tuple, set, frozenset) or annotation in (list, tuple, set):
        item = args[0] if args else typing.Any
        return {"type": "array", "items": _schema(item, allow_unknown, defs)}
    if origin is dict or annotation is dict:
        value = args[1] if len(args) == 2 else typing.Any
        return {"type": "object", "additionalProperties": _schema(value, allow_unknown, defs)}
    if is_typeddict(annotation):
        return _typeddict(annotation, allow_unknown, defs)
    raise ArgumentsError(f"no JSON Schema for {annotation!r}: use str, int, float, bool, "
                         "lists, dicts, Optional, Literal, Annotated or a nested TypedDict")


def _typeddict(cls, allow_unknown, defs):
    hints = typing.get_type_hints(cls, include_extras=True)
    required = getattr(cls, "__required_keys__", set(hints))
    schema = {"type": "object",
              "properties": {k: _schema(v, allow_unknown, defs) for k, v in hints.items()}}
    wanted = [k for k in hints if k in required]
    if wanted:
        schema["required"] = wanted
    if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
        schema["description"] = " ".join(cls.__doc__.split())
    if not allow_unknown:
        schema["additionalProperties"] = False
    return schema


def arguments_of(annotation, function, allow_unknown):
    """(input schema, convert) for a tool whose `args` are annotated `annotation`:
    `convert` turns the call's arguments into what the function takes (a pydantic model
    instance), or is None when it takes the dict as it is."""
    if annotation is None:
        raise ArgumentsError(
            f"tool {function}: give `args` a TypedDict or pydantic model type (its schema "
            "is what the model sees, unknown arguments refused), or pass input_schema=; "
            "`args: dict` accepts any object")
    if annotation is dict or typing.get_origin(annotation) is dict:
        return {"type": "object"}, None
    if _is_pydantic(annotation):
        schema = annotation.model_json_schema()
        schema.pop("title", None)
        extra = getattr(annotation, "model_config", {}).get("extra")
        if not allow_unknown and extra != "allow":
            schema["additionalProperties"] = False
        return schema, annotation.model_validate
    if is_typeddict(annotation):
        return _typeddict(annotation, allow_unknown, {}), None
    if dataclasses.is_dataclass(annotation):
        raise ArgumentsError(f"tool {function}: a dataclass has no schema here; use a "
                             "TypedDict or a pydantic model")
    raise ArgumentsError(
        f"tool {function}: arguments are always a JSON object, so `args: {annotation!r}` "
        "can never be called: use a TypedDict or pydantic model, or take no arguments")
