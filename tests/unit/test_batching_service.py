"""``@rpc(batch=...)`` definitions (refused at class definition) and the tensor helpers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest
import torch

from tensorrpc import (
    Batching,
    Continuous,
    ServiceDefinitionError,
    TensorRPCError,
    current_batch,
    describe,
    rpc,
    service,
)
from tensorrpc.batching import BatchContext, BatchItem, pad, split, stack, unpad


def test_per_item_spec_validates_one_item() -> None:
    @service
    class S:
        @rpc(batch=Batching(max_size=4))
        async def f(self, x: Sequence[int], y: list[str]) -> list[float]:
            return [0.0] * len(x)

    m = describe(S).methods["f"]
    assert m.signature == "f(x: int, y: str) -> float"
    assert m.encode_args((1, "a"), {}) == [1, "a"]
    assert m.decode_args([1, "a"]) == [1, "a"]
    assert m.is_async
    assert m.batch is not None
    assert not m.batch.continuous


def test_batching_does_not_change_the_fingerprint_of_what_travels() -> None:
    @service(name="S")
    class A:
        @rpc(batch=Batching(max_size=4))
        async def f(self, x: list[int]) -> list[int]:
            return x

    @service(name="S")
    class B:
        @rpc
        async def f(self, x: int) -> int:
            return x

    assert describe(A).fingerprint == describe(B).fingerprint


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("async def f(self, x: int) -> list[int]: ...", r"S\.f: parameter 'x' of a Batching"),
        ("async def f(self, x: list[int]) -> int: ...", r"S\.f: the return type of a Batching"),
        ("async def f(self, x: list[int] = []) -> list[int]: ...", r"S\.f: parameter 'x'.*default"),
        ("async def f(self) -> list[int]: ...", r"S\.f: a batched method needs"),
        (
            "async def f(self, x: list[int]) -> AsyncIterator[list[int]]:\n        yield x",
            r"S\.f: a batched handler returns one list",
        ),
    ],
)
def test_bad_batched_methods_are_refused_naming_the_method(body: str, message: str) -> None:
    source = f"@service\nclass S:\n    @rpc(batch=Batching())\n    {body}\n"
    scope = {"service": service, "rpc": rpc, "Batching": Batching, "AsyncIterator": AsyncIterator}
    with pytest.raises(ServiceDefinitionError, match=message):
        exec(source, scope)


def test_bad_settings_are_refused_when_the_class_is_defined() -> None:
    with pytest.raises(ServiceDefinitionError, match=r"S\.f: Batching\.max_size"):

        class S:
            @rpc(batch=Batching(max_size=0))
            async def f(self, x: list[int]) -> list[int]:
                return x

    async def f(self: object, x: list[int]) -> list[int]:
        return x

    with pytest.raises(ServiceDefinitionError, match="batch= takes Batching"):
        rpc(batch=32)(f)  # type: ignore[call-overload]


def test_continuous_methods_stream_per_item() -> None:
    @service
    class S:
        @rpc(batch=Continuous(max_size=4))
        def gen(self, n: list[int]) -> list[str]:
            return ["x"] * len(n)

    m = describe(S).methods["gen"]
    assert m.streaming
    assert m.signature == "gen(n: int) -> AsyncIterator[str]"
    assert m.batch is not None
    assert m.batch.continuous
    assert not m.batch.is_async


def test_current_batch_outside_a_handler_is_an_error() -> None:
    with pytest.raises(TensorRPCError, match="only available inside a batched handler"):
        current_batch()


def test_batch_context_checks_indices_and_kinds() -> None:
    ctx = BatchContext([BatchItem(), BatchItem()], continuous=False)
    assert ctx.size == 2
    with pytest.raises(IndexError):
        ctx.fail(2, ValueError())
    with pytest.raises(TypeError):
        ctx.fail(0, "no")  # type: ignore[arg-type]
    with pytest.raises(TensorRPCError, match="Continuous"):
        ctx.end(0)
    assert ctx.cancelled() == frozenset()


def test_stack_and_split_round_trip_without_copies() -> None:
    batch = torch.arange(12.0).reshape(4, 3)
    rows = split(batch)
    assert all(r.data_ptr() == batch[i].data_ptr() for i, r in enumerate(rows))
    again = stack(rows)
    assert again.data_ptr() == batch.data_ptr()  # consecutive rows: a view, no copy
    assert torch.equal(again, batch)
    separate = [torch.full((3,), float(i)) for i in range(4)]
    stacked = stack(separate)
    assert stacked.shape == (4, 3)
    assert torch.equal(stacked[2], separate[2])
    assert stack(rows[::-1]).data_ptr() != batch.data_ptr()  # out of order: copied
    with pytest.raises(ValueError, match="one shape"):
        stack([torch.ones(2), torch.ones(3)])
    with pytest.raises(ValueError, match="at least one"):
        stack([])


def test_pad_and_unpad() -> None:
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([], dtype=torch.int64)]
    padded, mask = pad(seqs, value=-1)
    assert padded.tolist() == [[1, 2, 3], [4, -1, -1], [-1, -1, -1]]
    assert mask.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    back = unpad(padded, mask.sum(1))
    assert [b.tolist() for b in back] == [[1, 2, 3], [4], []]
    assert back[0].data_ptr() == padded.data_ptr()  # views
    with pytest.raises(ValueError, match="lengths"):
        unpad(padded, [1])
    with pytest.raises(ValueError, match="out of range"):
        unpad(padded, [1, 2, 9])
    with pytest.raises(ValueError, match="trailing shape"):
        pad([torch.ones(2, 2), torch.ones(2, 3)])
