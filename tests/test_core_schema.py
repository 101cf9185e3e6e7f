"""Validation on write (P4): every kind of declared state, failing field paths, migrations."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, Union

import pytest
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag
from typing_extensions import NotRequired, TypedDict

from remit_core import CheckpointInvalid, Migrations, StateSchema, VersionMismatch


class OrderDict(TypedDict):
    order_id: str
    amount: int
    approved_by: str | None
    charged: bool
    log: list[str]
    note: NotRequired[str]


class Line(BaseModel):
    sku: str
    qty: int = Field(ge=1)


class Order(BaseModel):
    order_id: str
    amount: int = Field(ge=0)
    lines: list[Line] = []
    log: list[str] = []


@dataclasses.dataclass
class OrderDC:
    order_id: str
    amount: int
    lines: list[Line] = dataclasses.field(default_factory=list)


ORDER_JSON = {
    "type": "object",
    "required": ["order_id", "amount"],
    "properties": {
        "order_id": {"type": "string"},
        "amount": {"type": "integer", "minimum": 0, "maximum": 1000},
        "status": {"enum": ["new", "paid"]},
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["qty"],
                "properties": {"qty": {"type": ["integer", "null"]}},
            },
        },
    },
}

GOOD = {"order_id": "o1", "amount": 5, "approved_by": None, "charged": False, "log": []}


def field_of(schema: StateSchema, value: Any) -> str | None:
    with pytest.raises(CheckpointInvalid) as err:
        schema.validate(value, run_id="r1", checkpoint_id="c9")
    assert (err.value.run_id, err.value.checkpoint_id) == ("r1", "c9")
    assert err.value.field is not None and err.value.field in str(err.value)
    return err.value.field


# -- TypedDict -----------------------------------------------------------------------


def test_typed_dict_valid_and_invalid_fields() -> None:
    schema = StateSchema(OrderDict)
    assert schema.validate(GOOD) == GOOD
    assert schema.validate({**GOOD, "note": "n"})["note"] == "n"
    assert field_of(schema, {**GOOD, "amount": "lots"}) == "amount"
    assert field_of(schema, {k: v for k, v in GOOD.items() if k != "charged"}) == "charged"
    assert field_of(schema, {**GOOD, "log": ["a", {"x": 1}]}) == "log[1]"
    assert field_of(schema, "not a dict") == "<root>"


def test_strict_refuses_what_lax_coerces() -> None:
    lax, strict = StateSchema(OrderDict), StateSchema(OrderDict, strict=True)
    assert lax.validate({**GOOD, "amount": "7"})["amount"] == 7
    assert field_of(strict, {**GOOD, "amount": "7"}) == "amount"


def test_holds_as_is_only_for_plain_values_strict_validation_passes() -> None:
    schema = StateSchema(OrderDict)
    assert schema.holds_as_is(GOOD)
    assert not schema.holds_as_is({**GOOD, "amount": "7"})  # lax validation would convert it
    assert not schema.holds_as_is({**GOOD, "charged": 1})
    assert not schema.holds_as_is({**GOOD, "amount": -1.5})
    # A model state is never passed as is: its instances need `validate`'s second pass.
    assert not StateSchema(Order).holds_as_is(Order(order_id="o1", amount=3))
    assert not StateSchema(ORDER_JSON).holds_as_is({"order_id": "o1", "amount": 3})


# -- BaseModel ---------------------------------------------------------------------------


def test_model_instance_and_dict() -> None:
    schema = StateSchema(Order)
    order = Order(order_id="o1", amount=3, lines=[Line(sku="a", qty=2)])
    assert schema.validate(order) == order
    assert schema.validate({"order_id": "o1", "amount": 3}) == Order(order_id="o1", amount=3)
    assert field_of(schema, {"order_id": "o1", "amount": -1}) == "amount"
    assert field_of(schema, {"order_id": "o1", "amount": 1, "lines": [{"sku": "a", "qty": 0}]}) == (
        "lines[0].qty"
    )


def test_model_construct_is_caught_at_every_depth() -> None:
    schema = StateSchema(Order)
    assert field_of(schema, Order.model_construct(order_id="o1", amount=-5)) == "amount"
    assert field_of(schema, Order.model_construct(amount=1)) == "order_id"
    nested = Order(order_id="o1", amount=1, lines=[Line.model_construct(sku="a", qty="many")])
    assert field_of(schema, nested) == "lines[0].qty"


def test_assignment_without_validation_is_caught() -> None:
    schema = StateSchema(Order)
    order = Order(order_id="o1", amount=1, lines=[Line(sku="a", qty=1)])
    order.lines[0].qty = 0
    assert field_of(schema, order) == "lines[0].qty"
    order.lines[0].qty = 1
    order.amount = "free"  # type: ignore[assignment]
    assert field_of(schema, order) == "amount"


def test_aliases_and_other_model_classes() -> None:
    class Aliased(BaseModel):
        amount: int = Field(alias="Amount")

    value = Aliased(Amount=4)
    assert StateSchema(Aliased).validate(value) == value

    class Lookalike(BaseModel):
        order_id: str
        amount: int

    got = StateSchema(Order).validate(Lookalike(order_id="o1", amount=2))
    assert isinstance(got, Order) and got.amount == 2

    class Paid(BaseModel):
        model_config = ConfigDict(extra="forbid")
        receipt: str

    union = StateSchema(Union[Order, Paid])  # noqa: UP007 - the runtime form under test
    assert union.validate(Paid(receipt="r")) == Paid(receipt="r")


# -- dataclass ------------------------------------------------------------------------------


def test_dataclass_instances_and_dicts() -> None:
    schema = StateSchema(OrderDC)
    good = OrderDC("o1", 2, [Line(sku="a", qty=1)])
    assert schema.validate(good) == good
    assert schema.validate({"order_id": "o1", "amount": 2}) == OrderDC("o1", 2)
    assert field_of(schema, OrderDC("o1", "two")) == "amount"  # type: ignore[arg-type]
    assert field_of(schema, OrderDC("o1", 2, [Line.model_construct(sku="a", qty=0)])) == (
        "lines[0].qty"
    )


# -- JSON schema -------------------------------------------------------------------------------


def test_json_schema_dict() -> None:
    schema = StateSchema(ORDER_JSON)
    value = {"order_id": "o1", "amount": 5, "status": "new", "lines": [{"qty": 1}, {"qty": None}]}
    assert schema.validate(value) is value
    assert field_of(schema, {"amount": 5}) == "order_id"
    assert field_of(schema, {"order_id": 1, "amount": 5}) == "order_id"
    assert field_of(schema, {"order_id": "o", "amount": -1}) == "amount"
    assert field_of(schema, {"order_id": "o", "amount": 1001}) == "amount"
    assert field_of(schema, {"order_id": "o", "amount": True}) == "amount"
    assert field_of(schema, {"order_id": "o", "amount": 1.5}) == "amount"
    assert field_of(schema, {"order_id": "o", "amount": 1, "status": "lost"}) == "status"
    assert field_of(
        schema, {"order_id": "o", "amount": 1, "lines": [{"qty": 1}, {"qty": "x"}]}
    ) == ("lines[1].qty")
    assert field_of(schema, {"order_id": "o", "amount": 1, "lines": [{}]}) == "lines[0].qty"
    assert field_of(schema, []) == "<root>"


@pytest.mark.parametrize(
    ("keyword", "schema", "good", "bad"),
    [
        ("pattern", {"type": "string", "pattern": "^o[0-9]+$"}, "o12", "x12"),
        ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
        ("multipleOf", {"type": "integer", "multipleOf": 5}, 10, 12),
        ("minItems", {"type": "array", "minItems": 2}, [1, 2], [1]),
        ("uniqueItems", {"type": "array", "uniqueItems": True}, (1, 2), [1, 1]),
        ("anyOf/const", {"anyOf": [{"const": "a"}, {"type": "integer"}]}, 3, "b"),
        ("additionalProperties", {"type": "object", "additionalProperties": False}, {}, {"x": 1}),
        ("$ref", {"$ref": "#/$defs/positive"}, 1, 0),
    ],
)
def test_json_schema_keywords_are_all_enforced(
    keyword: str, schema: dict[str, Any], good: Any, bad: Any
) -> None:
    defs = {"positive": {"minimum": 1}}
    state = StateSchema({"type": "object", "$defs": defs, "properties": {"v": schema}})
    assert state.validate({"v": good}) == {"v": good}
    assert field_of(state, {"v": bad}) == "v"


def test_a_json_schema_that_is_not_one_is_refused_when_declared() -> None:
    with pytest.raises(ValueError, match="not a valid JSON Schema"):
        StateSchema({"type": "object", "properties": {"v": {"minimum": "one"}}})


# -- migrations --------------------------------------------------------------------------------


def test_migrations_step_by_step() -> None:
    migrations = Migrations()

    @migrations.register(1)
    def add_log(state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "log": []}

    @migrations.register(2)
    def cents(state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "amount": state["amount"] * 100}

    with pytest.raises(ValueError):
        migrations.register(1)(add_log)
    schema = StateSchema(dict, version=3, migrations=migrations)
    assert schema.upgrade({"amount": 2}, 1) == {"amount": 200, "log": []}
    assert schema.upgrade({"amount": 2, "log": []}, 2) == {"amount": 200, "log": []}
    same = {"amount": 2}
    assert schema.upgrade(same, 3) is same
    with pytest.raises(VersionMismatch) as err:
        schema.upgrade({}, 4, run_id="r1", checkpoint_id="c1")
    assert (err.value.run_id, err.value.checkpoint_id) == ("r1", "c1")
    with pytest.raises(VersionMismatch) as err:
        StateSchema(dict, version=3).upgrade({}, 1, run_id="r1", checkpoint_id="c1")
    assert "no migration from version 1" in str(err.value)


def _kind_of(value: Any) -> str:
    """A callable discriminator that raises `TypeError` on a value of no kind it knows
    (as LangChain's message discriminator does); Pydantic lets that through."""
    if isinstance(value, dict):
        return str(value["kind"])
    if hasattr(value, "kind"):
        return str(value.kind)
    raise TypeError(f"no kind in {type(value).__name__}")


class Cat(BaseModel):
    kind: Literal["cat"] = "cat"


class Dog(BaseModel):
    kind: Literal["dog"] = "dog"


class Pet(TypedDict, total=False):
    pet: Annotated[
        Union[Annotated[Cat, Tag("cat")], Annotated[Dog, Tag("dog")]],  # noqa: UP007
        Discriminator(_kind_of),
    ]


@pytest.mark.parametrize("value", ["cat", 3, None])
def test_a_validators_own_type_error_is_a_checkpoint_invalid_naming_the_field(value: Any) -> None:
    schema = StateSchema(Pet)
    assert schema.validate({"pet": Cat()}, run_id="r") == {"pet": Cat()}
    assert schema.holds_as_is({"pet": value}) is False
    with pytest.raises(CheckpointInvalid) as err:
        schema.validate({"pet": value}, run_id="r")
    assert err.value.field == "pet" and "no kind" in str(err.value)
