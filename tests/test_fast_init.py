"""``fast_init`` builds the same values as the dataclass's own ``__init__``.

Each case is a class decorated twice over, once with and once without ``fast_init``;
both are called with the same arguments and must agree field by field, in errors too.
Every class of the exporter that uses it is then checked against a twin made from its
own fields."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from dataclasses import dataclass, field
from typing import Any

import pytest

import exporter
from exporter.model.fast_init import FILENAME, fast_init


def define(source: str, namespace: dict[str, Any]) -> None:
    """Run ``source`` without this module's ``from __future__ import annotations``, so
    the dataclass decorator sees real annotations (an ``InitVar`` among them)."""
    exec(compile(source, "<test>", "exec", dont_inherit=True), namespace)


def twins(namespace: dict[str, Any], source: str) -> tuple[type, type]:
    """The class in ``source`` as the dataclass makes it, and with fast_init on top."""
    define(source, namespace)
    plain = namespace["C"]
    define(source, namespace)
    return plain, fast_init(namespace["C"])


def state(value: object) -> dict[str, Any]:
    return {f.name: getattr(value, f.name, "<unset>") for f in dataclasses.fields(value)}  # type: ignore[arg-type]


def outcome(cls: type, *args: Any, **kwargs: Any) -> object:
    try:
        return ("made", state(cls(*args, **kwargs)))
    except Exception as exc:  # the same refusal, in the same words
        init = vars(cls)["__init__"]
        return ("refused", type(exc), str(exc).replace(init.__qualname__, "C.__init__"))


BASE: dict[str, Any] = {"dataclass": dataclass, "field": field, "Any": Any}


def test_a_value_compares_hashes_and_is_replaced_as_before() -> None:
    plain, fast = twins(dict(BASE), CASES[0][0])
    value = fast(1, "y")
    assert value == fast(1, "y") and hash(value) == hash(fast(1, "y"))
    assert dataclasses.replace(value, b="z") == fast(1, "z")
    assert repr(value) == repr(plain(1, "y"))


CASES: list[tuple[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]] = [
    (
        "@dataclass(frozen=True, slots=True)\nclass C:\n    a: int\n    b: str = 'x'\n",
        [((1,), {}), ((1, "y"), {}), ((), {"a": 2, "b": "z"}), ((), {}), ((1, 2, 3), {})],
    ),
    (
        "@dataclass(frozen=True, slots=True)\nclass C:\n    a: int\n"
        "    b: list = field(default_factory=list)\n    c: int = field(default=7, init=False)\n"
        "    d: dict = field(default_factory=dict, init=False)\n",
        [((1,), {}), ((1, [5]), {}), ((1,), {"b": [6]}), ((1,), {"c": 3})],
    ),
    (
        "@dataclass(frozen=True, slots=True, kw_only=True)\nclass C:\n    a: int\n    b: int = 2\n",
        [((), {"a": 1}), ((1,), {}), ((), {"a": 1, "b": 5}), ((), {"b": 5})],
    ),
    (
        "@dataclass(frozen=True, slots=True)\nclass C:\n    a: int\n    b: int = 0\n"
        "    c: int = field(default=0, kw_only=True)\n"
        "    def __post_init__(self):\n"
        "        if self.a < 0:\n            raise ValueError('a must not be negative')\n",
        [((1,), {}), ((1, 2), {"c": 3}), ((-1,), {}), ((1, 2, 3), {})],
    ),
    (
        "@dataclass(frozen=True, slots=True, order=True)\nclass C:\n    a: int\n"
        "    b: int = field(init=False)\n",
        [((1,), {}), ((), {})],
    ),
]


@pytest.mark.parametrize(("source", "calls"), CASES)
def test_the_same_values_and_refusals_as_the_dataclass(
    source: str, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
) -> None:
    plain, fast = twins(dict(BASE), source)
    assert vars(plain)["__init__"] is not vars(fast)["__init__"]
    for args, kwargs in calls:
        assert outcome(fast, *args, **kwargs) == outcome(plain, *args, **kwargs), (args, kwargs)
    args, kwargs = calls[0]
    value = fast(*args, **kwargs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.a = 9


def test_inherited_fields_are_set_through_the_base_class_slots() -> None:
    namespace = dict(BASE)
    define(
        "@dataclass(frozen=True, slots=True)\nclass Base:\n    a: int\n"
        "@dataclass(frozen=True, slots=True)\nclass C(Base):\n    b: int = 1\n",
        namespace,
    )
    child = fast_init(namespace["C"])
    assert state(child(4)) == {"a": 4, "b": 1}


@pytest.mark.parametrize(
    ("source", "refusal"),
    [
        ("@dataclass(frozen=True)\nclass C:\n    a: int\n", "slots=True"),
        ("@dataclass(slots=True)\nclass C:\n    a: int\n", "not frozen"),
        (
            "from dataclasses import InitVar\n"
            "@dataclass(frozen=True, slots=True)\nclass C:\n    a: int\n    b: InitVar[int] = 0\n"
            "    def __post_init__(self, b): pass\n",
            "not the dataclass's own",
        ),
        ("class C:\n    a: int = 0\n", "slots=True"),
    ],
)
def test_a_class_it_cannot_speed_up_is_refused_at_import(source: str, refusal: str) -> None:
    namespace = dict(BASE)
    define(source, namespace)
    with pytest.raises(TypeError, match=refusal):
        fast_init(namespace["C"])


def test_every_class_using_it_builds_what_its_dataclass_twin_builds() -> None:
    """Each exporter class with fast_init, called with the sample arguments its own
    signature allows (a distinct object per parameter), against a twin the dataclass
    decorator makes from the same fields."""
    classes = [
        value
        for module in _modules()
        for value in vars(module).values()
        if inspect.isclass(value)
        and value.__module__ == module.__name__
        and getattr(getattr(value.__init__, "__code__", None), "co_filename", "") == FILENAME
    ]
    assert len(classes) >= 10, [c.__name__ for c in classes]
    for cls in classes:
        twin = _twin(cls)
        params = list(inspect.signature(cls).parameters.values())
        args = {p.name: object() for p in params}
        made, expected = cls(**args), twin(**args)
        assert state(made) == state(expected), cls.__name__
        required = {
            p.name: a for p, a in zip(params, args.values(), strict=True) if p.default is p.empty
        }
        assert state(cls(**required)) == state(twin(**required)), cls.__name__


def _modules() -> list[Any]:
    modules = []
    for module in pkgutil.walk_packages(exporter.__path__, "exporter."):
        if module.name.startswith("exporter.sim") or module.name.endswith("__main__"):
            continue
        modules.append(importlib.import_module(module.name))
    return modules


def _twin(cls: type) -> type:
    """A dataclass with ``cls``'s fields and options, its __init__ the generated one."""
    params = cls.__dataclass_params__  # type: ignore[attr-defined]
    fields = [
        (
            f.name,
            Any,
            dataclasses.field(
                default=f.default,
                default_factory=f.default_factory,
                init=f.init,
                kw_only=f.kw_only,  # type: ignore[arg-type]
            ),
        )
        for f in dataclasses.fields(cls)
    ]
    namespace = {"__post_init__": cls.__post_init__} if hasattr(cls, "__post_init__") else {}
    return dataclasses.make_dataclass(
        cls.__name__,
        fields,
        frozen=params.frozen,
        slots=True,
        order=params.order,
        namespace=namespace,
    )
